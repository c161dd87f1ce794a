"""A dry run of the real code at any scale: one rank of an N-rank job, on the meta device.

:func:`dry_run_rank` runs in a process of its own (the fake process group is process-wide): torch's **fake**
backend at world size ``N`` (collectives return at once, no other rank exists), the real mesh (device type
``meta``), the model built on the meta device and parallelized as ``ParaStrategy`` does it, in the run's
``*-true`` precision, then one training step driven through the engine's ``step``, ``backward`` and optimizer
step (:class:`~lightning_para.core.ParaEngine`; :mod:`.step`). It measures the states held after the step, the
activations held once the in-flight microbatches have run forward, the steady-state peak of live bytes, every
collective per mesh dimension, and models the caching allocator's reserved peak (:mod:`lightning_para.simulate.allocator`);
the planner's prediction for the same pipeline rank sits beside each figure. MoE layers route with
:func:`~lightning_para.moe.balanced_routing` (meta tensors have no values to route by), ZeRO-3 runs on FSDP2
itself (:func:`~.world.fsdp_on_meta`), and transformers' data-dependent mask checks answer "plain token windows"
(``integrations/transformers/dry_run.py``). ``docs/planner.md`` ("Dry run") has the details and the figures.

The package: :mod:`.world` (the fake process group and the lifts for meta), :mod:`.kernels` (the fused kernels'
saved-tensor profiles), :mod:`.step` (the rank's step through the engine), this module (the driver); the counters
and records are :mod:`lightning_para.instrument`'s, the planner's side :func:`~lightning_para.instrument.compare.predicted_rank`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_para.config import ParallelConfig
from lightning_para.instrument.collectives import CollectiveCounter, group_labels
from lightning_para.instrument.compare import Comparison, memory_comparisons, predicted_rank
from lightning_para.instrument.live_bytes import LiveBytes, local_shard, storage_key
from lightning_para.instrument.records import CommFigure
from lightning_para.core import ParaEngine
from lightning_para.core.precision import PrecisionCore
from lightning_para.memory import measure_states
from lightning_para.moe import balanced_routing
from lightning_para.parallelize import parallelize
from lightning_para.spec.dims import COORDINATES
from lightning_para.spec.memory import MeasuredMemory, PredictedMemory
from lightning_para.spec.schedules import in_flight_microbatches
from lightning_para.simulate.allocator import AllocationTrace, steady_state_peaks
from lightning_para.plan.cluster import Training
from lightning_para.plan.model import ModelDesc
from lightning_para.simulate.kernels import FusedKernels
from lightning_para.simulate.step import StepPeaks, train_step
from lightning_para.simulate.world import (
    count_loss_parallel,
    fsdp_on_meta,
    start_fake_world,
    uncounted_sharding_propagation,
)


@dataclass
class RankDryRun:
    """What one simulated rank did, beside what the planner predicts for it."""

    rank: int
    world_size: int
    coordinates: dict[str, int]
    pipeline_rank: int
    layers: int
    in_flight: int
    measured: MeasuredMemory
    # The planner's records of the same pipeline rank: the states held between steps, and the step's peak.
    predicted_resident: PredictedMemory
    predicted_peak: PredictedMemory
    comm: list[CommFigure] = field(default_factory=list)
    predicted_comm: list[CommFigure] = field(default_factory=list)
    step_ran: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    # The microbatches the step ran (the pipeline's whole schedule; 1 without a pipeline); `in_flight`: those whose
    # activations the schedule holds at once on this rank.
    microbatches: int = 1

    def memory_rows(self) -> list[Comparison]:
        """Measured against predicted, part by part: params, grads, optimizer, activations, peak."""
        return memory_comparisons(self.rank, self.measured, self.predicted_resident, self.predicted_peak)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, and under ``"predicted"`` the planner's figure for each part ``"measured"``
        names (read from :meth:`memory_rows`; :meth:`from_dict` does not need it back)."""
        return {**asdict(self), "predicted": {row.name: row.predicted for row in self.memory_rows()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankDryRun":
        data = {key: value for key, value in data.items() if key != "predicted"}
        data["measured"] = MeasuredMemory(**data["measured"])
        data["predicted_resident"] = PredictedMemory(**data["predicted_resident"])
        data["predicted_peak"] = PredictedMemory(**data["predicted_peak"])
        data["comm"] = [CommFigure(**c) for c in data["comm"]]
        data["predicted_comm"] = [CommFigure(**c) for c in data["predicted_comm"]]
        return cls(**data)


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
    clock: dict[str, float] = {}
    t0 = time.perf_counter()
    engine, module, optimizer = _set_up_rank(build_model, config, world_size, rank, training.precision, clock)
    dims = engine.parallel_dims
    pp_rank = dims.local_rank("pp") if dims.pp > 1 else 0
    microbatches = config.pipeline_microbatches if dims.pp > 1 else 1
    live, comm = LiveBytes(), CollectiveCounter(group_labels(dims, planner=True), time_collectives=False)
    states_before = _record_states(live, module, optimizer)
    t = time.perf_counter()
    peaks = None
    if run_step:
        # MoE layers route with a fixed balanced assignment: meta tensors have no values to route by.
        with FusedKernels(), comm, live, balanced_routing(*engine.parallel_model.parts), fsdp_on_meta(live), \
                count_loss_parallel(live), uncounted_sharding_propagation():
            peaks = train_step(engine, module, seq_len, micro_batch, hidden, live, engine.precision.param_dtype or torch.float32)
            live.trace.made_once = peaks.made_once
            live.mark("optimizer_start")
            engine.optimizer_step(optimizer.step)
            live.mark("step_end")
    clock["step"] = time.perf_counter() - t
    measured = _measured(module, optimizer, states_before, live, peaks, pipelined=dims.pp > 1)
    resident, step_peak, predicted_comm, layers = predicted_rank(model, config, dims, training, pp_rank, microbatches)
    coords = {name: dims.local_rank(name) for name in COORDINATES if getattr(dims, name) > 1}
    clock["total"] = time.perf_counter() - t0
    return RankDryRun(
        rank=rank, world_size=world_size, coordinates=coords, pipeline_rank=pp_rank, layers=layers,
        in_flight=math.ceil(in_flight_microbatches(config.schedule, dims.pp, microbatches, config.virtual_stages, pp_rank))
        if dims.pp > 1 else 1, microbatches=microbatches, measured=measured,
        predicted_resident=resident, predicted_peak=step_peak,
        comm=comm.payload_figures(), predicted_comm=predicted_comm, step_ran=run_step, seconds=clock,
    )


def _set_up_rank(
    build_model: Callable[[], nn.Module], config: ParallelConfig, world_size: int, rank: int, precision: str,
    clock: dict[str, float],
) -> tuple[ParaEngine, nn.Module, torch.optim.Optimizer]:
    """The fake world, the engine with its mesh, the model built on the meta device and parallelized as
    ``ParaStrategy`` does it, and its AdamW handed to data parallelism."""
    if not precision.endswith("-true"):
        raise ValueError(
            f"The dry run cannot run `precision={precision!r}`: autocast does not act on meta tensors."
            " Choose 'bf16-true', '16-true' or '32-true'."
        )
    t = time.perf_counter()
    start_fake_world(world_size, rank)
    # No watchdog, no step guard or its riders (meta tensors have no values to agree on), no signal handler.
    engine = ParaEngine(
        config, watchdog_timeout=None, check_finite=False, on_sigterm=None, straggler=False, front_end="dry run"
    )
    dims = engine.resolve_dims(world_size)
    engine.setup_environment("meta", world_size, broadcast=lambda obj: obj)
    clock["mesh"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.device("meta"):
        module = build_model()
    # As ParaStrategy calls it: `bf16-true` gives bf16 weights and (ZeRO 0-2) fp32 masters taken before the cast.
    # Activation recomputation runs the forward again in backward, where the fused-kernel mode is not active.
    core = PrecisionCore(precision)
    parallel = parallelize(
        module, dims, config, param_dtype=core.param_dtype, master_dtype=core.master_dtype, recompute_context=FusedKernels,
    )
    engine.setup_module(module, torch.device("meta"), core, parallel=parallel)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    engine.setup_optimizers([optimizer])
    for group in optimizer.param_groups:
        # Torch's choice on a GPU (its multi-tensor step for CUDA tensors; the for-loop one on meta and CPU), whose
        # step makes one fp32 temporary per element it steps (`_foreach_sqrt` of the second moments).
        if group["foreach"] is None:
            group["foreach"] = True
    clock["parallelize"] = time.perf_counter() - t
    return engine, module, optimizer


def _record_states(live: LiveBytes, module: nn.Module, optimizer: torch.optim.Optimizer) -> MeasuredMemory:
    """Weights and fp32 masters, made before the step: left out of the step's live bytes, the first entries of
    its allocation trace (for the caching allocator's reserved peak, ``simulate.allocator``), and measured."""
    states = [*module.parameters(), *(q for g in optimizer.param_groups for q in g["params"])]
    live.exclude = {storage_key(local_shard(t)) for t in states}
    sizes = {storage_key(local_shard(t)): local_shard(t).untyped_storage().nbytes() for t in states}
    live.trace = AllocationTrace(states=list(sizes.values()))
    return measure_states(module, optimizer, key=storage_key)


def _measured(
    module: nn.Module, optimizer: torch.optim.Optimizer, before: MeasuredMemory, live: LiveBytes,
    peaks: Optional[StepPeaks], *, pipelined: bool,
) -> MeasuredMemory:
    """The rank's states after the step, its activations, and its steady-state peak (live and reserved).

    The peak: what existed before the step (weights, masters) plus the step's own live peak (which counts the
    accumulated gradients while they live). The optimizer's moments appear in this first step's
    `optimizer.step()`; from the second step on they exist through forward and backward too, so the steady-state
    peak adds them to backward's peak. Without a pipeline, Lightning calls `zero_grad` after the training step's
    forward, so from the second step on the last step's gradients, as the rank keeps them between steps
    (`grads`), are held through the forward too (measured on an H100: the forward's peak holds them). A
    pipeline's schedule runs before it, and ParaStrategy's runner sets those gradients aside while the schedule
    runs: held through its forwards and backwards, gone by the gradient sync."""
    states = measure_states(module, optimizer, key=storage_key)
    params, grads, opt = states.params, states.grads, states.optimizer
    if peaks is None:
        return MeasuredMemory(float(params), float(grads), float(opt), 0.0, float(params + grads + opt), None, None)
    moments = opt - before.optimizer
    held = peaks.schedule + moments + grads if pipelined else live.forward_peak + moments + grads
    steady = max(held, peaks.backward + moments, live.peak)
    # The last step's gradients go at `zero_grad`: after the forward without a pipeline, after the schedule with one.
    reserved = [float(steady_state_peaks(
        live.trace, gradients_freed_at="schedule_end" if pipelined else "forward_end", expandable_segments=expand,
    ).reserved) for expand in (False, True)]
    return MeasuredMemory(float(params), float(grads), float(opt), peaks.activations, float(before.model_states + steady), *reserved)


__all__ = ["RankDryRun", "dry_run_rank"]
