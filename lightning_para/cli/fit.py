"""``lightning-para fit|validate|test|predict``: LightningCLI with ParaStrategy, the text data module and the profiler.

::

    lightning-para fit --config recipes/gpt-cpu-demo.yaml
    lightning-para fit --config gpt-cpu-demo                # a shipped config, by its short name
    lightning-para fit --config recipes/gpt-cpu-demo.yaml --trainer.strategy.tp 1 --trainer.strategy.pp 1 --trainer.devices 1
    lightning-para validate --config recipes/gpt-cpu-demo.yaml --ckpt_path lightning_logs/version_0/checkpoints/...

Defaults: ``trainer.strategy`` is :class:`~lightning_para.ParaStrategy` (so
``--trainer.strategy.tp 2`` works without naming the class), ``data`` is
:class:`~lightning_para.recipes.TextDataModule`, and a :class:`~lightning_para.observe.ParaProfiler`
callback is configured under ``profiling`` (``--profiling.comm_every_n_steps 0`` etc.). The recipes
(``lightning_para.recipes.GPT``, ``MoEGPT``) are imported, so ``--model GPT`` works too.

Configuration errors (degrees that do not fit the devices, a missing data path, a
vocabulary mismatch) are raised while the classes are instantiated, in the launching
process, before any worker starts; ``lightning_para.cli.main()`` prints them without a traceback.

This module is the LightningCLI part of the ``lightning-para`` command; :mod:`lightning_para.cli`
dispatches to it and to the ``plan`` and ``parity`` subcommands (:mod:`.plan`, :mod:`.parity`),
which run configs through :func:`run_cli` too (so it lives apart from the dispatcher, which imports them).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI

from lightning_para.observe.profiler import ParaProfiler
from lightning_para.recipes import check_vocab, config_path


class ConfigurationError(ValueError):
    """A ValueError raised while building the trainer, model or data from the configuration."""


class ParaCLI(LightningCLI):
    """LightningCLI whose defaults are ParaStrategy, TextDataModule and the ParaProfiler callback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_defaults", {"strategy": {"class_path": "lightning_para.ParaStrategy"}})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(ParaProfiler, "profiling")
        parser.set_defaults({"data": {"class_path": "lightning_para.recipes.TextDataModule"}})

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
            model_config = getattr(self.model, "config", None)
            if self.datamodule is not None and hasattr(model_config, "vocab_size"):
                check_vocab(model_config.vocab_size, self.datamodule)
        except ValueError as err:
            raise ConfigurationError(str(err)) from err


def resolve_config_names(args: list[str]) -> list[str]:
    """``--config NAME`` (or ``-c``, ``--config=NAME``) that is no file becomes the shipped config
    ``NAME`` (:func:`lightning_para.recipes.config_path`), so configs work from any directory."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + _config_file(arg[len("--config="):])
        elif arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _config_file(out[i + 1])
    return out


def _config_file(value: str) -> str:
    if Path(value).exists() or "/" in value or "\\" in value or value.lstrip().startswith(("{", "[")) or ":" in value:
        return value  # a path (or an inline YAML/JSON config): LightningCLI reads it as it is
    try:
        return str(config_path(value))
    except ValueError as err:
        raise ConfigurationError(f"`--config {value}` is neither a file nor a shipped config. {err}") from None


# Noise from Lightning's own internals on torch 2.13, printed once per rank; nothing a user can act on.
_QUIET = (
    r".*isinstance\(treespec, LeafSpec\).*",
    # `plan --validate` and `parity` call run_cli(args) from a command that has arguments of its own.
    r".*LightningCLI's args parameter is intended to run from within Python.*",
)


def run_cli(args: Optional[list[str]] = None, **kwargs: Any) -> ParaCLI:
    """Build and run :class:`ParaCLI` (``args`` as on the command line); returns it for inspection."""
    for message in _QUIET:
        warnings.filterwarnings("ignore", message=message)
    args = resolve_config_names(sys.argv[1:] if args is None else list(args))
    return ParaCLI(args=args, **kwargs)


def close_process_group() -> None:
    """Leave the process group explicitly before the interpreter exits.

    Left to interpreter shutdown, the c10d backend's threads were sometimes destroyed while
    still joinable ("terminate called without an active exception", exit status -6) after a
    successful run. The barrier makes sure no rank still needs this one's sockets.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


__all__ = ["ConfigurationError", "ParaCLI", "close_process_group", "resolve_config_names", "run_cli"]
