"""``python -m lightning_para.cli.parity_worker``: one recorded run of :func:`~lightning_para.cli.parity.compare`
on several devices. Lightning's launcher starts the other ranks with the same command; rank 0
writes the record to ``--out``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from lightning_para.cli.fit import close_process_group
from lightning_para.cli.parity import record_run


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_para.cli.parity_worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--strategy", required=True, help="ParaStrategy arguments as JSON")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs="*", help="more LightningCLI arguments (after --)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    record = record_run(args.config, json.loads(args.strategy), steps=args.steps, devices=args.devices,
                        label=args.label, extra_args=args.extra)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(record.as_dict()))
    close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
