"""What a checkpoint records about the model besides its weights, filled in by integrations.

``ParaStrategy.save_checkpoint`` stores, under each registered key, what its function finds in the
LightningModule (left out when it finds nothing). ``lightning_para.integrations.transformers``
registers ``"transformers_models"`` (each transformers model's class and config), so its
``export`` can write a ``from_pretrained`` folder from the checkpoint alone. A registry because
the strategy and checkpoint/ never import an integration (``docs/architecture.md``, "Layers").
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from lightning_para.spec.plugins import load_plugins

_DESCRIBERS: dict[str, Callable[[nn.Module], Any]] = {}


def register_model_info(key: str, describe: Callable[[nn.Module], Any]) -> None:
    """Record ``describe(lightning_module)`` under ``checkpoint[key]`` in every checkpoint ParaStrategy saves."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"`key` must be a non-empty string, got {key!r}.")
    _DESCRIBERS[key] = describe


def model_info(module: nn.Module) -> dict[str, Any]:
    """``{key: describe(module)}`` for every registered key whose description is not empty."""
    load_plugins()
    found = {key: describe(module) for key, describe in _DESCRIBERS.items()}
    return {key: value for key, value in found.items() if value}


__all__ = ["model_info", "register_model_info"]
