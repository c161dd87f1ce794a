"""The true global gradient norm over every dimension that shards or replicates gradients.

Each rank holds some gradient tensors: whole (replicated over dp), ZeRO shards, TP shards,
one pipeline stage's, one expert group's. Summing ``|g|^p`` over the world would count a
replicated tensor once per replica. So every optimizer parameter has a *replication
factor* (:func:`count_grad_replication`, kept by the strategy in a :class:`GradReplication`):
how many ranks hold exactly the same gradient values. Each rank adds
``sum(|g|^p) / replication`` and one all-reduce over the world gives the norm of the full
model's gradient -- the number a single device would compute (torchtitan#596 is the bug
this avoids for pipeline stages).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_para._dtensor import is_sharded_placement, local_tensor
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data.zero import ZeroDataParallel


def _replicated_everywhere(param: Tensor) -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class GradReplication:
    """On how many ranks each optimizer parameter's gradient is identical (1: unique to this rank).

    Held by the strategy's record of the layout and read by clipping. Parameters it was never
    told about count as replicated on every rank, which keeps a norm conservative (smaller).
    Keyed weakly by identity: it keeps no parameter alive.
    """

    def __init__(self) -> None:
        self._factors: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def set(self, param: Tensor, factor: int) -> None:
        if factor < 1:
            raise ValueError(f"replication factor must be >= 1, got {factor}")
        self._factors[param] = int(factor)

    def __call__(self, param: Tensor) -> int:
        factor = self._factors.get(param)
        return _replicated_everywhere(param) if factor is None else factor


def count_grad_replication(
    tensor: Tensor, dims: ParallelDims, zero: Optional[ZeroDataParallel], is_expert: Callable[[Tensor], bool]
) -> int:
    """On how many ranks the gradient of optimizer tensor ``tensor`` is identical.

    All ranks of one pipeline stage (dp x cp x tp) hold some piece of each of its parameters; the
    replication is that count divided by the number of distinct pieces: the ZeRO shard
    (``zero``), the DTensor shards (TP, EP, FSDP2) and, for an expert that is not a DTensor
    on ``ep``, the ep split. Tied weights across pipeline stages are rejected, so no
    parameter lives on two stages.
    """
    slot = zero.slot_for_optimizer_param(tensor) if zero is not None else None
    base = slot.param if slot is not None else tensor
    distinct = slot.world if slot is not None and slot.sharded else 1
    on_ep = False
    if isinstance(base, DTensor):
        mesh = base.device_mesh
        # `_StridedShard` (fused TP projections) is a shard too, though its is_shard() says False.
        distinct *= math.prod(mesh.size(i) for i, p in enumerate(base.placements) if is_sharded_placement(p))
        on_ep = "ep" in (mesh.mesh_dim_names or ())
    if is_expert(base) and not on_ep:
        distinct *= dims.ep
    return max((dims.dp * dims.cp * dims.tp) // distinct, 1)


def grad_groups(params: Iterable[Tensor]) -> list[list[Tensor]]:
    """The local gradients of ``params`` by (device, dtype), the grouping fused ``torch._foreach_*`` kernels need."""
    return _by_device_and_dtype(local_tensor(p.grad) for p in params if p.grad is not None)


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def foreach_norms(tensors: Iterable[Tensor], norm_type: float = 2.0) -> list[Tensor]:
    """The ``norm_type``-norm of each tensor, in fp32: one ``torch._foreach_norm`` per (device, dtype) (a NaN or inf
    anywhere makes its tensor's norm non-finite)."""
    return [n for group in _by_device_and_dtype(tensors) for n in torch._foreach_norm(group, norm_type, dtype=torch.float32)]


def _local_grads(params: Iterable[Tensor], replication: Callable[[Tensor], int]) -> dict[int, list[Tensor]]:
    """This rank's non-empty gradients, grouped by their replication factor; gradients that are views tiling one
    tensor exactly come as that tensor (:func:`coalesce_views`)."""
    by_factor: dict[int, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local_tensor(p.grad)
            if g.numel():
                by_factor.setdefault(replication(p), []).append(g)
    return {factor: [g.detach() for g in coalesce_views(grads)] for factor, grads in by_factor.items()}


def coalesce_views(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors``, where the views of one contiguous tensor that tile all of it without overlap are replaced by that
    tensor: the same elements, so the same sum of ``|g|^p``, in one kernel instead of one per view (ZeRO-0's gradients
    are views of their reduced bucket; on CPU each tensor of a ``torch._foreach_*`` op is a kernel of its own)."""
    views: dict[int, list[Tensor]] = {}
    out = []
    for t in tensors:
        base = t._base  # private: see docs/architecture.md
        if base is not None and base.is_contiguous() and t.is_contiguous() and base.dtype == t.dtype:
            views.setdefault(id(base), []).append(t)
        else:
            out.append(t)
    for group in views.values():
        base, end = group[0]._base, group[0]._base.storage_offset()
        for view in sorted(group, key=lambda v: v.storage_offset()):
            end = end + view.numel() if view.storage_offset() == end else -1
        out.extend([base] if end == base.storage_offset() + base.numel() else group)
    return out


@torch.no_grad()
def global_grad_norm(
    params: Iterable[Tensor],
    norm_type: float = 2.0,
    group: Optional[dist.ProcessGroup] = None,
    replication: Callable[[Tensor], int] = _replicated_everywhere,
) -> Tensor:
    """The norm of all gradients of ``params`` as if the whole model were on one device.

    ``replication(p)`` says on how many ranks ``p.grad`` is identical (a :class:`GradReplication`).
    Batched: one fused norm per (device, dtype) and replication factor, one all-reduce over ``group``
    (default: the world) of a single float.
    """
    norm_type = float(norm_type)
    by_factor = _local_grads(params, replication)
    device = next(iter(by_factor.values()))[0].device if by_factor else torch.device("cpu")
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if not by_factor:
        local = torch.zeros((), device=device, dtype=torch.float32)
    elif math.isinf(norm_type):
        local = torch.stack(foreach_norms([g for grads in by_factor.values() for g in grads], norm_type)).amax()
    elif not distributed and list(by_factor) == [1]:  # one device: torch's `get_total_norm` (views of one tensor: as one)
        return torch.linalg.vector_norm(torch.stack(foreach_norms(by_factor[1], norm_type)), norm_type)
    else:
        parts = []
        for factor, grads in by_factor.items():  # sum(|g|^p) / replication, one sum per factor
            part = torch.stack(foreach_norms(grads, norm_type)).pow(norm_type).sum()
            parts.append(part / factor if factor > 1 else part)
        local = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    if distributed:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)


@torch.no_grad()
def local_grad_square_sum(params: Iterable[Tensor], replication: Callable[[Tensor], int], device: torch.device) -> Tensor:
    """This rank's share of the squared global norm, ``sum(|g|^2 / replication)`` (fp32, on ``device``): summed over
    the world it is the squared norm :func:`global_grad_norm` computes. One fused norm per (device, dtype) and one dot
    product of the norms per replication factor."""
    parts = []
    for factor, grads in _local_grads(params, replication).items():
        norms = torch.stack(foreach_norms(grads)).to(device)
        part = torch.dot(norms, norms)
        parts.append(part / factor if factor > 1 else part)
    if not parts:
        return torch.zeros((), device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


@torch.no_grad()
def clip_grads_by_global_norm(
    params: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: Optional[dist.ProcessGroup] = None,
    replication: Callable[[Tensor], int] = _replicated_everywhere,
) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    Uses the same coefficient as ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``,
    capped at 1) so a sharded run matches a single-device run step for step; one fused multiply per
    (device, dtype).
    """
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, norm_type, group, replication)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in grad_groups(params):
        torch._foreach_mul_(grads, coef.to(device=grads[0].device, dtype=grads[0].dtype))
    return total


@torch.no_grad()
def clip_grads_by_value(params: Iterable[Tensor], clip_value: float) -> None:
    """Elementwise clipping: correct on shards as they are, no communication."""
    for grads in grad_groups(params):
        torch._foreach_clamp_max_(grads, clip_value)
        torch._foreach_clamp_min_(grads, -clip_value)
