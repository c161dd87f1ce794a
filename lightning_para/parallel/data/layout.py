"""Where each parameter lives in ZeRO-1/2 bucketed communication: its shard and its bucket.

The layout follows ``torch.chunk`` along dim 0 (rows), the layout FSDP2 uses, so a rank's shard
is a contiguous slice of the flattened parameter. A bucket holds ``world`` equal *segments*, one
per rank ("rank-major"): a reduce-scatter of the bucket leaves each rank exactly the gradient
rows of its own shards, and an all-gather rebuilds the full parameters.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # private: see docs/architecture.md

from lightning_para._dtensor import DTensorViews, local_tensor
from lightning_para.spec.zero import chunk_rows, row_range


@dataclass
class ParamSlot:
    """One model parameter's place in data parallelism: its group, its shard, its master."""

    name: str
    param: nn.Parameter
    mesh: DeviceMesh  # 1-D data-parallel mesh that replicates this parameter ("dp", or "edp" for experts)
    sharded: bool
    master: Optional[nn.Parameter] = None  # what the optimizer steps; None means the parameter itself
    bucket: int = -1
    offset: int = 0  # position inside the bucket's per-rank segment
    part: Optional[int] = None  # the pipeline stage of this rank that holds it (see `Bucket.part`)
    # The gradient ZeRO put into ``param.grad`` for users to read: kept after the optimizer step, as DDP
    # keeps ``.grad`` until ``zero_grad``; dropped when the next backward starts.
    exposed_grad: Optional[Tensor] = None
    views: dict = field(default_factory=dict, repr=False)  # DTensor descriptions, built once (`_dtensor_views`)

    def __post_init__(self) -> None:
        self.group = self.mesh.get_group()
        self.world = self.mesh.size()
        self.rank = self.mesh.get_local_rank()
        local = self.local
        self.rows = local.shape[0] if local.dim() > 0 else 1
        self.row_numel = local.numel() // self.rows if self.rows else 0
        self.chunk_rows = chunk_rows(self.rows, self.world) if self.sharded else self.rows
        self.start_row, self.end_row = row_range(self.rows, self.world, self.rank) if self.sharded else (0, self.rows)

    @property
    def local(self) -> Tensor:
        return local_tensor(self.param.data)

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def segment_numel(self) -> int:
        """Elements this parameter occupies in each rank's segment of a bucket (padded chunk)."""
        return self.chunk_rows * self.row_numel

    @property
    def shard_numel(self) -> int:
        return (self.end_row - self.start_row) * self.row_numel

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = tuple(self.local.shape) or (1,)
        return (self.end_row - self.start_row, *shape[1:])

    @property
    def master_shape(self) -> tuple[int, ...]:
        """The shape of what the optimizer steps: this rank's rows (sharded), else the local parameter's."""
        return self.shard_shape if self.sharded else tuple(self.local.shape)

    @property
    def separate_master(self) -> bool:
        """The optimizer steps a tensor of its own (an fp32 copy), not a view of the parameter's rows."""
        if self.master is None:
            return False
        return self.master.untyped_storage().data_ptr() != self.local.untyped_storage().data_ptr()

    @property
    def optimizer_param(self) -> nn.Parameter:
        return self.master if self.master is not None else self.param

    @torch.no_grad()
    def load_master(self, values: Tensor) -> None:
        """Set the master from ``values`` shaped like the local parameter (this rank's rows when sharded)."""
        assert self.master is not None
        source = self.local_rows(values) if self.sharded else values
        self.master.copy_(source.reshape(self.master.shape).to(self.master.dtype))

    def shard_as_dtensor(self, local: Tensor, mesh_of: Callable[..., DeviceMesh]) -> DTensor:
        """``local``, shaped like this rank's shard, as the global DTensor it is a piece of.

        ``Shard(0)`` over the data-parallel mesh (the ``torch.chunk`` row layout); for a
        tensor-parallel parameter, that placement comes before the parameter's own ones on the
        joint ``(dp, tp)`` mesh (``mesh_of(*names)`` slices it), and when tp also splits rows
        the dp rows are ``_StridedShard`` of them (the layout FSDP2 uses). A parameter with a
        strided (fused q|k|v) tp shard has no such description (see :attr:`describable`).
        """
        views = self._dtensor_views(("shard",), lambda: self._shard_description(mesh_of))
        local = local.view(self.shard_shape)
        if not local.requires_grad:
            return views(local)
        return DTensor.from_local(local, views.mesh, views.placements, run_check=False, shape=views.shape,
                                  stride=views.stride)

    def _shard_description(self, mesh_of: Callable[..., DeviceMesh]) -> DTensorViews:
        param = self.param
        global_shape = tuple(param.shape) or (1,)
        if isinstance(param, DTensor):
            base = param.device_mesh
            mesh = mesh_of(self.mesh.mesh_dim_names[0], *base.mesh_dim_names)
            rows_split = math.prod(base.size(i) for i, p in enumerate(param.placements) if p.is_shard(0))
            placements = (_StridedShard(0, split_factor=rows_split) if rows_split > 1 else Shard(0), *param.placements)
        else:
            mesh, placements = self.mesh, (Shard(0),)
        return DTensorViews(mesh, placements, global_shape, contiguous_stride(global_shape))

    def _dtensor_views(self, key: tuple, describe: Callable[[], DTensorViews]) -> DTensorViews:
        """One :class:`DTensorViews` per kind of DTensor this slot makes (the description never changes)."""
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = describe()
        return views

    @property
    def describable(self) -> bool:
        """Whether :meth:`shard_as_dtensor` can describe this parameter's shard (not a strided TP shard)."""
        return not any(isinstance(p, _StridedShard) for p in getattr(self.param, "placements", ()))

    def expose_grad(self, grad: Tensor, mesh_of: Optional[Callable[..., DeviceMesh]]) -> None:
        """Put the synchronised gradient into ``param.grad`` for users to read (ZeRO's ``.grad`` contract).

        ``grad`` is the whole local gradient (unsharded) or this rank's row shard (ZeRO-1/2),
        shared with what the optimizer reads wherever the dtypes agree. A shard becomes a DTensor
        (:meth:`shard_as_dtensor`); a scalar's single row lives on one rank, so the others hold zero
        of a ``Partial`` sum. A strided (fused q|k|v) tp shard has no DTensor description and gets
        no ``.grad`` (``docs/data_parallel.md``).
        """
        param = self.param
        if not self.sharded:
            view: Tensor = self._like_param(grad)
        elif param.dim() == 0:
            local = grad.reshape(()) if grad.numel() else grad.new_zeros(())
            view = self._dtensor_views(("partial",), lambda: DTensorViews(self.mesh, (Partial(),), (), ()))(local)
        elif self.describable and not isinstance(param, DTensor):
            view = self.shard_as_dtensor(grad, lambda *names: self.mesh)
        elif self.describable and mesh_of is not None:
            view = self.shard_as_dtensor(grad, mesh_of)
        else:
            return
        param.grad = view
        self.exposed_grad = view

    def _like_param(self, local: Tensor) -> Tensor:
        """``local`` (shaped like the local parameter) as what ``param.grad`` may hold: a DTensor like a DTensor
        parameter (sharing ``local``'s storage), else ``local`` itself."""
        param = self.param
        if not isinstance(param, DTensor):
            return local
        return self._dtensor_views(("param",), lambda: DTensorViews(
            param.device_mesh, param.placements, tuple(param.shape), param.stride()))(local)

    def take_reduced_grad(self, flat: Tensor) -> None:
        """Stage 0: ``flat``, this parameter's piece of its reduced bucket, becomes ``param.grad`` (a view, as DDP's
        ``gradient_as_bucket_view``: no copy back). A later backward adds into it, as into any ``.grad``. A parameter
        whose local tensor is not contiguous (``channels_last``) keeps its gradient's layout: a copy into it."""
        local = self.local
        if local.is_contiguous():
            self.param.grad = self._like_param(flat.view(local.shape))
            return
        if self.param.grad is None:
            self.param.grad = self._like_param(torch.empty_like(local))
        local_tensor(self.param.grad).copy_(flat.view(local.shape))

    def clear_exposed_grad(self, *, forget: bool = True) -> None:
        """Drop the gradient :meth:`expose_grad` showed, if ``param.grad`` still shows it.

        ``forget=False`` keeps the reference when ``param.grad`` is something else right now (a
        pipeline step sets ``.grad`` aside while its schedule runs and puts it back afterwards), so
        a later call still recognises the shown gradient and never lets autograd add into it.
        """
        shown = self.exposed_grad is not None and self.param.grad is self.exposed_grad
        if shown:
            self.param.grad = None
        if shown or forget:
            self.exposed_grad = None

    def accumulated_grad(self) -> Optional[Tensor]:
        """``param.grad`` if it holds a gradient backward accumulated, ``None`` if it is the shown one."""
        grad = self.param.grad
        return None if grad is not None and grad is self.exposed_grad else grad

    def local_rows(self, tensor: Tensor) -> Tensor:
        """The rows of a tensor shaped like the local parameter that this rank owns."""
        flat = tensor.reshape(-1)
        return flat[self.start_row * self.row_numel : self.end_row * self.row_numel].view(self.shard_shape)


@dataclass
class Bucket:
    """Parameters whose gradients travel in one collective, and that collective's state."""

    slots: list[ParamSlot]
    segment_numel: int
    ready: int = 0
    work: Optional[RowReduction] = None  # the gradient reduction in flight
    buffer: Optional[Tensor] = None
    launched: bool = False
    # The pipeline stage (this rank's part) whose backward fills this bucket; None: no one part (pp=1, or
    # a parameter in several). ``zero_accumulation="reduce_each_microbatch"`` reduces a part's buckets
    # after each of its microbatch backwards and sums the shards here, in the masters' dtype.
    part: Optional[int] = None
    pending: Optional[Tensor] = None
    # Separate masters (fp32 of bf16 weights): one flat tensor of this rank's segment, each slot's master a view.
    masters: Optional[Tensor] = None
    # The flat gradient the masters' `.grad` views (weakly: `zero_grad` frees it), to accumulate into.
    grads: Optional[weakref.ref] = None

    @property
    def mesh(self) -> DeviceMesh:
        return self.slots[0].mesh

    @property
    def dtype(self) -> torch.dtype:
        # Read at launch: the precision plugin may cast the model after the buckets were built.
        return self.slots[0].local.dtype

    @property
    def world(self) -> int:
        return self.slots[0].world


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


# DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): small, so the first
# collective starts while backward is still producing most gradients.
FIRST_BUCKET_BYTES = 1024 * 1024

# gloo only: what gloo lacks, or runs through temporary copies, takes a path with the same bytes and fewer copies: a
# bucket's reduce-scatter is one exchange of rows between every pair of ranks (`reduce_scatter_rows`), an all-gather
# one in-place broadcast per rank (`all_gather_rows`). Tests switch it off to run the path every other backend (NCCL)
# takes on gloo.
GLOO_SHORTCUTS = True


def _on_gloo(group: dist.ProcessGroup, device: torch.device) -> bool:
    backend = str(dist.get_backend(group))
    return GLOO_SHORTCUTS and (backend == "gloo" or (device.type == "cpu" and "cpu:gloo" in backend))


class RowReduction:
    """A reduction in flight (:func:`reduce_scatter_rows`): ``wait()`` waits for its works and returns the result."""

    def __init__(self, works: Sequence[dist.Work], result: Callable[[], Tensor]) -> None:
        self.works, self._result = list(works), result
        self._value: Optional[Tensor] = None

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> Tensor:
        if self._value is None:
            for work in self.works:
                work.wait()
            self._value = self._result()
        return self._value


def reduce_scatter_rows(rows: Tensor, rank: int, group: dist.ProcessGroup) -> RowReduction:
    """Start the reduce-scatter of ``rows`` (``world x n``, row ``r`` what this rank adds to rank ``r``'s row);
    ``wait()`` gives this rank's summed row, in a tensor of its own (the caller may drop ``rows`` then).

    Every backend but gloo: one reduce-scatter. gloo has none (torch's clones the input, all-reduces all of it and
    copies a chunk out: twice a reduce-scatter's bytes): each rank sends row ``r`` to rank ``r`` and receives its own
    row from every peer, ``(world - 1) / world`` of the input each way, as a ring reduce-scatter sends.
    """
    world = rows.shape[0]
    if world == 1:
        return RowReduction([], lambda: rows[0])
    if not _on_gloo(group, rows.device):
        out = rows.new_empty(rows.shape[1])
        return RowReduction([reduce_scatter_single(out, rows.view(-1), group=group, async_op=True)], lambda: out)
    peers = [r for r in range(world) if r != rank]
    received = rows.new_empty(world - 1, rows.shape[1])
    # Every receive is posted before any send, and nothing waits until all are: no pair can wait on each other.
    works = [dist.irecv(received[i], src=dist.get_global_rank(group, r), group=group) for i, r in enumerate(peers)]
    works += [dist.isend(rows[r], dst=dist.get_global_rank(group, r), group=group) for r in peers]

    def result() -> Tensor:
        total = received[0] if world == 2 else received.sum(0)  # a row of its own
        return total.add_(rows[rank])

    return RowReduction(works, result)


def all_gather_rows(out: Tensor, rank: int, group: dist.ProcessGroup) -> list[dist.Work]:
    """Start an in-place all-gather of the rows of ``out`` (``world x n``), where this rank has written its row
    ``out[rank]``; returns the works to wait on.

    Every backend but gloo: one all-gather whose input is this rank's row of the output (in place, as FSDP2
    gathers). gloo's all-gather copies the input into, and the output out of, temporary flat tensors; one in-place
    broadcast from each rank into its row sends the same bytes without those two passes.
    """
    if not _on_gloo(group, out.device):
        return [all_gather_single(out.view(-1), out[rank], group=group, async_op=True)]
    return [dist.broadcast(out[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
            for r in range(out.shape[0])]


# torch >= 2.12 names these `*_single`; older releases (>= 2.6) only have the `*_tensor` spelling.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pack_rank_major(rows: Sequence[Tensor], out: Tensor) -> None:
    """``out[r]`` = the ``r``-th ``torch.chunk`` (along dim 0) of each 2-D tensor of ``rows``, zero-padded to
    ``ceil(rows / world)`` rows, laid end to end (``world = out.shape[0]``): FSDP2's layout, in one fused kernel."""
    torch._chunk_cat(list(rows), 0, out.shape[0], out=out)


def unpack_rank_major(src: Tensor, rows: Sequence[Tensor]) -> None:
    """Inverse of :func:`pack_rank_major`: write each 2-D tensor of ``rows`` from ``src`` (``world x segment``) in
    one fused copy, plus one copy per tensor whose rows do not divide by ``world`` (through a padded scratch)."""
    world = src.shape[0]
    sizes = [-(-t.shape[0] // world) * t.shape[1] for t in rows]
    outs, uneven = [], []
    for t, size in zip(rows, sizes):
        if t.shape[0] % world == 0 and t.is_contiguous():
            outs.append(t.view(world, size))
        else:
            outs.append(src.new_empty(world, size))
            uneven.append((t, outs[-1]))
    torch.split_with_sizes_copy(src, sizes, dim=1, out=outs)
    for t, scratch in uneven:  # rank-major chunks of rows: the padding is all at the end
        t.copy_(scratch.view(-1)[: t.numel()].view(t.shape))


@torch.no_grad()
def attach_masters(bucket: Bucket, master_dtype: Optional[torch.dtype]) -> None:
    """Each slot's ``master``, what the optimizer steps (``None``: the model parameter itself). Sharded, without
    ``master_dtype``: a view of this rank's rows of the parameter. With ``master_dtype``: views into one flat
    ``master_dtype`` copy of the bucket's segment (:attr:`Bucket.masters`), so casts and copies of the masters are
    one kernel per bucket."""
    if master_dtype is None:
        for slot in bucket.slots:
            if slot.sharded:  # the optimizer updates the model parameter's own rows in place
                slot.master = nn.Parameter(slot.local_rows(slot.local.detach()), requires_grad=True)
        return
    flat = torch.zeros(bucket.segment_numel, dtype=master_dtype, device=bucket.slots[0].local.device)
    bucket.masters = flat
    for slot in bucket.slots:
        view = flat[slot.offset : slot.offset + slot.shard_numel].view(slot.master_shape)
        view.copy_((slot.local_rows(slot.local) if slot.sharded else slot.local).reshape(view.shape))
        slot.master = nn.Parameter(view, requires_grad=True)


def rows_of(tensor: Tensor, slot: ParamSlot) -> Tensor:
    """A view of ``tensor`` (shaped like ``slot``'s local parameter) as ``rows x row elements``: how it is sharded."""
    return tensor.view(slot.rows, slot.row_numel)


def build_buckets(slots: Sequence[ParamSlot], capacity_bytes: int) -> list[Bucket]:
    """``slots`` in buckets of ``capacity_bytes`` (the first one smaller), in reverse order; sets each slot's
    ``offset`` and ``bucket``. A bucket holds one group, dtype and pipeline stage."""
    # The first bucket (the last layers, whose gradients backward produces first) is small, as
    # DDP's is (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so its collective starts early in backward.
    first_capacity = min(capacity_bytes, FIRST_BUCKET_BYTES)
    buckets: list[Bucket] = []
    current: list[ParamSlot] = []

    def close() -> None:
        if current:
            seg = 0
            for s in current:
                s.offset, s.bucket = seg, len(buckets)
                seg += s.segment_numel
            buckets.append(Bucket(slots=list(current), segment_numel=seg, part=current[0].part))
            current.clear()

    size = 0
    for slot in reversed(slots):  # backward produces gradients roughly in reverse order
        nbytes = slot.numel * slot.local.element_size()
        if current and (
            slot.group is not current[0].group
            or slot.local.dtype != current[0].local.dtype
            or slot.part != current[0].part
            or size + nbytes > (capacity_bytes if buckets else first_capacity)
        ):
            close()
            size = 0
        current.append(slot)
        size += nbytes
    close()
    return buckets
