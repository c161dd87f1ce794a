"""Data parallelism with ZeRO stages 0, 1 and 2 for any elementwise optimizer.

=====  =====================================================  ===========================
stage  what each of the N data-parallel ranks holds (Adam)    traffic per optimizer step
=====  =====================================================  ===========================
0      params, grads, optimizer state: 16 B/param (bf16+fp32)  all-reduce grads: 2 psi
1      optimizer state and fp32 master 1/N: 4 + 12/N          reduce-scatter + all-gather: 2 psi
2      gradients 1/N as well: 2 + 14/N                        reduce-scatter + all-gather: 2 psi
=====  =====================================================  ===========================

(ZeRO paper, Rajbhandari et al. 2020, Fig. 1 and Sec. 7; stage 3 is FSDP2, see ``fsdp.py``.)

Three modules share the work: this one synchronises the gradients (hooks, buckets, launch, wait),
``zero_optimizer.py`` shards the optimizer and gathers the parameters after its step,
``zero_microbatch.py`` reduces once per pipeline microbatch, and ``layout.py`` holds the shard and
bucket arithmetic.

Hybrid sharding (``replicate_mesh``): ZeRO-1/2 state is sharded over each parameter's
mesh (``dp_shard``, normally inside a node) and replicated over ``replicate_mesh``
(``dp_replicate``, across nodes). A bucket's gradients are reduce-scattered within the shard
group, then the shard alone is all-reduced across replicas: ``2 psi / dp_shard`` bytes cross
the replicate dimension per step; the updated parameters are all-gathered within the shard
group only.

How it works:

* Gradients are synchronised in *buckets* of ``bucket_size_mb`` (the first one at most 1 MiB,
  as DDP does, so communication starts early), in one fixed order on every rank (reverse
  parameter order, which is roughly the order backward produces them). A
  post-accumulate-grad hook counts the gradients of each bucket; every stage launches a
  bucket's collective (``async_op``) as soon as it is full and all earlier buckets are
  launched, so communication overlaps backward. An end-of-backward callback launches what is
  left and waits: the optimizer is the first to need the result.
* gloo has no reduce-scatter (torch's gloo ``reduce_scatter_tensor`` all-reduces a clone of the
  whole input): on a gloo group each pair of ranks exchanges the rows it owes the other, the
  bytes of a real reduce-scatter (:func:`~.layout.reduce_scatter_rows`). NCCL and every other
  backend take the real reduce-scatter.
* Gradient accumulation: inside :meth:`ZeroDataParallel.no_sync` the hooks do nothing, so
  gradients accumulate locally and the last micro-step communicates once.
* Gradients users can read: once synchronised, each model parameter's ``.grad`` shows what
  the optimizer will read (:meth:`ZeroDataParallel._expose`). Stage 0: the averaged gradient
  itself, a view of the reduced bucket (:meth:`~.layout.ParamSlot.take_reduced_grad`). Stages
  1/2: a DTensor, ``Shard(0)`` over dp, whose local tensor *is* the master's gradient shard (no
  copy), so ``torch.nn.utils.clip_grad_norm_`` or an in-place edit of ``p.grad`` reaches the
  optimizer. It stays readable after the optimizer step (in
  ``on_train_batch_end``, as DDP keeps ``.grad`` until ``zero_grad``) and is dropped when the
  next backward starts (:meth:`ZeroDataParallel.before_backward`, and a tensor hook before
  accumulation), so autograd never adds into it.
  ``docs/data_parallel.md`` says what users may do with it per stage.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from lightning_para._dtensor import local_tensor
from lightning_para.parallel.data.layout import (
    Bucket,
    ParamSlot,
    RowReduction,
    attach_masters,
    build_buckets,
    pack_rank_major,
    reduce_scatter_rows,
)
from lightning_para.parallel.data.zero_microbatch import MicrobatchReduction
from lightning_para.parallel.data.zero_optimizer import OptimizerSharding


class ZeroDataParallel(MicrobatchReduction, OptimizerSharding):
    """Bucketed gradient synchronisation and optimizer sharding for ZeRO stages 0, 1, 2.

    Args:
        named_params: ``(name, parameter, data_parallel_mesh)`` for every trainable parameter
            of this rank, in model order. The mesh is the 1-D mesh over which the parameter
            is replicated (dense: ``dp``; experts: ``edp``).
        stage: 0, 1 or 2.
        bucket_size_mb: bucket capacity.
        master_dtype: dtype of separate optimizer copies of the weights (fp32 under
            ``bf16-true``). Build this object *before* casting the model, so the masters start
            from the exact fp32 values. ``None`` steps the model's own tensors.
        replicate_mesh: hybrid sharding (stages 1-2): the 1-D mesh over which the sharded state
            is replicated; each gradient shard is all-reduced over it after the reduce-scatter.
        mesh_of: slices the joint ``(dp, tp)`` mesh by names (``ParallelDims.get_mesh``), to
            describe the gradient shards of tensor-parallel parameters as DTensors in ``.grad``.
        hooks: register the gradient hooks now; ``False`` leaves it to :meth:`register_hooks`, called
            once the model is cast (a cast of DTensor parameters drops hooks already on them).
        part_of: the index of this rank's pipeline stage that holds a parameter (``None``: none or
            several); buckets never span two stages, so :meth:`reduce_part` can reduce one.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter, DeviceMesh]],
        stage: int,
        *,
        bucket_size_mb: float = 25.0,
        master_dtype: Optional[torch.dtype] = None,
        replicate_mesh: Optional[DeviceMesh] = None,
        mesh_of: Optional[Callable[..., DeviceMesh]] = None,
        hooks: bool = True,
        part_of: Optional[Callable[[nn.Parameter], Optional[int]]] = None,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroDataParallel handles ZeRO stages 0-2, got {stage}; stage 3 uses FSDP2.")
        self.replicas = replicate_mesh.size() if replicate_mesh is not None else 1
        if self.replicas > 1 and stage == 0:
            raise ValueError("Hybrid sharding (dp_replicate > 1) needs ZeRO stage 1 or 2 here; stage 0 shards nothing.")
        self.replicate_group = replicate_mesh.get_group() if self.replicas > 1 else None  # type: ignore[union-attr]
        self.stage = stage
        # Every stage overlaps its reduction with backward: launching early frees each bucket's full
        # gradients sooner, and changes nothing else.
        self.launch_during_backward = True
        self.sync_enabled = True
        self._callback_queued = False
        self._synced_since_step = False
        self._suppress_gather = False
        self._each_microbatch = False  # inside `reduce_each_microbatch()`
        self._in_flight: list[Bucket] = []  # launched by `reduce_part`, not yet added to `Bucket.pending`
        self._abandoned: list[tuple] = []  # what a failed schedule left on the wire (`_discard_pending`)
        # Sliced once per name tuple: each slice of the root mesh builds a new DeviceMesh object.
        self._mesh_of = functools.lru_cache(maxsize=None)(mesh_of) if mesh_of is not None else None
        self.slots: list[ParamSlot] = []
        self._slot_of: dict[nn.Parameter, ParamSlot] = {}
        # Parameters of a data-parallel group of one rank with nothing to copy: no bucket, no hook,
        # no collective; the optimizer steps them as they are (e.g. tp=2 with dp=1).
        self._untouched: set[int] = set()
        for name, param, mesh in named_params:
            if not param.requires_grad or param.numel() == 0 or param in self._slot_of:
                continue
            alone = mesh.size() == 1 and self.replicas == 1  # nobody else holds this gradient
            if alone and master_dtype is None:
                self._untouched.add(id(param))
                continue
            slot = ParamSlot(name=name, param=param, mesh=mesh, sharded=stage > 0 and not alone,
                             part=part_of(param) if part_of is not None else None)
            self.slots.append(slot)
            self._slot_of[param] = slot
        self.buckets = build_buckets(self.slots, int(bucket_size_mb * 1024 * 1024))
        for bucket in self.buckets:
            attach_masters(bucket, master_dtype)
        self._slot_of_optimizer_param = {id(s.optimizer_param): s for s in self.slots}
        self._buckets_of_part: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            if bucket.part is not None:
                self._buckets_of_part.setdefault(bucket.part, []).append(bucket)
        # Which buckets each optimizer we sharded steps (several optimizers may share one model).
        self._buckets_of_optimizer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._hooked = False
        if hooks:
            self.register_hooks()

    def register_hooks(self) -> None:
        """Hook every slot's parameter (once). Call it after the model's last dtype cast: ``module.to``
        replaces a DTensor parameter's tensor (``torch.utils.swap_tensors``) and the hooks on the old
        one never fire again (plain parameters keep theirs, their ``.data`` is swapped)."""
        if self._hooked:
            return
        self._hooked = True
        for slot in self.slots:
            if slot.master is not None:  # ZeRO-1/2 or separate masters: a gradient is shown (`_expose`)
                # Before accumulation: drop the gradient shown to users, so autograd starts afresh.
                slot.param.register_hook(partial(self._before_accumulate, slot))
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ accumulation
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication: gradients accumulate locally until a synced backward."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    # ------------------------------------------------------------------ backward side
    def _on_grad_ready(self, param: Tensor) -> None:
        if not self.sync_enabled:
            return
        if self._each_microbatch:
            # No end-of-backward callback: the runner ends each stage's microbatch with `reduce_part`.
            # The previous one's last buckets may still be on the wire: settled when the next backward
            # makes its first gradient (their buckets may be this one's), not at the end of their own.
            self._settle(block=True)
            bucket = self.buckets[self._slot_of[param].bucket]
            bucket.ready += 1
            if bucket.part is not None and bucket.ready == len(bucket.slots):
                self._launch_ready_buckets(self._buckets_of_part[bucket.part])
            return
        if not self._callback_queued:
            # private: see docs/architecture.md (DDP and FSDP queue their end-of-backward work the same way)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        if not self.launch_during_backward:
            return
        bucket = self.buckets[self._slot_of[param].bucket]
        bucket.ready += 1
        if bucket.ready == len(bucket.slots):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        # Strictly in bucket order: every rank must issue the same collectives in the same order.
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.launched:
                continue
            if bucket.ready < len(bucket.slots):
                return
            self._launch(bucket)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self.sync_now()

    def sync_now(self) -> None:
        """Launch every bucket not yet launched, wait for all, and write the reduced gradients.

        Parameters without a gradient on this rank contribute zeros, so all ranks issue the
        same collectives even when some parameters were unused (e.g. experts with no tokens).
        """
        self._sync(self.buckets)
        self._synced_since_step = True

    def _sync(self, buckets: Sequence[Bucket], *, into_pending: bool = False) -> None:
        for bucket in buckets:
            if not bucket.launched:
                self._launch(bucket)
        if self.replicate_group is not None:
            for bucket in buckets:
                self._reduce_over_replicas(bucket)
        for bucket in buckets:
            self._finish(bucket, into_pending=into_pending)

    def _reduce_over_replicas(self, bucket: Bucket) -> None:
        """Hybrid sharding: once the shard group's reduce-scatter is done, all-reduce the shard across replicas."""
        shard = bucket.work.wait()
        bucket.work = RowReduction([dist.all_reduce(shard, group=self.replicate_group, async_op=True)], lambda: shard)

    def flush(self) -> None:
        """Make sure this step's gradients are synchronised (idempotent within a step)."""
        if not self._synced_since_step:
            self.sync_now()

    @contextlib.contextmanager
    def step_without_communication(self) -> Iterator[None]:
        """An optimizer step that neither syncs gradients nor gathers parameters (e.g. to create the
        optimizer's state before a checkpoint is loaded into it)."""
        self._synced_since_step, self._suppress_gather = True, True
        try:
            yield
        finally:
            self._synced_since_step, self._suppress_gather = False, False

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        world, device, group = bucket.world, bucket.slots[0].local.device, bucket.slots[0].group
        # Stage 0: the gradients end to end; 1/2: rank-major, each rank's rows of every gradient in its segment.
        buffer = torch.empty(1 if self.stage == 0 else world, bucket.segment_numel, dtype=bucket.dtype, device=device)
        pack_rank_major(self._gradients_to_send(bucket), buffer)
        if self.stage == 0:
            buffer = buffer[0]
            works = []
            if world > 1:  # a group of one rank: its gradient is already the average
                buffer.div_(world)  # average before summing: keeps fp16/bf16 sums in range
                works = [dist.all_reduce(buffer, group=group, async_op=True)]
            bucket.work = RowReduction(works, lambda: buffer)
        else:
            if world * self.replicas > 1:  # one rank alone needs no collective: its gradient is the mean
                buffer.div_(world * self.replicas)  # the mean over every data-parallel rank, replicas included
            bucket.work = reduce_scatter_rows(buffer, bucket.slots[0].rank, group)
        bucket.buffer = buffer
        bucket.launched = True

    def _gradients_to_send(self, bucket: Bucket) -> list[Tensor]:
        """Each slot's accumulated gradient as ``rows x row elements`` (zeros where it has none). Stages 1/2 take
        it out of ``.grad`` (ZeRO-2 never holds all of them once their bucket is packed)."""
        grads = []
        for slot in bucket.slots:
            grad = slot.accumulated_grad()  # not a gradient shown after an earlier sync
            if self.stage > 0:
                # During a pipeline schedule (one reduction per microbatch) the shown shard is set aside, not gone.
                slot.clear_exposed_grad(forget=not self._each_microbatch)
                slot.param.grad = None
            if grad is None:
                grads.append(torch.zeros(slot.rows, slot.row_numel, dtype=bucket.dtype, device=slot.local.device))
            else:
                grads.append(local_tensor(grad).reshape(slot.rows, slot.row_numel))
        return grads

    @torch.no_grad()
    def _finish(self, bucket: Bucket, *, into_pending: bool = False) -> None:
        output = bucket.work.wait()  # stage 0: the whole bucket; 1/2: this rank's segment
        if self.stage == 0 and bucket.masters is not None:
            self._accept_shards(bucket, output)  # a "shard" of a group of one: the whole gradient
        elif self.stage == 0:
            for slot, flat in zip(bucket.slots, output.split([slot.numel for slot in bucket.slots])):
                slot.take_reduced_grad(flat)
        elif into_pending:
            # One microbatch's shards, summed in the masters' dtype (fp32 accumulation of bf16 reductions).
            master_dtype = bucket.slots[0].master.dtype
            if bucket.pending is None:
                own = output.dtype == master_dtype and _owns_storage(output)  # else a cast, or a row of a larger buffer
                bucket.pending = output if own else output.to(master_dtype, copy=True)
            else:
                bucket.pending.add_(output)
        else:
            self._accept_shards(bucket, output)
        bucket.work = bucket.buffer = None
        bucket.ready = 0
        bucket.launched = False

    def _accept_shards(self, bucket: Bucket, output: Tensor) -> None:
        """Add the reduced segment ``output`` of ``bucket`` to its masters' gradients (views into one flat
        gradient: one cast or add per bucket) and show them in ``.grad``."""
        slots = bucket.slots
        master_dtype, dtype = slots[0].master.dtype, slots[0].local.dtype
        previous = [slot.master.grad for slot in slots]
        flat = bucket.grads() if bucket.grads is not None else None
        if flat is not None and all(g is not None and _same_storage(g, flat) for g in previous):
            flat.add_(output)  # accumulation: the earlier syncs of this step are in the masters' gradients
            shown = flat
        else:
            flat = output if output.dtype == master_dtype and _owns_storage(output) else output.to(master_dtype, copy=True)
            bucket.grads = weakref.ref(flat)
            shown = output if all(g is None for g in previous) else flat
        for slot, grad in zip(slots, previous):
            view = flat[slot.offset : slot.offset + slot.shard_numel].view(slot.master_shape)
            if grad is not None and not _same_storage(grad, flat):
                view.add_(grad)  # (rare) a gradient the master held from elsewhere
            slot.master.grad = view
        if master_dtype != dtype:
            # fp32 masters of bf16 weights: show the reduced bf16 segment. gloo's in-place all-reduce: the shards shown
            # in `.grad` (kept until the next backward) must not keep the whole bucket alive, only this rank's segment.
            shown = shown if shown.dtype == dtype else flat.to(dtype)
            shown = shown if _owns_storage(shown) else shown.clone()
        for slot in slots:
            grad = slot.master.grad if master_dtype == dtype else shown[slot.offset : slot.offset + slot.shard_numel]
            self._expose(slot, grad.view(slot.master_shape))

    # ------------------------------------------------------------------ gradients users read
    def _expose(self, slot: ParamSlot, grad: Tensor) -> None:
        slot.expose_grad(grad, self._mesh_of)

    def _before_accumulate(self, slot: ParamSlot, grad: Tensor) -> None:
        slot.clear_exposed_grad(forget=False)

    def before_backward(self) -> None:
        """Drop every gradient shown since the last synchronisation, before a backward starts.

        DDP's ``.grad`` lives until ``zero_grad``, which Lightning calls right before backward;
        ``torch.optim`` has no hook on ``zero_grad``, so the shown shards go here (the optimizer's
        own gradients, the masters', still follow ``zero_grad`` and accumulate as usual).
        """
        for slot in self.slots:
            slot.clear_exposed_grad()

    # ------------------------------------------------------------------ introspection
    def slot_of(self, param: Tensor) -> Optional[ParamSlot]:
        return self._slot_of.get(param)

    def slot_for_optimizer_param(self, tensor: Tensor) -> Optional[ParamSlot]:
        slot = self._slot_of_optimizer_param.get(id(tensor))
        return slot if slot is not None and slot.optimizer_param is tensor else None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _owns_storage(t: Tensor) -> bool:
    """Whether ``t`` is all of its storage (not a row of a larger buffer that it would keep alive)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


__all__ = ["ParamSlot", "ZeroDataParallel"]
