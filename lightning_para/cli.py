"""``lightning-para``: LightningCLI with ParaStrategy, the text data module and the profiler.

::

    lightning-para fit --config recipes/gpt-cpu-demo.yaml
    lightning-para fit --config recipes/gpt-cpu-demo.yaml --trainer.strategy.tp 1 --trainer.strategy.pp 1 --trainer.devices 1
    lightning-para validate --config recipes/gpt-cpu-demo.yaml --ckpt_path lightning_logs/version_0/checkpoints/...

Defaults: ``trainer.strategy`` is :class:`~lightning_para.ParaStrategy` (so
``--trainer.strategy.tp 2`` works without naming the class), ``data`` is
:class:`~lightning_para.data.TextDataModule`, and a :class:`~lightning_para.profiling.ParaProfiler`
callback is configured under ``profiling`` (``--profiling.comm_every_n_steps 0`` etc.).

Configuration errors (degrees that do not fit the devices, a missing data path, a
vocabulary mismatch) are raised while the classes are instantiated, in the launching
process, before any worker starts; ``main()`` prints them without a traceback.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

from lightning_para.data import TextDataModule, check_vocab
from lightning_para.profiling import ParaProfiler


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
        parser.set_defaults({"data": {"class_path": "lightning_para.data.TextDataModule"}})

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
            model_config = getattr(self.model, "config", None)
            if self.datamodule is not None and hasattr(model_config, "vocab_size"):
                check_vocab(model_config.vocab_size, self.datamodule)
        except ValueError as err:
            raise ConfigurationError(str(err)) from err


def make_recipes_importable() -> None:
    """Let ``class_path: recipes.gpt.GPT`` resolve from a clone (the current folder or the repo
    root), and import the recipes so the short names ``--model GPT`` / ``MoEGPT`` work too."""
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / "recipes" / "gpt.py").is_file() and str(root) not in sys.path:
            sys.path.append(str(root))
    try:
        import recipes.gpt  # noqa: F401
        import recipes.moe  # noqa: F401
    except ImportError:  # an installed package without the repository's recipes/
        pass


# Noise from Lightning's own internals on torch 2.13, printed once per rank; nothing a user can act on.
_QUIET = (r".*isinstance\(treespec, LeafSpec\).*",)


def run_cli(args: Optional[list[str]] = None, **kwargs: Any) -> ParaCLI:
    """Build and run :class:`ParaCLI` (``args`` as on the command line); returns it for inspection."""
    for message in _QUIET:
        warnings.filterwarnings("ignore", message=message)
    make_recipes_importable()
    return ParaCLI(args=args, **kwargs)


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-para`` console script: 0 on success, 2 on a configuration error."""
    try:
        run_cli(args)
    except ConfigurationError as err:
        print(f"lightning-para: configuration error: {err}", file=sys.stderr)
        return 2
    _close_process_group()
    return 0


def _close_process_group() -> None:
    """Leave the process group explicitly before the interpreter exits.

    Left to interpreter shutdown, the c10d backend's threads were sometimes destroyed while
    still joinable ("terminate called without an active exception", exit status -6) after a
    successful run. The barrier makes sure no rank still needs this one's sockets.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


__all__ = ["ParaCLI", "ConfigurationError", "TextDataModule", "main", "run_cli"]

if __name__ == "__main__":
    sys.exit(main())
