"""``apply_data_parallel``: the one entry point of data parallelism, and its implementations.

* :class:`ZeroData` -- ZeRO 0-2 on the :class:`~.zero.ZeroDataParallel` engine (bucketed
  reduce-scatter / all-reduce of gradients, fp32 master shards, all-gather after the step).
* :class:`FullyShardedData` -- ZeRO-3 (and HSDP on a 2-D mesh) on FSDP2 (:func:`~.fsdp.apply_fully_shard`).
* :class:`UserFullyShardedData` -- the user's own ``fully_shard`` from ``configure_model``: nothing
  is applied, accumulation skips its reduce-scatters and leaves its reshard settings alone.

The choice, the accumulation policy (``zero_accumulation``) and the gradient replication
counts live here; callers hold a :class:`~.interface.DataParallel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data.fsdp import (
    apply_fully_shard,
    fsdp_no_sync,
    fsdp_without_gradient_sync,
    is_fsdp_root,
    reshard_fsdp_units,
)
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.parallel.data.layout import ParamSlot
from lightning_para.parallel.data.zero import ZeroDataParallel


def _reduces_each_step(stage: int, accumulation: str) -> bool:
    # ZeRO-2/3 may keep gradients sharded while accumulating (one reduce-scatter per micro-step);
    # below stage 2 a gradient is whole anyway, so "reduce_each_step" would only add traffic.
    # "reduce_each_microbatch" (ZeRO-2) reduces each Lightning micro-step as well.
    return accumulation in ("reduce_each_step", "reduce_each_microbatch") and stage >= 2


class ZeroData(DataParallel):
    """ZeRO 0-2: the :class:`ZeroDataParallel` engine behind the :class:`DataParallel` interface."""

    def __init__(
        self, engine: ZeroDataParallel, dims: ParallelDims, *, accumulation: str = "no_sync",
        psi_dense: int = 0, psi_expert: int = 0,
    ) -> None:
        super().__init__(dims, stage=engine.stage, psi_dense=psi_dense, psi_expert=psi_expert)
        self.engine = engine
        self._reduce_each_step = _reduces_each_step(engine.stage, accumulation)
        self.reduces_each_microbatch = accumulation == "reduce_each_microbatch" and engine.stage == 2

    @property
    def _engine(self) -> Optional[ZeroDataParallel]:
        return self.engine

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._reduce_each_step else self.engine.no_sync()

    @property
    def sync_enabled(self) -> bool:
        return self.engine.sync_enabled

    def sync_now(self) -> None:
        self.engine.sync_now()

    def each_microbatch(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.reduce_each_microbatch()

    def reduce_part(self, part: int) -> None:
        self.engine.reduce_part(part)

    def commit_microbatches(self) -> None:
        self.engine.commit_pending()

    def pending_gradients(self) -> list[Tensor]:
        return [b.pending for b in self.engine.buckets if b.pending is not None]

    def before_backward(self) -> None:
        self.engine.before_backward()

    def flush(self) -> None:
        self.engine.flush()

    def _shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.shard_optimizer(optimizer)

    def optimizer_slots(self) -> Sequence[ParamSlot]:
        return [slot for slot in self.engine.slots if slot.master is not None]

    def parameter_name(self, optimizer_tensor: Tensor) -> Optional[str]:
        slot = self.engine.slot_for_optimizer_param(optimizer_tensor)
        return slot.name if slot is not None else None

    def masters_of(self, param_ids: set[int]) -> set[int]:
        return {id(s.master) for s in self.engine.slots if s.master is not None and id(s.param) in param_ids}

    def step_without_communication(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.step_without_communication()

    def gather_params(self) -> None:
        self.engine.gather_params()

    def reset_masters_from_params(self) -> None:
        self.engine.reset_masters_from_params()


class FullyShardedData(DataParallel):
    """ZeRO-3 (HSDP under ``dp_replicate``) on FSDP2, with ``root`` the module it was applied to."""

    fully_sharded = True

    def __init__(
        self, root: nn.Module, dims: ParallelDims, *, stage: int = 3, accumulation: str = "no_sync",
        psi_dense: int = 0, psi_expert: int = 0,
    ) -> None:
        super().__init__(dims, stage=stage, psi_dense=psi_dense, psi_expert=psi_expert)
        self.root = root
        self._reduce_each_step = _reduces_each_step(stage, accumulation)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return fsdp_no_sync(self.root)

    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._reduce_each_step else fsdp_no_sync(self.root)

    def reshard(self, module: nn.Module) -> None:
        reshard_fsdp_units(module)

    def forward_through_root(self, module: nn.Module) -> bool:
        return is_fsdp_root(module)


class UserFullyShardedData(FullyShardedData):
    """The user's ``fully_shard`` (``configure_model``): kept exactly as applied; ``roots`` are its
    outermost units. Accumulation skips their reduce-scatters and keeps their reshard settings."""

    def __init__(
        self, root: nn.Module, roots: Sequence[nn.Module], dims: ParallelDims, *, stage: int,
        accumulation: str = "no_sync", psi_dense: int = 0,
    ) -> None:
        super().__init__(root, dims, stage=stage, accumulation=accumulation, psi_dense=psi_dense)
        self.roots = list(roots)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return fsdp_without_gradient_sync(self.roots)

    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._reduce_each_step else fsdp_without_gradient_sync(self.roots)


def apply_data_parallel(
    module: nn.Module,
    dims: ParallelDims,
    *,
    stage: int,
    parts: Optional[Sequence[nn.Module]] = None,
    accumulation: str = "no_sync",
    bucket_size_mb: float = 25.0,
    zero3_units: str = "auto",
    param_dtype: Optional[torch.dtype] = None,
    master_dtype: Optional[torch.dtype] = None,
    is_expert: Callable[[Tensor], bool] = lambda t: False,
    expert_units: Sequence[nn.Module] = (),
    shard_placement_fn: Optional[Callable[[nn.Parameter], object]] = None,
    user_fsdp_roots: Optional[Sequence[nn.Module]] = None,
    psi_dense: int = 0,
    psi_expert: int = 0,
    before_gradient_hooks: Optional[Callable[[], None]] = None,
) -> DataParallel:
    """Apply data parallelism (ZeRO ``stage`` 0-3 over ``dims``' ZeRO mesh) to ``module`` in place.

    Args:
        module: the model, after every other dimension was applied.
        dims: degrees and mesh: ZeRO shards over ``dp_shard x cp`` (experts: ``edp x cp``) and
            replicates over ``dp_replicate`` (hybrid sharding).
        stage: 0-2 hook the parameters' gradients (:class:`ZeroDataParallel`); 3 applies FSDP2.
        parts: the modules FSDP2 wraps (this rank's pipeline stages; default ``[module]``).
        accumulation: ``zero_accumulation`` (``"no_sync"``, ``"reduce_each_step"``, ``"reduce_each_microbatch"``).
        bucket_size_mb: gradient bucket size (ZeRO 0-2).
        zero3_units: FSDP2's unit choice (ZeRO-3; see :func:`~.fsdp.choose_units`).
        param_dtype: the compute dtype (FSDP2 gathers in it); ``master_dtype``: separate optimizer
            weights (ZeRO 0-2 keep fp32 masters; under FSDP2 the parameters, already in this dtype, are
            the masters).
        is_expert: MoE expert parameters (sharded over the expert mesh).
        expert_units: expert modules, each its own FSDP2 unit on the expert mesh (ZeRO-3).
        shard_placement_fn: FSDP2's placement per parameter (tensor parallelism's strided shards).
        user_fsdp_roots: the user's own ``fully_shard`` units: nothing is applied, they are kept.
        psi_dense, psi_expert: the ZeRO formulas' psi (parameters before data parallelism).
        before_gradient_hooks: called once, after ZeRO 0-2 took their masters from the parameters as
            they are and before any gradient hook of data parallelism (ZeRO-3: before ``fully_shard``).
            :func:`~lightning_para.parallelize` casts to bf16 there and hooks tensor parallelism's
            gradients: a cast swaps DTensor parameters' tensors and drops hooks registered before it.
    """
    if user_fsdp_roots is not None:
        return UserFullyShardedData(
            module, user_fsdp_roots, dims, stage=stage, accumulation=accumulation, psi_dense=psi_dense
        )
    if stage == 3:
        if before_gradient_hooks is not None:
            before_gradient_hooks()
        for part in parts if parts is not None else [module]:
            apply_fully_shard(
                part, dims.fsdp_mesh(), param_dtype=param_dtype,
                expert_units=[m for m in expert_units if _inside(m, part)],
                expert_mesh=dims.fsdp_mesh(expert=True) if dims.ep > 1 else None,
                shard_placement_fn=shard_placement_fn, unit_choice=zero3_units,
            )
        return FullyShardedData(
            module, dims, stage=stage, accumulation=accumulation, psi_dense=psi_dense, psi_expert=psi_expert
        )
    dense_mesh, expert_mesh = dims.zero_mesh(), dims.zero_mesh(expert=True)
    named = [
        (name, p, expert_mesh if is_expert(p) else dense_mesh)
        for name, p in module.named_parameters()
        if p.requires_grad
    ]
    engine = ZeroDataParallel(
        named, stage, bucket_size_mb=bucket_size_mb, master_dtype=master_dtype,
        replicate_mesh=dims.replicate_mesh(), mesh_of=dims.get_mesh, hooks=False,
        part_of=_part_index(parts) if parts is not None and len(parts) > 0 else None,
    )
    if before_gradient_hooks is not None:
        before_gradient_hooks()
    engine.register_hooks()
    return ZeroData(engine, dims, accumulation=accumulation, psi_dense=psi_dense, psi_expert=psi_expert)


def _part_index(parts: Sequence[nn.Module]) -> Callable[[nn.Parameter], Optional[int]]:
    """Which of ``parts`` (this rank's pipeline stages) holds a parameter; ``None`` for none or several."""
    index: dict[int, Optional[int]] = {}
    for i, part in enumerate(parts):
        for p in part.parameters():
            index[id(p)] = i if index.get(id(p), i) == i else None
    return lambda p: index.get(id(p))


def _inside(child: nn.Module, root: nn.Module) -> bool:
    return any(m is child for m in root.modules())


__all__ = ["FullyShardedData", "UserFullyShardedData", "ZeroData", "apply_data_parallel"]
