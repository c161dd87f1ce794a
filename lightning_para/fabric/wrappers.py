"""What is behind Fabric's wrappers, and optimizers made before ``fabric.setup`` pointed at the parallel model."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer


def unwrap(obj: Any) -> Any:
    """The module or optimizer behind Fabric's wrappers (``_FabricModule``, ``_FabricOptimizer``, compile)."""
    for attr in ("_forward_module", "_orig_mod", "optimizer"):
        inner = getattr(obj, attr, None)
        if isinstance(inner, (nn.Module, Optimizer)) and (attr != "optimizer" or not isinstance(obj, Optimizer)):
            return unwrap(inner)
    return obj


def repoint(optimizer: Optimizer, names: dict[int, str], current: dict[str, nn.Parameter], pipeline: bool) -> None:
    """Point ``optimizer``'s groups at the parallel parameters of the same names (before any step)."""
    if optimizer.state:
        raise ValueError(
            "An optimizer passed to `fabric.setup(model, optimizer)` has already stepped. Create it after"
            " `model = fabric.setup(model)` and call `fabric.setup_optimizers(optimizer)`."
        )
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None and any(p is q for q in current.values()):
                params.append(p)
            elif name is not None and name in current:
                params.append(current[name])
            elif name is not None and pipeline:
                continue  # another pipeline rank's stage holds it
            else:
                raise ValueError(
                    "An optimizer passed to `fabric.setup(model, optimizer)` holds a parameter that is not the model's."
                    " Create the optimizer from `model.parameters()`, after `model = fabric.setup(model)`."
                )
        group["params"] = params


__all__ = ["repoint", "unwrap"]
