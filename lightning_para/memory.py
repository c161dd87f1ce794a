"""The one way a rank's held bytes are counted: :func:`measure_states`, the bytes of the distinct storages its
parameters, gradients and optimizer hold, as a :class:`~lightning_para.spec.memory.MeasuredMemory` (the records are
the spec layer's). A leaf below the data-parallel code that measures and the dry run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_para._dtensor import local_tensor
from lightning_para.spec.memory import MeasuredMemory


def storage_pointer(t: Tensor) -> int:
    """A storage's identity on a real device: its data pointer (views of one storage share it)."""
    return t.untyped_storage().data_ptr()


class StorageCounter:
    """Bytes of each distinct storage, once: a ZeRO master that views its parameter's rows adds
    nothing, and FSDP2's sharded gradients (views into one reduce-scatter buffer) count that
    whole buffer, padding included -- what the rank really holds. A DTensor counts its local shard.

    ``key`` tells storages apart (default: the data pointer; the dry run's meta storages all have
    pointer 0 and pass their own)."""

    def __init__(self, key: Optional[Callable[[Tensor], int]] = None) -> None:
        self._seen: set[int] = set()
        self._key = key or storage_pointer

    def add(self, t: Optional[Tensor]) -> int:
        """``t``'s storage bytes if this counter has not seen that storage yet, else 0."""
        if t is None:
            return 0
        t = local_tensor(t, allow_partial=True)
        if t.numel() == 0:
            return 0
        key = self._key(t)
        if key in self._seen:
            return 0
        self._seen.add(key)
        return t.untyped_storage().nbytes()


def measure_states(
    module: nn.Module,
    optimizers: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]],
    *,
    only: Optional[Callable[[Tensor], bool]] = None,
    key: Optional[Callable[[Tensor], int]] = None,
) -> MeasuredMemory:
    """Bytes this rank holds for parameters, gradients and optimizer state (storage-deduplicated).

    An optimizer's parameter that is not the model's own storage is a separate fp32 master and counts as optimizer
    state; one that views the model's rows (a ZeRO-1/2 master under ``32-true``) adds nothing. ``only`` keeps the
    tensors (model parameters and the optimizer's) it accepts, e.g. MoE experts; ``key``: see
    :class:`StorageCounter`.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)

    def keep(t: Tensor) -> bool:
        return only is None or only(t)

    counter = StorageCounter(key)
    model_params = [p for p in module.parameters() if keep(p)]
    params = sum(counter.add(p.data) for p in model_params)
    grads = sum(counter.add(p.grad) for p in model_params)
    opt_params = [q for o in optimizers for g in o.param_groups for q in g["params"] if keep(q)]
    grads += sum(counter.add(q.grad) for q in opt_params)
    optimizer = sum(counter.add(q.data) for q in opt_params)  # separate masters only: views were counted
    for o in optimizers:
        for q, state in o.state.items():
            if keep(q):
                optimizer += sum(counter.add(v) for v in state.values() if isinstance(v, Tensor))
    return MeasuredMemory(params, grads, optimizer)


__all__ = ["StorageCounter", "measure_states", "storage_pointer"]
