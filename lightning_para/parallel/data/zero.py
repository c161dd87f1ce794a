"""Data parallelism with ZeRO stages 0, 1 and 2 for any elementwise optimizer.

=====  =====================================================  ===========================
stage  what each of the N data-parallel ranks holds (Adam)    traffic per optimizer step
=====  =====================================================  ===========================
0      params, grads, optimizer state: 16 B/param (bf16+fp32)  all-reduce grads: 2 psi
1      optimizer state and fp32 master 1/N: 4 + 12/N          reduce-scatter + all-gather: 2 psi
2      gradients 1/N as well: 2 + 14/N                        reduce-scatter + all-gather: 2 psi
=====  =====================================================  ===========================

(ZeRO paper, Rajbhandari et al. 2020, Fig. 1 and Sec. 7; stage 3 is FSDP2, see ``fsdp.py``.)

Why this module is long: one engine owns the whole gradient/parameter round trip of a step
(hooks, buckets, launch, wait, optimizer sharding, the gather after the step) because each
part depends on the order and state the others leave; the layout arithmetic is in ``layout.py``.

Hybrid sharding (``replicate_mesh``, issue 16): ZeRO-1/2 state is sharded over each parameter's
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
* gloo has no reduce-scatter: torch's gloo ``reduce_scatter_tensor`` clones the input,
  all-reduces all of it and copies this rank's chunk out. On a gloo group the bucket is
  all-reduced *in place* instead (the same bytes on the wire, without the clone and the copy)
  and this rank's segment of it is the shard (:func:`~.layout.reduce_scatter_is_all_reduce`).
  NCCL and every other backend take the real reduce-scatter.
* After the optimizer step the updated shards of all buckets that share a group and dtype
  are all-gathered in **one** collective (not one per bucket).
* Sharding is by rows (dim 0) and follows ``torch.chunk``, the same layout FSDP2 uses, so a
  shard is a contiguous slice of the flat parameter and the optimizer state of ZeRO-1/2 can
  be saved as a DTensor that any other layout (ZeRO-0, ZeRO-3, another dp) loads.
* The user's optimizer is kept and edited in place: each param group's ``params`` are
  replaced by this rank's shards ("masters"), so LR schedulers, per-group hyperparameters
  and ``optimizer.state_dict()`` stay the user's. A step post-hook all-gathers the updated
  parameters. Gradients are complete after backward (an end-of-backward callback), and
  :meth:`ZeroDataParallel.flush` completes them if a rank's backward touched no parameter.
* With fp32 parameters a master is a *view* of the model parameter's rows (no copy).
  With bf16 parameters (``precision="bf16-true"``) masters are fp32 copies: the 4 extra
  bytes/param of the ZeRO paper, sharded with the stage.
* Gradient accumulation: inside :meth:`ZeroDataParallel.no_sync` the hooks do nothing, so
  gradients accumulate locally and the last micro-step communicates once.
* One reduction per pipeline microbatch (``zero_accumulation="reduce_each_microbatch"``, stage 2):
  under a pipeline, no sync means every stage's whole gradients exist until the schedule ends.
  Inside :meth:`ZeroDataParallel.reduce_each_microbatch` a bucket never spans two of the rank's
  stages (``part_of``); a stage's buckets launch as its backward of one microbatch fills them, the
  runner calls :meth:`ZeroDataParallel.reduce_part` after that backward (zeros where a gradient is
  missing: every rank issues the same collectives), and the shards add up in ``Bucket.pending``, in
  the masters' dtype. The rank then holds one stage's whole gradients at most, plus its fp32 shards
  (the Llama 3 paper, Sec. 3.3.2: FSDP shards the gradients under pipelining, FP32 accumulation),
  for ``m`` times the gradient traffic. :meth:`ZeroDataParallel.commit_pending` hands the sum to the
  masters once Lightning's ``zero_grad`` has run.
* Gradients users can read: once synchronised, each model parameter's ``.grad`` shows what
  the optimizer will read (:meth:`ZeroDataParallel._expose`). Stage 0: the averaged gradient
  itself. Stages 1/2: a DTensor, ``Shard(0)`` over dp, whose local tensor *is* the master's
  gradient shard (no copy), so ``torch.nn.utils.clip_grad_norm_`` or an in-place edit of
  ``p.grad`` reaches the optimizer. It stays readable after the optimizer step (in
  ``on_train_batch_end``, as DDP keeps ``.grad`` until ``zero_grad``) and is dropped when the
  next backward starts (:meth:`ZeroDataParallel.before_backward`, and a tensor hook before
  accumulation), so autograd never adds into it.
  ``docs/data_parallel.md`` says what users may do with it per stage.

Why this module is long: it is one engine whose backward hooks, bucket launches and
optimizer hooks share the bucket state; the shard and bucket layout itself is in ``layout.py``.
"""

from __future__ import annotations

import contextlib
import functools
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
    FIRST_BUCKET_BYTES,
    all_gather_single,
    pack_rank_major,
    reduce_scatter_is_all_reduce,
    reduce_scatter_single,
    unpack_rank_major,
)


class ZeroDataParallel:
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
        # Every stage overlaps its reduction with backward (issue 17). Stage 1 used to wait for the
        # end of backward; launching early frees each bucket's full gradients sooner, nothing else.
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
            slot = ParamSlot(name=name, param=param, mesh=mesh, sharded=stage > 0 and not alone,
                             part=part_of(param) if part_of is not None else None)
            slot.master = self._make_master(slot, master_dtype)
            if alone and slot.master is None:
                self._untouched.add(id(param))
                continue
            self.slots.append(slot)
            self._slot_of[param] = slot
        self._slot_of_optimizer_param = {id(s.optimizer_param): s for s in self.slots}
        self.buckets = self._build_buckets(int(bucket_size_mb * 1024 * 1024))
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
            # Before accumulation: drop the gradient shown to users, so autograd starts afresh.
            slot.param.register_hook(partial(self._before_accumulate, slot))
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _make_master(slot: ParamSlot, master_dtype: Optional[torch.dtype]) -> Optional[nn.Parameter]:
        local = slot.local
        if master_dtype is None:
            if not slot.sharded:
                return None  # the optimizer steps the model parameter itself
            # A view of the model parameter's own rows: the optimizer updates them in place.
            return nn.Parameter(slot.local_rows(local.detach()), requires_grad=True)
        source = slot.local_rows(local.detach()) if slot.sharded else local.detach()
        return nn.Parameter(source.to(master_dtype).clone().view(source.shape), requires_grad=True)

    def _build_buckets(self, capacity_bytes: int) -> list[Bucket]:
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
        for slot in reversed(self.slots):  # backward produces gradients roughly in reverse order
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

    # ------------------------------------------------------------------ accumulation
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication: gradients accumulate locally until a synced backward."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    @contextlib.contextmanager
    def reduce_each_microbatch(self) -> Iterator[None]:
        """Around a pipeline schedule: reduce each stage's gradients after each of its microbatch
        backwards (:meth:`reduce_part`) into ``Bucket.pending``; :meth:`commit_pending` afterwards."""
        if self.stage == 0:
            raise ValueError("One reduction per microbatch keeps gradients sharded: it needs ZeRO stage 2, not 0.")
        previous, self._each_microbatch = self._each_microbatch, True
        self._discard_pending()  # nothing of an earlier schedule that failed before its commit
        try:
            yield
            self._settle(block=True)
        except BaseException:
            # A failed schedule: its partial sums are no step's gradients, and waiting for collectives that other
            # ranks may never issue would turn the error into a hang.
            self._discard_pending()
            raise
        finally:
            self._each_microbatch = previous

    def _discard_pending(self) -> None:
        # Buffers of collectives still on the wire stay referenced (a backend may still write into them).
        self._abandoned = [(b.work, b.buffer, b.output) for b in self._in_flight if b.work is not None]
        self._in_flight = []
        for bucket in self.buckets:
            bucket.pending = bucket.work = bucket.buffer = bucket.output = None
            bucket.ready, bucket.launched = 0, False

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

    def reduce_part(self, part: int) -> None:
        """End one microbatch's backward of this rank's stage ``part`` (inside :meth:`reduce_each_microbatch`):
        reduce what its buckets hold and add the shards to ``Bucket.pending``; its whole gradients are freed."""
        if not self._each_microbatch:
            raise RuntimeError("reduce_part() runs inside reduce_each_microbatch() only.")
        # The previous microbatch's buckets first (long done by now): a split backward's weight half
        # (zero-bubble schedules) writes `.grad` itself, so no gradient hook settled them.
        self._settle(block=True)
        buckets = self._buckets_of_part.get(part, ())
        for bucket in buckets:
            if not bucket.launched:
                self._launch(bucket)
        # Not waited for here: the last buckets' collectives overlap what the rank runs next. Those already
        # done are added now, so only the few still on the wire keep their whole-gradient buffers.
        self._in_flight.extend(buckets)
        self._settle(block=False)

    def _settle(self, *, block: bool) -> None:
        """Add in-flight buckets to ``Bucket.pending`` in launch order: all of them (``block``), or while
        their collective is done (hybrid sharding's second collective waits for the first: only ``block``)."""
        while self._in_flight:
            bucket = self._in_flight[0]
            if not block and (self.replicate_group is not None or (bucket.work is not None and not bucket.work.is_completed())):
                return
            self._in_flight.pop(0)
            if self.replicate_group is not None:
                self._reduce_over_replicas(bucket)
            self._finish(bucket, into_pending=True)

    def commit_pending(self) -> None:
        """After a schedule under :meth:`reduce_each_microbatch` (and after Lightning's ``zero_grad``): reduce
        the gradients of parameters outside any one stage, then add every bucket's summed shards to its
        masters' gradients and show them in ``.grad``, as :meth:`sync_now` does."""
        self._settle(block=True)
        self._sync([b for b in self.buckets if b.part is None], into_pending=True)
        for bucket in self.buckets:
            if bucket.pending is not None:
                self._accept_shards(bucket, bucket.pending)
                bucket.pending = None
        self._synced_since_step = True

    def _reduce_over_replicas(self, bucket: Bucket) -> None:
        """Hybrid sharding: once the shard group's reduce-scatter is done, all-reduce the shard across replicas."""
        if bucket.work is not None:
            bucket.work.wait()
        bucket.work = dist.all_reduce(bucket.output, group=self.replicate_group, async_op=True)

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
        world = bucket.world
        if self.stage == 0:
            buffer = torch.empty(bucket.segment_numel, dtype=bucket.dtype, device=bucket.slots[0].local.device)
            for slot in bucket.slots:
                dest = buffer[slot.offset : slot.offset + slot.numel]
                grad = slot.accumulated_grad()  # not a gradient shown after an earlier sync
                dest.copy_(local_tensor(grad).reshape(-1)) if grad is not None else dest.zero_()
            if world > 1:  # a group of one rank: its gradient is already the average
                buffer.div_(world)  # average before summing: keeps fp16/bf16 sums in range
                bucket.work = dist.all_reduce(buffer, group=bucket.slots[0].group, async_op=True)
            bucket.buffer = buffer
        else:
            device = bucket.slots[0].local.device
            buffer = torch.empty(world, bucket.segment_numel, dtype=bucket.dtype, device=device)
            for slot in bucket.slots:
                grad = slot.accumulated_grad()  # not a shard shown after an earlier sync
                # During a pipeline schedule (one reduction per microbatch) the shown shard is set aside, not gone.
                slot.clear_exposed_grad(forget=not self._each_microbatch)
                if grad is None:
                    buffer[:, slot.offset : slot.offset + slot.segment_numel].zero_()
                else:
                    pack_rank_major(local_tensor(grad).reshape(-1), slot.segment_numel, world, buffer, slot.offset)
                    # The full gradient is now in the bucket; free it (ZeRO-2 never holds all of them).
                    slot.param.grad = None
            if world * self.replicas > 1:  # one rank alone needs no collective: its gradient is the mean
                buffer.div_(world * self.replicas)  # the mean over every data-parallel rank, replicas included
            group = bucket.slots[0].group
            if world > 1 and reduce_scatter_is_all_reduce(group, device):
                # gloo: all-reduce the bucket in place (what its reduce-scatter does, minus a clone and a copy).
                bucket.work = dist.all_reduce(buffer, group=group, async_op=True)
                output = buffer[bucket.slots[0].rank]
            elif world > 1:
                output = torch.empty(bucket.segment_numel, dtype=bucket.dtype, device=device)
                bucket.work = reduce_scatter_single(output, buffer.view(-1), group=group, async_op=True)
            else:  # a shard group of one rank holds the whole "shard": no reduce-scatter
                output = buffer[0]
            bucket.buffer, bucket.output = buffer, output
        bucket.launched = True

    @torch.no_grad()
    def _finish(self, bucket: Bucket, *, into_pending: bool = False) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        if self.stage == 0:
            for slot in bucket.slots:
                reduced = bucket.buffer[slot.offset : slot.offset + slot.numel]
                if slot.master is not None:
                    _accumulate_grad(slot.master, reduced.view(slot.master.shape))
                    # Users still read the averaged gradient in the parameter's dtype (the optimizer reads the master's).
                    self._expose(slot, reduced.view(slot.local.shape))
                else:
                    if slot.param.grad is None:
                        slot.param.grad = torch.zeros_like(slot.param)
                    local_tensor(slot.param.grad).view(-1).copy_(reduced)
        elif into_pending:
            # One microbatch's shards, summed in the masters' dtype (fp32 accumulation of bf16 reductions);
            # a copy, so the bucket's buffer (all ranks' segments under gloo) is freed now.
            master_dtype = bucket.slots[0].master.dtype
            if bucket.pending is None:
                bucket.pending = bucket.output.to(master_dtype, copy=True)
            else:
                bucket.pending.add_(bucket.output.to(master_dtype))
        else:
            self._accept_shards(bucket, bucket.output)
        bucket.work = bucket.buffer = bucket.output = None
        bucket.ready = 0
        bucket.launched = False

    def _accept_shards(self, bucket: Bucket, output: Tensor) -> None:
        """Stages 1/2: add the reduced segment ``output`` of ``bucket`` to its masters' gradients and show them."""
        if any(s.master.dtype != s.local.dtype for s in bucket.slots) and (
            output.untyped_storage().nbytes() > output.numel() * output.element_size()
        ):
            # gloo's in-place all-reduce: the bf16 shards shown in `.grad` (kept until the next
            # backward) must not keep the whole bucket alive, only this rank's segment.
            output = output.clone()
        for slot in bucket.slots:
            shard = output[slot.offset : slot.offset + slot.shard_numel].view(slot.shard_shape)
            fresh = slot.master.grad is None
            _accumulate_grad(slot.master, shard)
            grad = slot.master.grad
            if grad.dtype != slot.local.dtype:  # fp32 masters of bf16 weights: show the reduced bf16 shard
                grad = (shard if fresh else grad).to(slot.local.dtype)
            self._expose(slot, grad)

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

    # ------------------------------------------------------------------ optimizer side
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at this rank's masters and hook the gather after each step."""
        if optimizer in self._buckets_of_optimizer:
            return
        if any(optimizer.state.values()):
            raise ValueError(
                "The optimizer already has state (was it stepped before `trainer.fit`?). ZeRO shards the optimizer"
                " when the strategy sets it up; create it in `configure_optimizers` without stepping it."
            )
        own: set[int] = set()
        for group in optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                slot = self._slot_of.get(p)
                if slot is None:
                    known = id(p) in self._untouched or any(p is s.optimizer_param for s in self.slots)
                    if p.requires_grad and not known:
                        raise ValueError(
                            "An optimizer parameter is not a parameter of the LightningModule; ZeRO can only shard"
                            " parameters of the model it set up. Build the optimizer from `self.parameters()`."
                        )
                    new_params.append(p)
                    continue
                new_params.append(slot.optimizer_param)
                own.add(slot.bucket)
            group["params"] = new_params
        self._buckets_of_optimizer[optimizer] = sorted(own)
        # No step *pre*-hook: torch runs pre-hooks before calling the closure (i.e. before
        # backward), so a flush there would synchronise stale gradients. Whoever reads the
        # gradients calls `flush()` after backward (ParaPrecision does, before clipping).
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_step(opt))
        self._hook_zero_grad(optimizer)

    def _hook_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.zero_grad()`` also drop the gradients shown in the model's ``p.grad``.

        The optimizer's parameters are the masters, so its own ``zero_grad`` never reaches the
        model's ``.grad``; DDP's ``.grad`` is gone after ``zero_grad(set_to_none=True)`` (manual
        optimization checks this). ``torch.optim`` has no ``zero_grad`` hook, and Lightning's
        ``LightningOptimizer`` finds ``zero_grad`` on its class (one made from the optimizer's
        class), not on the instance, so the optimizer gets a subclass of its own class that adds
        the drop (``isinstance`` checks still hold). The strategy builds its LightningOptimizers
        after this. With ``set_to_none=False`` the masters' gradients are zeroed in place and the
        shown views read zeros, as DDP's do.
        """
        slots = [slot for index in self._buckets_of_optimizer[optimizer] for slot in self.buckets[index].slots]
        users_class = type(optimizer)

        def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            users_class.zero_grad(opt, set_to_none)
            if set_to_none:
                for slot in slots:
                    slot.clear_exposed_grad()

        optimizer.__class__ = type(users_class.__name__, (users_class,),
                                   {"zero_grad": zero_grad, "__module__": users_class.__module__,
                                    "__doc__": users_class.__doc__})

    def after_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Write the stepped masters back into the model (all-gather for ZeRO-1/2)."""
        self._synced_since_step = False
        if self._suppress_gather:
            return
        buckets = self.buckets
        if optimizer is not None and optimizer in self._buckets_of_optimizer:
            buckets = [self.buckets[i] for i in self._buckets_of_optimizer[optimizer]]
        # The gradients shown to users stay until the next backward (DDP keeps `.grad` until zero_grad).
        self.gather_params(buckets)

    @torch.no_grad()
    def gather_params(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        """Write the updated shards back into every rank's full parameters.

        Stages 1-2: one all-gather per (group, dtype), over all the buckets given laid end to end:
        a bucket's segments are contiguous in each rank's part, so the unpacking is the same.
        """
        buckets = self.buckets if buckets is None else buckets
        if self.stage == 0:
            for bucket in buckets:
                for slot in bucket.slots:
                    if slot.master is not None:
                        slot.local.copy_(slot.master.view(slot.local.shape))
            return
        pending = []
        for group_buckets in _coalescable(buckets):
            first = group_buckets[0]
            device, world = first.slots[0].local.device, first.world
            total = sum(b.segment_numel for b in group_buckets)
            # Padding after each shard is never read back (unpacking reads only real rows): `empty`.
            send = torch.empty(total, dtype=first.dtype, device=device)
            base = 0
            for bucket in group_buckets:
                for slot in bucket.slots:
                    start = base + slot.offset
                    send[start : start + slot.shard_numel].copy_(slot.master.reshape(-1))
                base += bucket.segment_numel
            if world == 1:
                pending.append((group_buckets, send.view(1, -1), None))
                continue
            out = torch.empty(world, total, dtype=first.dtype, device=device)
            work = all_gather_single(out.view(-1), send, group=first.slots[0].group, async_op=True)
            pending.append((group_buckets, out, work))
        for group_buckets, out, work in pending:
            if work is not None:
                work.wait()
            base = 0
            for bucket in group_buckets:
                for slot in bucket.slots:
                    unpack_rank_major(out, slot.segment_numel, base + slot.offset, slot.local.view(-1))
                base += bucket.segment_numel

    # ------------------------------------------------------------------ introspection
    def slot_of(self, param: Tensor) -> Optional[ParamSlot]:
        return self._slot_of.get(param)

    def slot_for_optimizer_param(self, tensor: Tensor) -> Optional[ParamSlot]:
        slot = self._slot_of_optimizer_param.get(id(tensor))
        return slot if slot is not None and slot.optimizer_param is tensor else None

    @torch.no_grad()
    def reset_masters_from_params(self) -> None:
        """Separate masters (ZeRO-1/2 shards, fp32 copies) take the model's current weights (after loading them)."""
        for slot in self.slots:
            if slot.master is not None:
                slot.load_master(slot.local)


def _coalescable(buckets: Sequence[Bucket]) -> list[list[Bucket]]:
    """``buckets`` grouped by (process group, dtype, device), each group in bucket order: one
    all-gather each. Every rank builds the same buckets, so the groups and their order agree."""
    groups: dict[tuple, list[Bucket]] = {}
    for bucket in buckets:
        slot = bucket.slots[0]
        groups.setdefault((id(slot.group), bucket.dtype, slot.local.device), []).append(bucket)
    return list(groups.values())


def _accumulate_grad(param: Tensor, grad: Tensor) -> None:
    """``param.grad += grad``; ``grad`` is a view into a bucket buffer, so copy on first use."""
    if param.grad is None:
        param.grad = grad.to(param.dtype, copy=True)
    else:
        param.grad.add_(grad.to(param.dtype))


__all__ = ["ParamSlot", "ZeroDataParallel"]
