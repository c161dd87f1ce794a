"""``lightning-para parity``: does a layout train your config like one device?

::

    lightning-para parity --config recipes/gpt-cpu-demo.yaml --layout "tp=2,pp=2" --steps 20
    lightning-para parity --config my.yaml --layout "dp=2,tp=2,sp=true" --reference "dp=4" --steps 10

Prints per-step loss and gradient-norm differences against the precision's tolerances and a
verdict; on a mismatch, the first step and the parameters whose gradients differ most. Exit
status: 0 match, 1 mismatch, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch.distributed as dist

from lightning_para.lightning_cli import ConfigurationError
from lightning_para.parity.run import compare

PROG = "lightning-para parity"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Compare a layout's losses and gradients with one device.")
    parser.add_argument("--config", "-c", required=True, help="a LightningCLI config (or a shipped config's name)")
    parser.add_argument("--layout", required=True, help='the layout to check, e.g. "tp=2,pp=2" or "dp=4,ep=2,zero=1"')
    parser.add_argument("--reference", help="a reference layout instead of one device, e.g. \"dp=4\"")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default 20)")
    parser.add_argument("extra", nargs="*", help="more LightningCLI arguments for both runs, after --")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = compare(args.config, args.layout, steps=args.steps, reference=args.reference, extra_args=args.extra)
    except (ValueError, ConfigurationError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(report.text(), flush=True)
    return 0 if report.verdict == "match" else 1


__all__ = ["main"]
