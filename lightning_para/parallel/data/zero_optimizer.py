"""ZeRO-1/2's optimizer side: point the user's optimizer at this rank's shards and gather the
parameters after its step (the gradient side is :mod:`lightning_para.parallel.data.zero`).

* After the optimizer step the updated shards of all buckets that share a group and dtype
  are all-gathered in **one** collective (not one per bucket; on gloo one broadcast per rank), in place:
  each rank writes its shards into its own row of the output.
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
  bytes/param of the ZeRO paper, sharded with the stage, as views into one flat tensor per bucket
  (the optimizer still steps one tensor per parameter, on its own foreach/fused path).
* Nothing on the step path runs once per parameter: gradients are packed into a bucket by one
  ``torch._chunk_cat``, the masters' gradients are one cast per bucket, the masters are copied into
  the all-gather's input by one ``torch._foreach_copy_`` and out of its output by one
  ``torch.split_with_sizes_copy`` (FSDP2's copy-in and copy-out); ``docs/performance.md`` counts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_para.parallel.data.layout import (
    Bucket,
    ParamSlot,
    all_gather_rows,
    rows_of,
    unpack_rank_major,
)


class OptimizerSharding:
    """The optimizer half of :class:`~lightning_para.parallel.data.zero.ZeroDataParallel` (its base class):
    it reads the engine's slots and buckets, built by the engine's ``__init__``."""

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
        self._describe_whole_matrices(optimizer, [s for i in sorted(own) for s in self.buckets[i].slots])
        # No step *pre*-hook: torch runs pre-hooks before calling the closure (i.e. before
        # backward), so a flush there would synchronise stale gradients. Whoever reads the
        # gradients calls `flush()` after backward (ParaPrecision does, before clipping).
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_step(opt))
        self._hook_zero_grad(optimizer)

    def _describe_whole_matrices(self, optimizer: torch.optim.Optimizer, slots: Sequence[ParamSlot]) -> None:
        """An optimizer that routes shards to whole matrices (``set_shard_view``, ``lightning_para.optim.Muon``)
        learns what each master is a piece of; another one that needs whole matrices is refused under ZeRO-1/2,
        whose row shards would silently make it a different optimizer."""
        pieces = [s for s in slots if s.master is not None and s.param.dim() >= 2
                  and (s.sharded or isinstance(s.param, DTensor))]
        set_view = getattr(optimizer, "set_shard_view", None)
        if set_view is None:
            if any(s.sharded for s in pieces) and _needs_whole_matrices(optimizer):
                raise ValueError(
                    f"`ParaStrategy(zero={self.stage})` hands the optimizer row shards of each matrix, and"
                    f" {type(optimizer).__name__} needs whole matrices (it would see row blocks: a different"
                    " optimizer). Use `lightning_para.optim.Muon`, or `zero=0` or `zero=3`.")
            return
        for slot in pieces:
            if slot.sharded and not slot.describable:
                raise ValueError(
                    f"`ParaStrategy(zero={self.stage})` with {type(optimizer).__name__}: {slot.name} is a fused"
                    " (strided) tensor-parallel shard that ZeRO-1/2 split by rows, which no placement describes."
                    " Use `zero=0` or `zero=3` with this model.")
            mesh_of = self._mesh_of or (lambda *names, s=slot: s.mesh)
            set_view(slot.master, slot.shard_as_dtensor(slot.master, mesh_of) if slot.sharded else DTensor.from_local(
                slot.master.view(slot.local.shape), slot.param.device_mesh, slot.param.placements, run_check=False,
                shape=slot.param.shape, stride=slot.param.stride()))

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

        Stage 0: one fused copy (and cast) of every separate master into its parameter. Stages 1-2: one
        all-gather per (group, dtype), over all the buckets given laid end to end (a bucket's segments are
        contiguous in each rank's part, so the unpacking is the same), with one fused copy in and one out.
        """
        buckets = self.buckets if buckets is None else buckets
        if self.stage == 0:
            slots = [slot for bucket in buckets if bucket.masters is not None for slot in bucket.slots]
            if slots:
                torch._foreach_copy_([slot.local for slot in slots], [slot.master for slot in slots])
            return
        pending = []
        for group_buckets in _coalescable(buckets):
            first = group_buckets[0].slots[0]
            world = group_buckets[0].world
            # Padding after each shard is never read back (unpacking reads only real rows): `empty`.
            out = torch.empty(world, sum(b.segment_numel for b in group_buckets), dtype=group_buckets[0].dtype,
                              device=first.local.device)
            torch._foreach_copy_(*_copy_in(out[first.rank], group_buckets))
            works = all_gather_rows(out, first.rank, first.group) if world > 1 else []
            pending.append((group_buckets, out, works))
        for group_buckets, out, works in pending:
            for work in works:
                work.wait()
            unpack_rank_major(out, [rows_of(slot.local, slot) for bucket in group_buckets for slot in bucket.slots])

    @torch.no_grad()
    def reset_masters_from_params(self) -> None:
        """Separate masters (ZeRO-1/2 shards, fp32 copies) take the model's current weights (after loading them)."""
        for slot in self.slots:
            if slot.master is not None:
                slot.load_master(slot.local)



def _copy_in(send: Tensor, buckets: Sequence[Bucket]) -> tuple[list[Tensor], list[Tensor]]:
    """``(destinations in send, masters)``: a bucket's flat masters whole, else each slot's rows."""
    dest, src, base = [], [], 0
    for bucket in buckets:
        if bucket.masters is not None:
            dest.append(send[base : base + bucket.segment_numel])
            src.append(bucket.masters)
        else:
            for slot in bucket.slots:
                dest.append(send[base + slot.offset : base + slot.offset + slot.shard_numel])
                src.append(slot.master.view(-1))
        base += bucket.segment_numel
    return dest, src


def _needs_whole_matrices(optimizer: torch.optim.Optimizer) -> bool:
    """Optimizers whose update of a matrix depends on the whole matrix (orthogonalized or factored)."""
    name = type(optimizer).__name__.lower()
    return isinstance(optimizer, (torch.optim.Muon, torch.optim.Adafactor)) or any(
        k in name for k in ("muon", "shampoo", "soap", "adafactor"))


def _coalescable(buckets: Sequence[Bucket]) -> list[list[Bucket]]:
    """``buckets`` grouped by (process group, dtype, device), each group in bucket order: one
    all-gather each. Every rank builds the same buckets, so the groups and their order agree."""
    groups: dict[tuple, list[Bucket]] = {}
    for bucket in buckets:
        slot = bucket.slots[0]
        groups.setdefault((id(slot.group), bucket.dtype, slot.local.device), []).append(bucket)
    return list(groups.values())


__all__ = ["OptimizerSharding"]
