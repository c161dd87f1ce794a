"""The true global gradient norm over every dimension that shards or replicates gradients.

Each rank holds some gradient tensors: whole (replicated over dp), ZeRO shards, TP shards,
one pipeline stage's, one expert group's. Summing ``|g|^p`` over the world would count a
replicated tensor once per replica. So every optimizer parameter carries a *replication
factor*: how many ranks hold exactly the same gradient values. Each rank adds
``sum(|g|^p) / replication`` and one all-reduce over the world gives the norm of the full
model's gradient -- the number a single device would compute (torchtitan#596 is the bug
this avoids for pipeline stages).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_ATTR = "_para_grad_replication"


def set_grad_replication(param: Tensor, factor: int) -> None:
    """Record on how many ranks ``param.grad`` is identical (1 = this rank's values are unique)."""
    if factor < 1:
        raise ValueError(f"replication factor must be >= 1, got {factor}")
    setattr(param, _ATTR, int(factor))


def count_grad_replication(tensor: Tensor, dims: Any, zero: Any = None, pipeline: Any = None) -> int:
    """On how many ranks the gradient of optimizer tensor ``tensor`` is identical.

    All ranks of one pipeline stage (dp x tp) hold some piece of each of its parameters; the
    replication is that count divided by the number of distinct pieces: the ZeRO shard
    (``zero``: a ``ZeroDataParallel``), the DTensor shards (TP, EP, FSDP2) and, for an expert
    that is not a DTensor on ``ep``, the ep split. ``pipeline`` counts parameters held by more
    than one stage (``grad_copies``). ``dims`` is the strategy's ``ParallelDims``.
    """
    from torch.distributed.tensor import DTensor

    from lightning_para.parallel.tp_styles import is_sharded_placement

    slot = zero.slot_for_optimizer_param(tensor) if zero is not None else None
    base = slot.param if slot is not None else tensor
    distinct = slot.world if slot is not None and slot.sharded else 1
    on_ep = False
    if isinstance(base, DTensor):
        mesh = base.device_mesh
        # `_StridedShard` (fused TP projections) is a shard too, though its is_shard() says False.
        distinct *= math.prod(mesh.size(i) for i, p in enumerate(base.placements) if is_sharded_placement(p))
        on_ep = "ep" in (mesh.mesh_dim_names or ())
    if getattr(base, "_para_expert", False) and not on_ep:
        distinct *= dims.ep
    copies = pipeline.grad_copies(base) if pipeline is not None and hasattr(pipeline, "grad_copies") else 1
    return max((dims.dp * dims.tp * copies) // distinct, 1)


def grad_replication(param: Tensor) -> int:
    """The recorded replication factor of ``param``; unknown parameters count as replicated on every rank."""
    factor = getattr(param, _ATTR, None)
    if factor is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return factor


def local_tensor(t: Tensor) -> Tensor:
    """This rank's values of a plain tensor or DTensor (a reduced gradient: no pending Partial)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise RuntimeError(
                "A gradient is still a Partial DTensor when it is read; it must be reduced over its mesh first."
                f" Placements: {t.placements}."
            )
        return t._local_tensor
    return t


@torch.no_grad()
def global_grad_norm(params: Iterable[Tensor], norm_type: float = 2.0, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The norm of all gradients of ``params`` as if the whole model were on one device.

    One all-reduce over ``group`` (default: the world) of a single float.
    """
    norm_type = float(norm_type)
    grads = [(local_tensor(p.grad), grad_replication(p)) for p in params if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.zeros((), device=device, dtype=torch.float32)
        for g, _ in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), device=device, dtype=torch.float32)
    for g, replication in grads:
        if g.numel():
            local += torch.linalg.vector_norm(g.detach().float(), norm_type).pow(norm_type) / replication
    if dist.is_initialized():
        dist.all_reduce(local, group=group)
    return local.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grads_by_global_norm(
    params: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, group: Optional[dist.ProcessGroup] = None
) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    Uses the same coefficient as ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``,
    capped at 1) so a sharded run matches a single-device run step for step.
    """
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = local_tensor(p.grad)
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


@torch.no_grad()
def clip_grads_by_value(params: Iterable[Tensor], clip_value: float) -> None:
    """Elementwise clipping: correct on shards as they are, no communication."""
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).clamp_(min=-clip_value, max=clip_value)
