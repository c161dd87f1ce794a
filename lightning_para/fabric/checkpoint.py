"""Fabric's ``state`` dict <-> the Trainer's checkpoint format, so either front end reads the other's.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 4})`` is written as the
Trainer writes its checkpoints: the module's state as ``state_dict``, the optimizers' (in the
order they appear in ``state``) as ``optimizer_states``, everything else (plain values, and
``state_dict()`` of other stateful objects) beside them in ``meta.pt``. The Fabric names of the
module and the optimizers are recorded under :data:`FABRIC_KEYS`, so a Fabric load puts every
entry back under its name; a Trainer checkpoint loads into Fabric the same way (its model and
optimizers by position, its other keys as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn
from torch.optim import Optimizer

FABRIC_KEYS = "lightning_para_fabric_keys"


@dataclass
class FabricState:
    """A Fabric ``state`` dict taken apart: the one module, the optimizers in order, the rest."""

    module_key: str
    module: nn.Module
    optimizer_keys: list[str] = field(default_factory=list)
    optimizers: list[Optimizer] = field(default_factory=list)
    other: dict[str, Any] = field(default_factory=dict)


def split_state(state: Mapping[str, Any], unwrap: Callable[[Any], Any], what: str) -> FabricState:
    """Find the module and the optimizers in ``state`` (raises ``ValueError`` unless there is exactly one module)."""
    modules = [(k, unwrap(v)) for k, v in state.items() if isinstance(unwrap(v), nn.Module)]
    if len(modules) != 1:
        names = ", ".join(repr(k) for k, _ in modules) or "none"
        raise ValueError(
            f"ParaStrategy.{what} needs exactly one model in `state` (found {names}): a checkpoint holds one"
            " parallelized model. Save other models with their own `fabric.save` call."
        )
    key, module = modules[0]
    result = FabricState(module_key=key, module=module)
    for name, value in state.items():
        value = unwrap(value)
        if name == key:
            continue
        if isinstance(value, Optimizer):
            result.optimizer_keys.append(name)
            result.optimizers.append(value)
        else:
            result.other[name] = value
    return result


def to_trainer_format(
    parts: FabricState, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
    filter: Optional[Mapping[str, Callable[[str, Any], bool]]] = None,
) -> dict[str, Any]:
    """The checkpoint dict :func:`lightning_para.checkpoint.save_checkpoint` writes (see the module docstring)."""
    checkpoint: dict[str, Any] = {}
    for name, value in parts.other.items():
        if hasattr(value, "state_dict") and callable(value.state_dict):
            value = value.state_dict()
        if filter is not None and name in filter and isinstance(value, dict):
            value = {k: v for k, v in value.items() if filter[name](k, v)}
        checkpoint[name] = value
    if filter is not None and parts.module_key in filter:
        model_state = {k: v for k, v in model_state.items() if filter[parts.module_key](k, v)}
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = optimizer_states
    checkpoint[FABRIC_KEYS] = {"module": parts.module_key, "optimizers": list(parts.optimizer_keys)}
    return checkpoint


def restore_other(state: dict[str, Any], parts: FabricState, loaded: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Put the non-tensor entries of a loaded checkpoint back into ``state`` (stateful objects through
    ``load_state_dict``); returns what ``state`` did not ask for (Fabric's ``load`` contract)."""
    rest = {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states", FABRIC_KEYS)}
    missing = [k for k in parts.other if k not in rest]
    if strict and missing:
        raise KeyError(
            f"The checkpoint has no {', '.join(repr(k) for k in missing)} that `state` asks for."
            " Pass `strict=False` to `fabric.load` to load what is there."
        )
    for name, target in parts.other.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        if hasattr(target, "load_state_dict") and callable(target.load_state_dict) and not isinstance(target, dict):
            target.load_state_dict(value)
        else:
            state[name] = value
    return rest


__all__ = ["FABRIC_KEYS", "FabricState", "restore_other", "split_state", "to_trainer_format"]
