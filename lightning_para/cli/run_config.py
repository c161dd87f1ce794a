"""Reading a LightningCLI YAML (``recipes/*.yaml``) for the commands that price or dry-run it.

``lightning-para plan --config`` and ``lightning-para dryrun --config`` share these readers: the
config's LightningModule on the meta device (:func:`model_from_config`) and its planner
description (:func:`describe_config_model`), a trainer or data value (:func:`trainer_value`,
:func:`data_value`), the run's precision (:func:`config_precision`) and the strategy's layout
arguments (:func:`strategy_layout_arguments`). Errors are :class:`RunConfigError` (a
``ValueError``), and name the config key and what to change.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from torch import nn

from lightning_para.cli.fit import resolve_config_names
from lightning_para.config import ParallelConfig
from lightning_para.describe import describe_module
from lightning_para.plan.model import ModelDesc
from lightning_para.strategy import ParaStrategy


class RunConfigError(ValueError):
    """A config the command cannot use (the commands exit with status 2 and this message)."""


def load_config(path: str) -> dict[str, Any]:
    """A LightningCLI YAML (or a shipped config's short name) as a dict."""
    resolved = resolve_config_names(["--config", path])[1]
    try:
        data = yaml.safe_load(Path(resolved).read_text())
    except OSError as err:
        raise RunConfigError(f"`--config {path}`: cannot read it ({err}).") from None
    except yaml.YAMLError as err:
        raise RunConfigError(f"`--config {path}` is not valid YAML ({err}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise RunConfigError(f"`--config {path}` has no `model:` section with a class_path.")
    return data


def model_from_config(config: dict[str, Any]) -> nn.Module:
    """The config's LightningModule, instantiated on the meta device (no memory, no initialization cost)."""
    spec = config["model"]
    class_path, init_args = spec.get("class_path"), dict(spec.get("init_args") or {})
    if not isinstance(class_path, str):
        raise RunConfigError("The config's `model:` needs a `class_path` (e.g. lightning_para.recipes.GPT).")
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name or "lightning_para.recipes"), name)
    except (ImportError, AttributeError) as err:
        raise RunConfigError(f"`model.class_path: {class_path}` cannot be imported ({err}).") from None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(**init_args)
    except (TypeError, ValueError) as err:
        raise RunConfigError(f"`model: {class_path}` could not be built from its init_args: {err}") from None


def describe_config_model(module: nn.Module) -> ModelDesc:
    """The planner's :class:`ModelDesc` of a config's (meta) LightningModule."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return describe_module(module, name=type(module).__name__)


def trainer_value(config: dict[str, Any], key: str) -> Any:
    """``trainer.<key>`` of the config, or ``None``."""
    return (config.get("trainer") or {}).get(key)


def data_value(config: dict[str, Any], key: str) -> Any:
    """``data.init_args.<key>`` (or ``data.<key>``) of the config, or ``None``."""
    data = config.get("data") or {}
    return (data.get("init_args") or {}).get(key, data.get(key))


def config_precision(config: dict[str, Any]) -> Optional[str]:
    """The run's precision: the strategy's ``precision`` argument, else ``trainer.precision``."""
    strategy = trainer_value(config, "strategy")
    if isinstance(strategy, dict) and (strategy.get("init_args") or {}).get("precision"):
        return str(strategy["init_args"]["precision"])
    value = trainer_value(config, "precision")
    return str(value) if value is not None else None


_LAYOUT_ARGUMENTS = frozenset(f.name for f in fields(ParallelConfig) if f.init)


def strategy_layout_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """The ``ParaStrategy`` layout arguments of ``trainer.strategy.init_args`` (degrees, ZeRO stage,
    schedule, microbatches, sequence parallelism, ...: :class:`ParallelConfig`'s fields).

    Its other arguments (precision, checkpointing, watchdog, ...) are left out; a key ParaStrategy
    does not take, or a strategy that is not ParaStrategy, raises :class:`RunConfigError` naming it.
    No strategy (LightningCLI's default here is ParaStrategy) gives ``{}``.
    """
    strategy = trainer_value(config, "strategy")
    if strategy is None:
        return {}
    if not isinstance(strategy, dict):
        raise RunConfigError(
            f"`trainer.strategy: {strategy}`: give ParaStrategy (`class_path: lightning_para.ParaStrategy` with"
            " `init_args`), whose layout arguments this command reads."
        )
    class_path = str(strategy.get("class_path", "lightning_para.ParaStrategy"))
    if class_path.rpartition(".")[2] != ParaStrategy.__name__:
        raise RunConfigError(f"`trainer.strategy.class_path: {class_path}`: this command reads ParaStrategy's layout;"
                             " use class_path lightning_para.ParaStrategy.")
    init_args = strategy.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise RunConfigError("`trainer.strategy.init_args` must be a mapping of ParaStrategy arguments.")
    accepted = set(inspect.signature(ParaStrategy.__init__).parameters) - {"self"}
    for key in init_args:
        if key not in accepted:
            raise RunConfigError(
                f"`trainer.strategy.init_args.{key}` is not a ParaStrategy argument; its layout arguments are "
                + ", ".join(sorted(_LAYOUT_ARGUMENTS & accepted)) + "."
            )
    return {key: value for key, value in init_args.items() if key in _LAYOUT_ARGUMENTS}


__all__ = [
    "RunConfigError", "config_precision", "data_value", "describe_config_model", "load_config", "model_from_config",
    "strategy_layout_arguments", "trainer_value",
]
