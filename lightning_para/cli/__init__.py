"""``lightning-para``: the command line (the package of every entry point; it imports the library, never the reverse).

::

    lightning-para fit --config recipes/gpt-cpu-demo.yaml           # LightningCLI (cli/fit.py)
    lightning-para fit --config gpt-cpu-demo                         # a shipped config, by its short name
    lightning-para plan --model llama3-8b --gpus 8 --gpu h100 --seq-len 8192 --global-batch 64
    lightning-para plan --config recipes/gpt-cpu-demo.yaml --validate
    lightning-para parity --config recipes/gpt-cpu-demo.yaml --layout "tp=2,pp=2" --steps 20
    lightning-para dryrun --model llama3-405b --gpus 16384 --layout "tp=8,pp=16,zero=1,sp=true" --ranks first,last
    lightning-para dryrun --config recipes/gpt-cpu-demo.yaml --gpus 8 --ranks first,last
    lightning-para prepare --tokenizer TOKENIZER_DIR --output OUT_DIR data/*.jsonl --workers 8   # token shards
    lightning-para calibrate 1                                       # this machine's CPU step-time figures
    lightning-para consolidate checkpoints/last.ckpt --output_file model.ckpt   # one file from a sharded folder

``fit``/``validate``/``test``/``predict`` are LightningCLI's subcommands with ParaStrategy, the
text data module and the profiler as defaults (:mod:`lightning_para.cli.fit`); ``plan`` is
the layout planner (:mod:`lightning_para.cli.plan`, ``docs/planner.md``); ``parity`` compares a
layout's numerics with one device (:mod:`lightning_para.cli.parity`, recording with
:mod:`lightning_para.parity`). Configuration errors exit with status 2 and a message, without a
traceback. ``python -m lightning_para.cli ...`` is the same command.

A new command is a module here with a ``main(argv) -> int``, added to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning_para.cli.fit import (
    ConfigurationError,
    ParaCLI,
    close_process_group,
    resolve_config_names,
    run_cli,
)
from lightning_para.cli.calibrate import main as calibrate_main
from lightning_para.cli.consolidate import main as consolidate_main
from lightning_para.cli.dryrun import main as dryrun_main
from lightning_para.cli.parity import main as parity_main
from lightning_para.cli.plan import main as plan_main
from lightning_para.cli.prepare import main as prepare_main

SUBCOMMANDS = {"plan": plan_main, "parity": parity_main, "dryrun": dryrun_main, "calibrate": calibrate_main,
               "prepare": prepare_main, "consolidate": consolidate_main}


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-para`` console script: 0 on success, 2 on a configuration error."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    try:
        run_cli(argv)
    except ConfigurationError as err:
        print(f"lightning-para: configuration error: {err}", file=sys.stderr)
        return 2
    close_process_group()
    return 0


__all__ = ["ConfigurationError", "ParaCLI", "main", "resolve_config_names", "run_cli"]
