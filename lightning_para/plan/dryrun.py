"""A dry run of the real code at any scale: one rank of an N-rank job, on the meta device.

:func:`dry_run_rank` runs in a process of its own (the fake process group is process-wide):

1. ``torch.distributed`` is started with torch's **fake** backend at world size ``N`` and this
   rank; collectives return at once, so no other rank needs to exist.
2. The real :class:`~lightning_para.mesh.ParallelDims` mesh is built (device type ``meta``),
   and the model (built by the caller on the meta device) goes through the same
   :func:`~lightning_para.parallelize.parallelize` ``ParaStrategy`` calls: the real stage split,
   tensor/sequence/expert plans, activation checkpointing and ZeRO sharding, in the run's precision
   (``training.precision``: ``bf16-true`` -- bf16 weights, fp32 masters -- ``16-true`` or ``32-true``; the
   planner is asked for the same one). Meta tensors have shapes and no memory, so a 405B model costs
   nothing: the pipeline split keeps only this rank's stage before anything else.
3. One training step: ``in_flight`` microbatches forward through this rank's stage (1F1B keeps
   ``min(pp - r, M)`` in flight on pipeline rank ``r``, GPipe all ``M``), their backward, or the
   interleaved schedule's whole order over the rank's chunks (``plan.pipeline.compute_order``), then
   the ZeRO gradient sync and ``optimizer.step()`` (AdamW). Torch's pipeline schedule is not
   used: its start-up handshake reads tensor values (``.item()``), which meta tensors do not
   have; the stage modules, hooks and loss are the real ones.
4. Measured: parameters, gradients and optimizer state this rank holds after the step (bytes of
   distinct storages), the activations held when all in-flight microbatches have run forward
   (what the schedule's peak keeps), the peak of all live bytes during the step (a steady-state
   step's: the optimizer moments this first step creates count as held through forward and
   backward, without a pipeline the last step's gradients count as held through the forward (Lightning's
   ``zero_grad`` comes after it), with one through the whole schedule (the pipeline runner sets them aside
   until ``zero_grad``), and with more microbatches than in flight the in-flight microbatches run
   once untracked first, so the measured ones find the accumulated gradients), and every collective
   with its bytes per mesh dimension.
5. Modelled: the CUDA caching allocator's reserved peak (``MemoryFigures.reserved``, and
   ``reserved_expandable`` with ``expandable_segments``): the step's storages are recorded in the order they
   are allocated and freed, with the stream current at each, and replayed as steady-state steps through
   :mod:`lightning_para.plan.allocator`.

The planner's prediction for the same pipeline rank sits beside each figure
(:func:`~lightning_para.plan.cost.estimate`: ``resident`` states, ``memory.activations``).

MoE models (issue 23): a router picks experts by their values, and expert parallelism's all-to-all
split sizes are those picks counted, which meta tensors do not have. During the step every MoE layer
routes with :func:`~lightning_para.moe.balanced_routing`: token ``t``'s ``j``-th choice is expert
``(t * top_k + j) mod E``, so each expert gets ``T k / E`` rows (to one), the perfectly balanced
load the planner assumes; the rows per expert are host integers and the real dispatch, grouped
experts and combine run with their real all-to-alls (counts, tokens, outputs, and their backward)
on the fake process group. A real run's imbalance (and capacity drops) are not modelled. A
``transformers`` MoE model's experts made expert-parallel (``integrations.transformers.experts``)
take the same switch.

``transformers`` models (an ordinary LightningModule around one, e.g.
:class:`~lightning_para.recipes.HFCausalLM`): without a pipeline the step calls the module on the
token ids and takes transformers' causal-LM loss of the logits (:func:`causal_lm_step_loss`); under
a pipeline the module's own ``configure_pipeline()`` (``pipeline_spec``) gives the stages and loss.
transformers branches on data in its mask code ("one sequence per row?", "no padding?"); on meta
tensors those checks, and only transformers' own, answer yes (:func:`_transformers_answer`): the
dry run's batches are plain token windows.

ZeRO-3 runs on FSDP2 itself (:func:`_fsdp_on_meta`): the meta device gets the device module FSDP2 asks
for (CPU's no-op streams and events), FSDP2's refusal of meta parameters is lifted for the step, and the
gathered weights, which FSDP2 allocates and frees by resizing their storages in place, are counted while
held. One microbatch (ParaStrategy runs ZeRO-3 without a pipeline), its backward reduce-scattering each
unit's gradients as a step without accumulation does; the measured activations leave out the units kept
gathered from forward to backward (weights, which the planner prices with the gathered buffers).

Why this module is long: a meta-device run has to stand in for the GPU kernels' memory, so beside the
driver it carries the two fused kernels' saved-tensor profiles (flash attention, RMSNorm) and the
live-bytes and collective counters (issue 23: each of them is what made the measured activations right).
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # private: FSDP2 on meta, see `_fsdp_on_meta`
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import loss as _tp_loss  # private: see docs/architecture.md
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.moe import balanced_routing
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step, step_mixed_groups_per_tensor
from lightning_para.parallel.tensor.loss import causal_lm_loss
from lightning_para.parallel.data.memory import StorageCounter
from lightning_para.parallelize import ParallelModel, parallelize
from lightning_para.precision import ParaPrecision
from lightning_para.plan.allocator import AllocationTrace, steady_state_peaks
from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import estimate
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import compute_order
from lightning_para.plan.run import layout_from_config

GiB = 1024**3


@dataclass(frozen=True)
class MemoryFigures:
    """Bytes of one rank: states held between steps, activations held at the schedule's peak, the peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    peak: float
    # The caching allocator's reserved peak of a steady-state step, its trace replayed through
    # `plan.allocator` (dry run only: None in the planner's figures, and when the step did not run), with the
    # default settings and with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    reserved: Optional[float] = None
    reserved_expandable: Optional[float] = None


@dataclass(frozen=True)
class CommFigure:
    """Collectives of one kind over one mesh dimension in the step: calls and bytes (the local tensor's)."""

    dim: str
    op: str
    calls: int
    bytes: float


@dataclass
class RankDryRun:
    """What one simulated rank did, beside what the planner predicts for it."""

    rank: int
    world_size: int
    coordinates: dict[str, int]
    pipeline_rank: int
    layers: int
    in_flight: int
    measured: MemoryFigures
    predicted: MemoryFigures
    comm: list[CommFigure] = field(default_factory=list)
    predicted_comm: list[CommFigure] = field(default_factory=list)
    step_ran: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    # The interleaved schedule: the rank ran its whole order (every chunk of every microbatch; `in_flight` is then
    # the step's microbatches), not 1F1B's or GPipe's in-flight microbatches forward then backward.
    whole_schedule: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankDryRun":
        data = dict(data)
        data["measured"] = MemoryFigures(**data["measured"])
        data["predicted"] = MemoryFigures(**data["predicted"])
        data["comm"] = [CommFigure(**c) for c in data["comm"]]
        data["predicted_comm"] = [CommFigure(**c) for c in data["predicted_comm"]]
        return cls(**data)


def _storage_key(t: Tensor) -> int:
    # Meta tensors all have data_ptr 0: tell storages apart by their StorageImpl instead.
    return t.untyped_storage()._cdata  # private: the only identity a meta storage has




def measure_states(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """``(params, grads, optimizer)`` bytes of distinct storages this rank holds (masters count as optimizer)."""
    counter = StorageCounter(key=_storage_key)
    params = [p for p in module.parameters()]
    param_bytes = sum(counter.add(p.data) for p in params)
    grads = sum(counter.add(p.grad) for p in params)
    opt_params = [q for g in optimizer.param_groups for q in g["params"]]
    grads += sum(counter.add(q.grad) for q in opt_params)
    opt = sum(counter.add(q.data) for q in opt_params)
    for state in optimizer.state.values():
        opt += sum(counter.add(v) for v in state.values() if isinstance(v, Tensor))
    return param_bytes, grads, opt


class _MetaFlashAttention(torch.autograd.Function):
    """Causal attention with the saved-tensor profile of a GPU flash kernel on grouped-query heads:
    ``q``, the *unrepeated* ``k``/``v``, the output and the fp32 log-sum-exp (flash attention with
    ``enable_gqa`` reads k/v heads in place). Shapes only: the forward and backward run the CPU flash
    kernel's meta implementation on k/v repeated to the query heads, and do not keep the repeat."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, is_causal, scale):  # noqa: ANN001, ANN205
        group = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), dropout_p, is_causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group, dropout_p, is_causal, scale = ctx.args
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), out, lse,
            dropout_p, is_causal, scale=scale,
        )
        b, kv_heads = k.shape[0], k.shape[1]
        dk = dk.view(b, kv_heads, group, *dk.shape[2:]).sum(2)
        dv = dv.view(b, kv_heads, group, *dv.shape[2:]).sum(2)
        return dq, dk, dv, None, None, None


class _MetaFusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps what CUDA's ``aten._fused_rms_norm`` keeps: the 16-bit input and the fp32
    ``rstd`` (on meta/CPU that op decomposes and keeps two fp32 copies of the input instead)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: ANN001, ANN205
        upcast = x.float()
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
        out = upcast * rstd
        if weight is not None:
            out = out * weight.float()
        ctx.save_for_backward(x, rstd, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * (weight.float() if weight is not None else 1.0)
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).flatten(0, -2).sum(0).to(weight.dtype) if weight is not None else None
        return dx.to(x.dtype), dw, None


def _rms_norm(x: Tensor, weight: Optional[Tensor], eps: Optional[float]) -> Tensor:
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    if not isinstance(x, DTensor):
        weight = weight.to_local() if isinstance(weight, DTensor) else weight
        return _MetaFusedRMSNorm.apply(x, weight, eps)
    # Sequence-sharded norm: run on the local rows; the weight's gradient is a partial sum over them.
    local_weight = None
    if weight is not None:
        local_weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim) \
            if isinstance(weight, DTensor) else weight
    out = _MetaFusedRMSNorm.apply(x.to_local(), local_weight, eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class _FusedAttention(TorchFunctionMode):
    """The fused GPU kernels' saved tensors for attention and RMSNorm, on meta tensors.

    Issue 23 (dry run vs planner, activations ~3x): on the meta (and CPU) device two ops take
    composite paths that keep more for backward than the CUDA kernels a real run uses:

    * ``scaled_dot_product_attention`` takes its math fallback, which keeps the ``heads x s x s``
      scores; this mode calls the flash kernel's meta implementation instead, through
      :class:`_MetaFlashAttention` so grouped-query k/v are kept unrepeated, as CUDA's flash
      attention (``enable_gqa``) does.
    * ``rms_norm`` is decomposed: it keeps the fp32 upcast input and the fp32 normalized tensor,
      ``8 sbh`` bytes per norm; on CUDA it runs ``aten._fused_rms_norm``, which keeps the 16-bit
      input and the fp32 ``rstd`` (``2 sbh + 4 sb``). That op decomposes on meta too, so this mode
      runs :class:`_MetaFusedRMSNorm`, which keeps what the CUDA kernel keeps.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            plain = all(type(t) is Tensor or type(t) is nn.Parameter for t in (q, k, v))
            if plain and q.is_meta and kwargs.get("attn_mask") is None and len(args) == 3:
                return _MetaFlashAttention.apply(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), kwargs.get("scale")
                )
        if func in _DATA_DEPENDENT and isinstance(args[0], Tensor) and args[0].is_meta:
            answer = _transformers_answer(func)
            if answer is not None:
                return answer
        if func is F.rms_norm and args[0].is_meta:
            x, shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")
            if len(shape) == 1:
                return _rms_norm(x, weight, eps)
        return func(*args, **kwargs)


_DATA_DEPENDENT = (Tensor.__bool__, Tensor.item)


def _transformers_answer(func):  # noqa: ANN001, ANN202
    """What a data-dependent check of ``transformers`` on a meta tensor answers, or ``None`` (let it fail).

    Meta tensors have no values. ``transformers`` branches on data in two kinds of places on the
    training path, both asking whether the batch is plain: ``find_packed_sequence_indices`` ("are
    these position ids one sequence per row?") and the SDPA mask's ``padding_mask.all()`` ("no
    padding?"). The dry run's batches are plain token windows (what ``TextDataModule`` loads), so
    the answer is ``True`` there. Only a check made by ``transformers`` itself is answered; any
    other (the library's, the user's) still raises, rather than take a branch on an invented value.
    """
    frame = sys._getframe(1)  # private: up to the caller of Tensor.__bool__ / .item, past the torch-function modes
    while frame is not None and (
        frame.f_code.co_name == "__torch_function__" or frame.f_globals.get("__name__", "").startswith("torch")
    ):
        frame = frame.f_back
    if frame is None or not frame.f_globals.get("__name__", "").startswith("transformers."):
        return None
    return True if func is Tensor.__bool__ else 1


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (the tensor that holds its memory); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode and still alive; and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0
        self.exclude: set[int] = set()  # storages that existed before (weights, states): not activations
        self.forward_peak = 0  # the peak when the forwards are done (set by `_train_step`)
        self.trace: Optional[AllocationTrace] = None  # every allocation and free in order, when set

    def mark(self, name: str) -> None:
        """A point of the step the allocator model needs (``plan.allocator.AllocationTrace``)."""
        if self.trace is not None:
            self.trace.mark(name)

    def _release(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        if self.trace is not None and nbytes:
            self.trace.free(key, nbytes)

    def _hold(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` at its size now, until it is freed."""
        key = storage._cdata  # private: see _storage_key
        if key not in self.live:
            weakref.finalize(storage, self._release, key)
        nbytes = storage.nbytes()
        if self.trace is not None:  # a resize (FSDP2's gathered weights) frees the old size and takes the new
            if self.live.get(key):
                self.trace.free(key, self.live[key])
            if nbytes:
                # FSDP2 gathers and reduce-scatters on streams of its own, whose cached blocks a GPU keeps apart;
                # on meta the device module's streams are CPU's, which still say which one is current.
                self.trace.alloc(key, nbytes, id(torch.cpu.current_stream()))
        self.live[key] = nbytes

    def track(self, t: Tensor) -> None:
        """Count ``t``'s storage (its local shard's) if it is not yet counted and not excluded."""
        t = _local(t)
        if t.is_sparse:
            return
        storage = t.untyped_storage()
        if storage._cdata not in self.live and storage._cdata not in self.exclude:
            self._hold(storage)
            self.peak = max(self.peak, self.current)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place (FSDP2's gathered weights): count its new size."""
        if storage._cdata not in self.exclude:
            self._hold(storage)
            self.peak = max(self.peak, self.current)

    def held_by(self, tensors: Any) -> int:
        """Live bytes of the distinct storages of ``tensors`` (their local shards') that this mode counts."""
        keys = {_storage_key(_local(t)) for t in tensors}
        return sum(self.live.get(key, 0) for key in keys)

    @property
    def current(self) -> int:
        return sum(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: only new storages are allocations.
        # A DTensor is a wrapper whose storage has the *global* size; the memory is its local shard's
        # (issue 23: counting the wrappers made sequence-parallel activations and the vocab-parallel
        # log-softmax look t times larger).
        inputs = {_storage_key(_local(t)) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and not t.is_sparse:
                storage = _local(t).untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in inputs:
                    self._hold(storage)
        self.peak = max(self.peak, self.current)
        return out


# c10d ops (what torch.distributed's calls reach through the dispatcher) and functional collectives (DTensor).
_OPS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "broadcast_": "broadcast",
    "broadcast": "broadcast", "send": "send_recv",  # a receive carries the sender's bytes: counted once, sent
}


class _CommCounter(TorchDispatchMode):
    """Collectives by mesh dimension, with the bytes of the local tensor each call sends: the c10d
    ops torch.distributed's calls dispatch (ZeRO, pipeline sends) and DTensor's functional collectives."""

    def __init__(self, dims: ParallelDims) -> None:
        super().__init__()
        self.counts: dict[tuple[str, str], list[float]] = {}
        names: dict[str, str] = {}
        # ZeRO's gradient group spans dp x cp under context parallelism: the planner's "dp" ("edp") traffic.
        label = {"dp_shard_cp": "dp", "dp_cp": "dp", "edp_cp": "edp"}
        for name in ("tp", "cp", "ep", "pp", "dp_replicate", "dp", "edp", "dp_shard_cp", "edp_cp", "dp_cp"):
            if name not in dims.valid_mesh_names:
                continue
            with contextlib.suppress(Exception):
                mesh = dims.get_mesh(name)
                if mesh.size() > 1:
                    names.setdefault(mesh.get_group().group_name, label.get(name, name))
        self.names = names

    def _dim(self, group: Any) -> str:
        if group is None:
            return "world"
        if not isinstance(group, str):
            with contextlib.suppress(Exception):
                group = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
            group = getattr(group, "group_name", str(group))
        return self.names.get(group, group)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            op = _OPS.get(func._schema.name.split("::")[-1])
            if op is not None:
                flat = torch.utils._pytree.tree_leaves((args, kwargs))
                tensors = [t for t in flat if isinstance(t, Tensor)]
                if func.namespace == "_c10d_functional":
                    group = next((a for a in reversed(flat) if isinstance(a, str)), None)
                    tensors = tensors[:1]
                else:
                    group = next((a for a in flat if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))), None)
                    # The tensor a rank passes in: reduce-scatter's input is its last tensor argument,
                    # alltoall_base_'s its second (after the output); the others' first.
                    tensors = tensors[-1:] if op == "reduce_scatter" else tensors[1:2] if op == "all_to_all" else tensors[:1]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                entry = self.counts.setdefault((self._dim(group), op), [0, 0.0])
                entry[0] += 1
                entry[1] += nbytes
        return func(*args, **kwargs)

    def figures(self) -> list[CommFigure]:
        return [CommFigure(dim, op, int(c), b) for (dim, op), (c, b) in sorted(self.counts.items())]


def start_fake_world(world_size: int, rank: int, gpus_per_node: int = 8) -> None:
    """Start torch's fake process group: ``world_size`` ranks, this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend (no network)

    if not isinstance(getattr(torch, "meta", None), _MetaDeviceModule):
        torch.meta = _MetaDeviceModule(gpus_per_node)  # type: ignore[attr-defined]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class _MetaDeviceModule:
    """What ``torch.<device type>`` gives for the meta device, which torch has no module for.

    DTensor's cost model asks the mesh's device module for devices per host (a node of
    ``gpus_per_node`` devices here); FSDP2 asks it for the current device and for streams and events,
    which on meta order nothing: CPU's (``torch.cpu``, whose streams are no-ops) stand in for them."""

    def __init__(self, gpus_per_node: int) -> None:
        self._gpus_per_node = gpus_per_node

    def device_count(self) -> int:
        return self._gpus_per_node

    def current_device(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


@contextlib.contextmanager
def _count_loss_parallel(live: "_LiveBytes") -> Any:
    """Count the temporaries of torch's vocab-parallel loss (``loss_parallel``) in ``live``.

    DTensor runs those ops in Python handlers on the local shards while it handles the op, with every dispatch
    mode off: the log-softmax's fp32 copies of the local logits (the input cast, the max-shifted input, its
    exp, the result), 14 bytes per local logit at its peak in bf16, were invisible to the dry run (issue 23:
    13.7 GiB at tp=2 on an H200, `benchmarks/gpu_fake_world.py --tp 2`). Each handler runs under ``live`` for the
    step; ``loss_parallel()`` copies them into DTensor's table when it is entered, so they are wrapped first."""
    handlers = _tp_loss.customized_loss_ops
    originals = dict(handlers)

    def counted(handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with live:
                return handler(*args, **kwargs)
        return run

    handlers.update({op: counted(handler) for op, handler in originals.items()})
    try:
        yield
    finally:
        handlers.update(originals)


@contextlib.contextmanager
def _fsdp_on_meta(live: Optional["_LiveBytes"] = None) -> Any:
    """Let FSDP2 (ZeRO-3) train on meta parameters, and count its gathered weights.

    FSDP2 refuses meta parameters at its first forward (a real run must materialize them); on meta the
    gathers and reduce-scatters have shapes only, which is all the dry run needs, so that check is lifted.
    FSDP2 allocates and frees the gathered weights by resizing their storages in place
    (``UntypedStorage.resize_``), which no dispatch mode sees: while ``live`` is given, each resize is
    reported to it, so the gathered weights count while they are held."""
    group_cls = _fsdp_param_group.FSDPParamGroup
    validate, resize = getattr(group_cls, "_validate_no_meta_params", None), torch.UntypedStorage.resize_

    def resize_and_count(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        if live is not None:
            live.resized(storage)
        return out

    if validate is not None:  # ZeRO 0-2 do not need it; a torch that renamed it fails ZeRO-3's dry run test
        group_cls._validate_no_meta_params = lambda self: None
    torch.UntypedStorage.resize_ = resize_and_count  # type: ignore[method-assign]
    try:
        yield
    finally:
        if validate is not None:
            group_cls._validate_no_meta_params = validate
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int) -> int:
    """Microbatches whose activations a pipeline rank holds at its peak: GPipe all of them, 1F1B
    ``pp - rank`` (its warm-up forwards plus one; Narayanan et al. 2021, Sec. 2.2)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - pp_rank, microbatches)
    raise ValueError(
        f"The dry run runs `schedule='1f1b'`, `'gpipe'` or `'interleaved'`, not {schedule!r}; set schedule to one of them."
    )


# Collectives the planner prices per microbatch (the rest, dp/edp/dp_replicate, once per step).
_PER_MICROBATCH_DIMS = ("tp", "cp", "ep")


def _predicted(
    model: ModelDesc, config: ParallelConfig, dims: ParallelDims, training: Training, pp_rank: int, in_flight: int
) -> tuple[MemoryFigures, list[CommFigure], int]:
    """The planner's figures for this pipeline rank. Its per-microbatch collectives (tp, cp, ep) are
    scaled from the step's microbatches to the ``in_flight`` ones the dry run runs, so both sides count
    the same microbatches; the data-parallel ones are per step on both sides, but the gradient reductions of
    ZeRO-2's "reduce_each_microbatch" under a pipeline, which are per microbatch too."""
    cluster = Cluster.of("h100", nodes=max(1, dims.world_size // 8), gpus_per_node=min(8, dims.world_size))
    layout = layout_from_config(config, dims)
    est = estimate(model, cluster, training, layout)
    rank = est.ranks[pp_rank]
    res, mem = rank.resident, rank.memory
    # The dry run's activations are what the forwards leave held; the layer that full recomputation
    # rebuilds in backward comes later (it is in both peaks).
    figures = MemoryFigures(res.params, res.grads, res.optimizer, mem.activations - mem.transient, mem.total)
    microbatches = training.global_batch // (training.micro_batch * dims.dp)
    comm = []
    for c in rank.collectives:
        per_microbatch = c.dim in _PER_MICROBATCH_DIMS or (layout.reduces_each_microbatch and c.what.startswith("gradient"))
        calls = c.calls * in_flight / microbatches if per_microbatch else c.calls
        comm.append(CommFigure(c.dim, c.op, int(round(calls)), c.payload * calls))
    return figures, comm, rank.layers


def dry_run_rank(
    build_model: Callable[[], nn.Module],
    config: ParallelConfig,
    world_size: int,
    rank: int,
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    model: ModelDesc,
    training: Training,
    run_step: bool = True,
) -> RankDryRun:
    """Dry-run ``rank`` of a ``world_size``-rank job of the model ``build_model()`` makes (on the
    meta device: a module with ``loss_fn(logits, targets)``, or one whose forward returns logits; under
    ``pp > 1`` a LightningModule with ``configure_pipeline``).

    ``model``/``training`` describe the same run to the planner; ``training.precision`` is also the
    precision the rank runs in: a ``*-true`` one (``*-mixed`` runs under autocast, which does not act on
    meta tensors, so it would measure fp32 activations).
    Call once per process: it starts the fake process group (and leaves it for the caller).
    """
    if not training.precision.endswith("-true"):
        raise ValueError(
            f"The dry run cannot run `precision={training.precision!r}`: autocast does not act on meta tensors."
            " Choose 'bf16-true', '16-true' or '32-true'."
        )
    precision = ParaPrecision(training.precision)
    clock: dict[str, float] = {}
    t0 = time.perf_counter()
    start_fake_world(world_size, rank)
    dims = config.resolve_dims(world_size)
    dims.build_mesh("meta")
    clock["mesh"] = time.perf_counter() - t0
    t = time.perf_counter()
    with torch.device("meta"):
        module = build_model()
    # As ParaStrategy calls it: `bf16-true` gives bf16 weights and (ZeRO 0-2) fp32 masters taken before the cast.
    # Activation recomputation runs the forward again in backward, where the fused-kernel mode is not active.
    parallel = parallelize(
        module, dims, config, param_dtype=precision.param_dtype, master_dtype=precision.master_dtype,
        recompute_context=_FusedAttention,
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    if parallel.data_parallel is not None:
        parallel.data_parallel.attach_optimizer(optimizer, is_expert=parallel.expert_predicate())
    step_mixed_groups_per_tensor(optimizer)  # as ParaStrategy does
    for group in optimizer.param_groups:
        # Torch's choice on a GPU (its multi-tensor step for CUDA tensors; the for-loop one on meta and CPU), whose
        # step makes one fp32 temporary per element it steps (`_foreach_sqrt` of the second moments).
        if group["foreach"] is None:
            group["foreach"] = True
    clock["parallelize"] = time.perf_counter() - t
    pp_rank = dims.local_rank("pp") if dims.pp > 1 else 0
    microbatches = config.pipeline_microbatches if dims.pp > 1 else 1
    whole_schedule = dims.pp > 1 and config.schedule == "interleaved"
    if whole_schedule:
        # The interleaved schedule's peak depends on its order across the rank's chunks: run all of it, in the order
        # torch runs it (`plan.pipeline.compute_order`, checked against torch's schedule).
        order = compute_order("interleaved", dims.pp, microbatches, config.virtual_stages, pp_rank)
        in_flight = microbatches
    else:
        in_flight = in_flight_microbatches(config.schedule, dims.pp, pp_rank, microbatches)
        order = (("F", 0),) * in_flight + (("B", 0),) * in_flight
    live, comm = _LiveBytes(), _CommCounter(dims)
    live.exclude = {_storage_key(_local(p)) for p in module.parameters()}
    live.exclude |= {_storage_key(_local(q)) for g in optimizer.param_groups for q in g["params"]}
    # The step's allocations in order, for the caching allocator's reserved peak (`plan.allocator`); the weights and
    # masters exist before it.
    states = {_storage_key(_local(t)): _local(t).untyped_storage().nbytes() for t in
              [*module.parameters(), *(q for g in optimizer.param_groups for q in g["params"])]}
    live.trace = AllocationTrace(states=list(states.values()))
    states_before = measure_states(module, optimizer)  # weights and fp32 masters, made before the step
    before = sum(states_before)
    t = time.perf_counter()
    activations, schedule_peak, backward_peak = 0.0, 0, 0
    if run_step:
        # MoE layers route with a fixed balanced assignment: meta tensors have no values to route by.
        if microbatches > in_flight:
            # With more microbatches than in flight, a later microbatch runs while the earlier ones'
            # gradients are held (accumulated unsharded until the step's sync): run the in-flight
            # microbatches once untracked first, so the measured pass finds those gradients.
            untracked = _LiveBytes()
            with _FusedAttention(), balanced_routing(*parallel.parts), _fsdp_on_meta(untracked):
                _train_step(module, parallel, dims, seq_len, micro_batch, hidden, order, untracked,
                            precision.param_dtype or torch.float32)
            # The accumulated gradients count as live bytes of the measured pass: the step's gradient sync
            # frees each one as it packs it into its bucket (ZeRO-1/2), which a constant added to the peak
            # would miss (it made the 405B last rank's peak 30% over the planner: a second gradient copy).
            for tensor in [p.grad for p in module.parameters()] + [
                q.grad for g in optimizer.param_groups for q in g["params"]
            ] + _reduced_shards(parallel):
                if tensor is not None:
                    live.track(tensor)

        with _FusedAttention(), comm, live, balanced_routing(*parallel.parts), _fsdp_on_meta(live), \
                _count_loss_parallel(live):
            activations = _train_step(
                module, parallel, dims, seq_len, micro_batch, hidden, order, live,
                precision.param_dtype or torch.float32,
            )
            schedule_peak = live.peak
            live.mark("schedule_end")
            if parallel.data_parallel is not None:
                if _reduces_each_microbatch(parallel):
                    parallel.data_parallel.commit_microbatches()  # reduced during the schedule, as the runner's
                else:
                    parallel.data_parallel.sync_now()
                parallel.data_parallel.flush()
            backward_peak = live.peak
            live.mark("optimizer_start")
            optimizer.step()
            live.mark("step_end")
    clock["step"] = time.perf_counter() - t
    params, grads, opt = measure_states(module, optimizer)
    # The peak: what existed before the step (weights, masters) plus the step's own live peak (which
    # counts the accumulated gradients while they live). The optimizer's moments appear in this first
    # step's `optimizer.step()`; from the second step on they exist through forward and backward too,
    # so the steady-state peak adds them to backward's peak. Without a pipeline, Lightning calls `zero_grad`
    # after the training step's forward, so from the second step on the last step's gradients, as the rank
    # keeps them between steps (`grads`), are held through the forward too (measured on an H100: the forward's
    # peak holds them). A pipeline's schedule runs before it, and ParaStrategy's runner sets those gradients aside
    # while the schedule runs: held through its forwards and backwards, gone by the gradient sync.
    moments = opt - states_before[2]
    if dims.pp == 1:
        steady = max(live.forward_peak + moments + grads, backward_peak + moments, live.peak)
    else:
        steady = max(schedule_peak + moments + grads, backward_peak + moments, live.peak)
    peak = before + steady if run_step else params + grads + opt
    # The last step's gradients go at `zero_grad`: after the forward without a pipeline, after the schedule with one.
    reserved = [float(steady_state_peaks(
        live.trace, gradients_freed_at="schedule_end" if dims.pp > 1 else "forward_end", expandable_segments=expand,
    ).reserved) if run_step else None for expand in (False, True)]
    measured = MemoryFigures(float(params), float(grads), float(opt), float(activations), float(peak), *reserved)
    predicted, predicted_comm, layers = _predicted(model, config, dims, training, pp_rank, in_flight)
    coords = {name: dims.local_rank(name) for name in ("pp", "dp", "cp", "tp", "ep") if getattr(dims, name) > 1}
    clock["total"] = time.perf_counter() - t0
    return RankDryRun(
        rank=rank, world_size=world_size, coordinates=coords, pipeline_rank=pp_rank, layers=layers,
        in_flight=in_flight, measured=measured, predicted=predicted, comm=comm.figures(),
        predicted_comm=predicted_comm, step_ran=run_step, seconds=clock, whole_schedule=whole_schedule,
    )


def causal_lm_step_loss(logits: Any, tokens: Tensor) -> Tensor:
    """The loss of a model without ``loss_fn`` whose forward takes token ids and returns the logits (a
    transformers causal LM in a LightningModule, e.g. :class:`~lightning_para.recipes.HFCausalLM`):
    transformers' causal-LM loss (``ForCausalLMLoss``), labels = the tokens shifted inside, as ``model(labels=...)``
    computes it: position ``t`` predicts token ``t + 1``, the last position is ignored, the logits go to fp32."""
    logits = getattr(logits, "logits", logits)  # a transformers ModelOutput
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            "The dry run trains a model with a `loss_fn(logits, targets)` method, a `configure_pipeline()` (pp > 1),"
            " or whose forward(input_ids) returns (batch, seq, vocab) logits; this one returned"
            f" {type(logits).__name__}{tuple(logits.shape) if isinstance(logits, Tensor) else ''}."
        )
    return causal_lm_loss(logits, tokens, logits.shape[-1])


def _train_step(
    module: nn.Module, parallel: ParallelModel, dims: ParallelDims, seq_len: int, micro_batch: int, hidden: int,
    order: Sequence[tuple[str, int]], live: "_LiveBytes", dtype: torch.dtype,
) -> float:
    """Run this rank's forwards and backwards in ``order`` (``("F" or "B", local chunk)`` each: 1F1B's and GPipe's
    in-flight microbatches all forward then all backward, or the interleaved schedule's whole order). Returns the
    activation bytes held at the most, after a forward (this step's gradients and the stages' weights left out).
    ``dtype``: the activations' (a later pipeline stage receives its input in it)."""
    runner = parallel.pipeline
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    if runner is None:
        stages, firsts, lasts = [module], [True], [True]
        loss_fn = getattr(module, "loss_fn", None) or causal_lm_step_loss
    else:
        stages, loss_fn = list(runner.stage_modules), runner.spec.loss_fn
        firsts = [m.stage_index == 0 for m in stages]
        lasts = [m.stage_index == runner.num_stages - 1 for m in stages]
        # The runner gives `split_batch` the whole batch before the schedule runs; transformers' pipeline_spec
        # remembers its label count there (the weight of each microbatch's loss). Shapes only on meta.
        per_chunk = sum(1 for kind, chunk in order if kind == "F" and chunk == 0)
        whole = torch.zeros(micro_batch * per_chunk, seq_len, dtype=torch.long, device="meta")
        runner.spec.split_batch((whole, whole))
    targets = tokens
    context = parallel.context
    if context is not None:
        # Context parallelism as the strategy runs it: this rank's head-tail chunks of the sequence (the
        # module's `context_parallel_batch` hook or the default split), and each forward inside the cp step
        # mode, where SDPA is ring / all-to-all attention and the cross-entropy covers the whole sequence.
        tokens, targets = context.split_batch(module, (tokens, tokens))
    sp = parallel.config.sequence_parallel and dims.tp > 1
    local_len = tokens.shape[1]
    stream_len = local_len // dims.tp if sp and runner is not None else local_len
    data_parallel = parallel.data_parallel
    # ZeRO-1/2 hold the microbatches' gradients and sync once after them (the caller's `sync_now`), as the
    # pipeline runner does; ZeRO-3 (FSDP2, no pipeline: one microbatch) reduce-scatters each unit's gradients
    # in its backward, as a step without accumulation does.
    # ZeRO-2's "reduce_each_microbatch" reduces each microbatch's gradients after its backward, as the runner does.
    deferred = data_parallel is not None and not data_parallel.fully_sharded
    each_microbatch = _reduces_each_microbatch(parallel)
    if each_microbatch:
        sync = data_parallel.each_microbatch()
    else:
        sync = data_parallel.no_sync() if deferred else contextlib.nullcontext()
    outputs: dict[int, list[Tensor]] = {chunk: [] for chunk in range(len(stages))}
    last_forward = max(i for i, (kind, _) in enumerate(order) if kind == "F")
    held = 0.0
    # Tensors autograd saves are the activations; some are made where the dispatch mode does not see
    # them (DTensor redistributes its inputs inside its own dispatch: under sequence parallelism the
    # all-gathered inputs of the q/k/v and MLP projections). Count every saved local storage too.
    def pack(t: Tensor) -> Tensor:
        live.track(t)
        return t

    with sync, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for index, (kind, chunk) in enumerate(order):
            stage = stages[chunk]
            if kind == "F":
                if firsts[chunk]:
                    x: Tensor = tokens
                else:
                    x = torch.empty(micro_batch, stream_len, hidden, dtype=dtype, device="meta", requires_grad=True)
                with loss_parallel_step(parallel.loss_parallel), \
                        (context.mode() if context else contextlib.nullcontext()):
                    y = stage(x)
                    if lasts[chunk]:
                        y = loss_fn(y, targets)
                outputs[chunk].append(y)
                # ZeRO-3 keeps some units gathered from forward to backward (the last block, the head): weights,
                # not activations (the planner prices them with the gathered buffers); the stages' parameters are
                # the gathered tensors while they are. Gradients (accumulated, or summed shards) are not either.
                # (Read after the forward: FSDP2 registers the gathered tensors as the parameters while it keeps them.)
                weights = [p for s in stages for p in s.parameters()]
                grads = [p.grad for p in weights if p.grad is not None] + _reduced_shards(parallel)
                held = max(held, float(live.current - live.held_by(weights) - live.held_by(grads)))
                if index == last_forward:
                    live.forward_peak = live.peak
                    live.mark("forward_end")
                continue
            # Each microbatch's output (and with it its graph) is dropped after its backward, as torch's pipeline
            # stage pops it from its forward cache: what the graph itself keeps beside its saved tensors is freed
            # per microbatch, not when the last one is done.
            y = outputs[chunk].pop(0)
            with loss_parallel_backward(parallel.loss_parallel):
                if y.dim() == 0:
                    y.backward()
                else:
                    y.backward(torch.empty_like(y))
            del y
            if each_microbatch:
                data_parallel.reduce_part(chunk)
    return held


def _reduces_each_microbatch(parallel: ParallelModel) -> bool:
    return parallel.pipeline is not None and parallel.data_parallel is not None \
        and parallel.data_parallel.reduces_each_microbatch


def _reduced_shards(parallel: ParallelModel) -> list[Tensor]:
    """The shards ZeRO-2's "reduce_each_microbatch" has summed so far (``Bucket.pending``): gradients the rank holds."""
    engine = getattr(parallel.data_parallel, "engine", None)
    return [b.pending for b in engine.buckets if b.pending is not None] if engine is not None else []


__all__ = ["CommFigure", "MemoryFigures", "RankDryRun", "dry_run_rank", "in_flight_microbatches", "measure_states"]
