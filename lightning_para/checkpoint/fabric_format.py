"""Fabric's ``state`` dict <-> the checkpoint formats, so either front end reads the other's.

Sharded (the default): ``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 4})``
is written as the Trainer writes its checkpoints (one DCP folder): the module's state as
``state_dict``, the optimizers' (in the order they appear in ``state``) as ``optimizer_states``,
everything else (plain values, and ``state_dict()`` of other stateful objects) beside them in
``meta.pt``. The Fabric names of the module and the optimizers are recorded under
:data:`FABRIC_KEYS`. A Trainer checkpoint loads into Fabric the same way (its model and
optimizers by position, its other keys as they are), and the Trainer loads this one.

One full file (``save_distributed_checkpoint=False``): Fabric's own format, as Lightning's
Fabric strategies write it (``{"model": full state, "optimizer": PyTorch's format, "step": 4}``),
so a single-device Fabric loads it with ``fabric.load``; :func:`from_full_file` reads it back,
a Trainer file and a plain ``state_dict`` file (``fabric.load_raw``) too.
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
    if filter is not None:  # Lightning's `filter`: per entry of `state`, on the top-level keys of its state dict
        optimizer_states = [
            {k: v for k, v in state.items() if filter[name](k, v)} if name in filter else state
            for name, state in zip(parts.optimizer_keys, optimizer_states)
        ]
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = optimizer_states
    checkpoint[FABRIC_KEYS] = {"module": parts.module_key, "optimizers": list(parts.optimizer_keys)}
    return checkpoint


def for_the_trainer(loaded: dict[str, Any]) -> dict[str, Any]:
    """A Fabric checkpoint's non-tensor part as the Trainer's checkpoint connector reads it: Lightning's version
    (its migrations key on it), no scheduler and no loop state, so ``trainer.fit(ckpt_path=...)`` takes the
    model and the optimizers and starts its loops and schedulers afresh. A Trainer checkpoint passes unchanged."""
    if FABRIC_KEYS not in loaded:
        return loaded
    from lightning.pytorch import __version__ as lightning_version

    return {"pytorch-lightning_version": lightning_version, "lr_schedulers": [], **loaded}


def to_fabric_file(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A :func:`to_trainer_format` dict holding full states (rank 0) in Fabric's single-file layout."""
    names = checkpoint.pop(FABRIC_KEYS)
    out = {names["module"]: checkpoint.pop("state_dict")}
    for name, state in zip(names["optimizers"], checkpoint.pop("optimizer_states")):
        out[name] = state
    out.update(checkpoint)
    return out


def from_full_file(parts: FabricState, raw_model_state: bool = False) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ``convert`` that reads a single file into Lightning's layout: Fabric's (entries by name), the
    Trainer's (``state_dict``), or (``raw_model_state``) a plain ``model.state_dict()`` file."""

    def convert(loaded: dict[str, Any]) -> dict[str, Any]:
        if isinstance(loaded.get("state_dict"), Mapping):  # the Trainer's layout (a model has no such key)
            return loaded
        if raw_model_state and parts.module_key not in loaded:
            return {"state_dict": loaded}
        if parts.module_key not in loaded:
            raise KeyError(
                f"The checkpoint has no {parts.module_key!r} entry for the model (it has"
                f" {', '.join(repr(k) for k in list(loaded)[:10])}). Load it under the name it was saved with."
            )
        out = {k: v for k, v in loaded.items() if k != parts.module_key and k not in parts.optimizer_keys}
        out["state_dict"] = loaded[parts.module_key]
        out["optimizer_states"] = [loaded[k] for k in parts.optimizer_keys if k in loaded]
        return out

    return convert


def restore_other(state: dict[str, Any], parts: FabricState, loaded: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Put the non-tensor entries of a loaded checkpoint back into ``state`` (stateful objects through
    ``load_state_dict``); returns what ``state`` did not ask for (Fabric's ``load`` contract)."""
    rest = {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states", FABRIC_KEYS)}
    missing = [k for k in parts.other if k not in rest]
    if strict and missing:  # Lightning's wording (`lightning.fabric.utilities.load`)
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint."
            " To disable strict loading, set `strict=False`."
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


def check_save_arguments(storage_options: Any, filter: Any, *, sharded: bool) -> None:
    """``fabric.save``'s arguments this strategy cannot honour, named."""
    if storage_options is not None:
        raise TypeError("ParaStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP.")
    if filter is not None and sharded:
        raise NotImplementedError(
            "ParaStrategy cannot load filtered sharded checkpoints, so saving them is disabled: pass"
            " `save_distributed_checkpoint=False` to save a filtered full file."
        )


def check_load_state(state: Any) -> None:
    """``fabric.load``'s ``state``: a dict holding the model, or one model (``load_raw``), never empty or an optimizer."""
    if not state:
        raise ValueError(
            f"ParaStrategy.load_checkpoint(..., state={state!r}) needs a state with the model to load into:"
            " `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "ParaStrategy cannot load an optimizer alone: load it with its model,"
            " `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )


__all__ = ["FABRIC_KEYS", "FabricState", "check_load_state", "check_save_arguments", "for_the_trainer", "from_full_file", "restore_other", "split_state", "to_fabric_file", "to_trainer_format"]
