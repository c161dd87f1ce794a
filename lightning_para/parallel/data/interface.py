"""``DataParallel``: what the rest of lightning-para may ask of data parallelism.

One interface, returned by :func:`~lightning_para.parallel.data.apply_data_parallel`, with
three implementations (:mod:`.apply`; :class:`NoDataParallel` stands in until it is applied): ZeRO 0-2 (the :class:`~.zero.ZeroDataParallel` engine),
ZeRO-3 / HSDP on FSDP2 (:mod:`.fsdp`), and the user's own ``fully_shard`` from
``configure_model`` (kept as it is). The strategy, the pipeline runner, ``checkpoint/``,
``observe/`` and ``ParaPrecision`` talk to this interface only; which engine runs, how
gradient accumulation communicates (``zero_accumulation``) and on how many ranks a gradient is
replicated (for clipping) are decided behind it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data.grad_norm import GradReplication, count_grad_replication
from lightning_para.parallel.data.layout import ParamSlot
from lightning_para.parallel.data.memory import MemoryBreakdown, memory_breakdown
from lightning_para.parallel.data.zero import ZeroDataParallel


class DataParallel(ABC):
    """Data parallelism of one parallelized model: gradient sync, accumulation, optimizers, state.

    Attributes:
        dims: the degrees and mesh.
        stage: the ZeRO stage (0-3) this run asked for.
        psi_dense, psi_expert: parameters this rank holds before data parallelism shards them
            (dense / MoE experts): the ZeRO formulas' psi.
        fully_sharded: parameters are FSDP2 shards (ZeRO-3, HSDP, or the user's ``fully_shard``).
        grad_replication: on how many ranks each optimizer parameter's gradient is identical;
            filled by :meth:`attach_optimizer`, read by gradient clipping.
    """

    fully_sharded: bool = False
    # ZeRO-2 with ``zero_accumulation="reduce_each_microbatch"``: the pipeline runner holds
    # :meth:`each_microbatch` over its schedule and calls :meth:`reduce_part` after each stage's backward.
    reduces_each_microbatch: bool = False

    def __init__(self, dims: ParallelDims, *, stage: int, psi_dense: int = 0, psi_expert: int = 0) -> None:
        self.dims, self.stage = dims, stage
        # psi of the ZeRO formulas: what this rank holds before data parallelism shards it.
        self.psi_dense, self.psi_expert = psi_dense, psi_expert
        self.grad_replication = GradReplication()

    # ------------------------------------------------------------------ gradient sync
    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside communicate no gradients; they accumulate locally until a synced
        backward or :meth:`sync_now` (the pipeline runner holds this over its schedule)."""

    @abstractmethod
    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Around each of the first ``A - 1`` micro-steps of gradient accumulation: this run's
        accumulation policy (``zero_accumulation``): communicate nothing (``"no_sync"``), or keep
        reducing each micro-step (``"reduce_each_step"`` under ZeRO-2/3: gradients stay sharded)."""

    @property
    def sync_enabled(self) -> bool:
        """Whether a backward now would synchronise gradients (``False`` inside :meth:`no_sync`)."""
        return True

    def sync_now(self) -> None:
        """Synchronise the gradients accumulated so far (after a backward run under :meth:`no_sync`)."""

    def each_microbatch(self) -> contextlib.AbstractContextManager[None]:
        """Around a pipeline schedule when :attr:`reduces_each_microbatch`: gradients are reduced per
        microbatch and stage (:meth:`reduce_part`) and summed aside until :meth:`commit_microbatches`."""
        raise NotImplementedError(f"{type(self).__name__} reduces once per step, not per microbatch.")

    def reduce_part(self, part: int) -> None:
        """One microbatch's backward of this rank's pipeline stage ``part`` is done: reduce its gradients."""
        raise NotImplementedError(f"{type(self).__name__} reduces once per step, not per microbatch.")

    def commit_microbatches(self) -> None:
        """After :meth:`each_microbatch` and Lightning's ``zero_grad``: the summed shards become ``.grad``."""
        raise NotImplementedError(f"{type(self).__name__} reduces once per step, not per microbatch.")

    def pending_gradients(self) -> list[Tensor]:
        """Gradients reduced per microbatch and summed aside, not yet in ``.grad`` (:meth:`each_microbatch`)."""
        return []

    def flush(self) -> None:
        """Finish any gradient communication still pending, so ``.grad`` holds this step's synced
        gradients (before unscaling, the inf check and clipping). Idempotent within a step."""

    def before_backward(self) -> None:
        """A backward is about to start (Lightning called ``zero_grad`` just before, if at all): drop
        gradients that were only shown in ``.grad`` for users to read since the last sync (ZeRO-1/2's
        shards stay readable after the optimizer step, as DDP's ``.grad`` until ``zero_grad``)."""

    # ------------------------------------------------------------------ optimizers
    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *, is_expert: Callable[[Tensor], bool]) -> None:
        """Take over ``optimizer`` (ZeRO-1/2: it steps this rank's shards) and count on how many ranks
        each of its parameters' gradient is identical into :attr:`grad_replication`."""
        self._shard_optimizer(optimizer)
        for group in optimizer.param_groups:
            for q in group["params"]:
                self.grad_replication.set(q, count_grad_replication(q, self.dims, self._engine, is_expert))

    def _shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """ZeRO-1/2 hand each optimizer its shards; FSDP2's optimizers already step DTensor shards."""

    @property
    def _engine(self) -> Optional[ZeroDataParallel]:
        return None

    def optimizer_slots(self) -> Sequence[ParamSlot]:
        """The shards an optimizer steps instead of whole parameters (ZeRO-1/2 masters, fp32 copies):
        what ``checkpoint/`` needs to name and describe optimizer state globally. Empty otherwise."""
        return ()

    def parameter_name(self, optimizer_tensor: Tensor) -> Optional[str]:
        """The model parameter's name for an optimizer tensor that stands in for it (a ZeRO master)."""
        return None

    def masters_of(self, param_ids: set[int]) -> set[int]:
        """``id``\\ s of the optimizer tensors that stand in for the parameters with these ``id``\\ s."""
        return set()

    def step_without_communication(self) -> contextlib.AbstractContextManager[None]:
        """An optimizer step that neither syncs gradients nor gathers parameters (to create optimizer
        state before a checkpoint is loaded into it)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ state
    def gather_params(self) -> None:
        """Write the optimizer's (sharded) weights back into the model's parameters (after loading them)."""

    def reset_masters_from_params(self) -> None:
        """Separate optimizer weights take the model's current weights (a checkpoint loaded without optimizers)."""

    def reshard(self, module: nn.Module) -> None:
        """Parameters back to the sharded ones the optimizer and checkpoints name (FSDP2 units a
        forward-only pass left gathered); local, at step boundaries only."""

    def forward_through_root(self, module: nn.Module) -> bool:
        """Whether Lightning's steps must run through ``module.__call__`` (an FSDP2 root's hooks)."""
        return False

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        param_bytes: int,
        master_dtype: Optional[torch.dtype],
        is_expert: Callable[[Tensor], bool],
    ) -> MemoryBreakdown:
        """This rank's bytes for parameters, gradients and optimizer state against the ZeRO formulas
        (``master_dtype``: the precision's separate optimizer weights, which ZeRO 0-2 keep)."""
        dims = self.dims
        separate_master = master_dtype is not None and not self.fully_sharded
        return memory_breakdown(
            module, optimizers, stage=self.stage, dp=dims.zero_shards, edp=dims.expert_zero_shards,
            dp_replicate=dims.dp_replicate, cp=dims.cp, psi_dense=self.psi_dense, psi_expert=self.psi_expert,
            param_bytes=param_bytes, master_bytes=4 if separate_master else 0, is_expert=is_expert,
        )


class NoDataParallel(DataParallel):
    """One replica, nothing to synchronise: what a parallel model holds until data parallelism is applied."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


__all__ = ["DataParallel", "NoDataParallel"]
