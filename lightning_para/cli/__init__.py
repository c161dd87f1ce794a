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

import importlib
import sys
from typing import Optional

from lightning_para.spec.lazy import lazy_face

# Each command's module (with a `main(argv) -> int`), imported when the command runs: `lightning-para plan --help`
# loads the planner's command alone, no Lightning.
SUBCOMMANDS = {name: f"lightning_para.cli.{name}" for name in
               ("plan", "parity", "dryrun", "calibrate", "prepare", "consolidate")}

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".fit": ("ConfigurationError", "ParaCLI", "close_process_group", "resolve_config_names", "run_cli"),
})
__all__ += ["main"]


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-para`` console script: 0 on success, 2 on a configuration error."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    fit = importlib.import_module("lightning_para.cli.fit")
    try:
        fit.run_cli(argv)
    except fit.ConfigurationError as err:
        print(f"lightning-para: configuration error: {err}", file=sys.stderr)
        return 2
    fit.close_process_group()
    return 0
