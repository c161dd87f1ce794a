"""The planner's prediction for the run being profiled, next to what the profiler measured.

:class:`~lightning_para.observe.profiler.ParaProfiler` calls these three in order:

1. :func:`describe_for_prediction` at ``setup``, while the module is still whole (before the
   strategy splits, shards or wraps it);
2. :func:`measure_rank` at the end of training, on every rank: this rank's memory per
   component (``strategy.memory_breakdown()``), comm bytes per dimension of its last traced step,
   the pipeline events and wall-clock idle fractions of recent untraced steps, and step time;
3. :func:`check_run` on every rank with every rank's measurement: the planner prices this run's
   layout, batch, precision and optimizer (:mod:`lightning_para.run_plan`) and compares
   (:mod:`lightning_para.instrument.compare`).

The measured idle fraction of a pipeline stage is the mean, over those steps and over the
stage's ranks (its dp/tp replicas run the same schedule), of each pipeline's replayed schedule
(:func:`~lightning_para.observe.timeline.replayed_idle_fraction`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from lightning_para.observe.timeline import (
    PipelineEvent,
    rank_pipeline_record,
    replayed_idle_fraction,
    with_median_cpu,
)
from lightning_para.parallel.data import MemoryBreakdown
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.instrument.compare import MeasuredRank, PredictionCheck, comm_by_dimension, compare
from lightning_para.describe import describe_module
from lightning_para.plan.model import ModelDesc
from lightning_para.calibrate.machine import local_cluster
from lightning_para.run_plan import optimizer_kind, predict_run, run_training
from lightning_para.spec.dims import DIM


def describe_for_prediction(module: nn.Module) -> tuple[Optional[ModelDesc], Optional[str]]:
    """``(description, None)``, or ``(None, why not)`` for a module the planner cannot describe."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a parameter-count mismatch shows up in the comparison itself
            return describe_module(module), None
    except ValueError as err:
        return None, str(err)


def measure_rank(
    strategy: Any,
    rank: int,
    comm_summary: Optional[Mapping[str, Mapping[str, float]]],
    step_seconds: Optional[float],
    pipeline_steps: Sequence[PipelineStats] = (),
    memory: Optional[MemoryBreakdown] = None,
) -> tuple[MeasuredRank, list[list[PipelineEvent]]]:
    """This rank's measurement (no communication): memory between steps (now, unless ``memory``
    gives ``memory_breakdown()`` taken at an earlier step end: Lightning frees gradients before validation), the
    traced step's bytes per dimension, and (``pipeline_steps``: ``pipeline_stats()`` of untraced
    steps) their mean wall-clock idle fraction and schedule events, for the replay in :func:`check_run`."""
    dims = strategy.parallel_dims
    memory = memory if memory is not None else strategy.memory_breakdown()
    events: list[list[PipelineEvent]] = []
    wall = None
    if pipeline_steps and dims.pp > 1:
        wall = sum(float(step.idle_fraction) for step in pipeline_steps) / len(pipeline_steps)
        stage = dims.local_rank("pp")
        events = [list(rank_pipeline_record(step, rank, stage).events) for step in pipeline_steps]
    measured = MeasuredRank(
        rank=rank, pp_rank=dims.local_rank("pp"),
        memory=memory.measured,
        comm=comm_by_dimension(comm_summary) if comm_summary else {},
        step_seconds=step_seconds, idle_wall=wall,
    )
    return measured, events


def check_run(
    model: ModelDesc,
    strategy: Any,
    trainer: Any,
    batch_shape: Sequence[int],
    per_rank: Sequence[tuple[MeasuredRank, list[list[PipelineEvent]]]],
    peak_flops: Optional[float] = None,
) -> PredictionCheck:
    """Price this run with the planner and compare it with every rank's :func:`measure_rank` (raises
    ``ValueError`` if the planner cannot price it). ``batch_shape`` is a training batch's token
    tensor, ``(batch, seq)``. The idle fraction compared is the replay of all ranks' events, each
    action timed by its median CPU time over the measured steps (:func:`~.timeline.with_median_cpu`)."""
    dims, config = strategy.parallel_dims, strategy.config
    measured = [m for m, _ in per_rank]
    steps = min((len(events) for _, events in per_rank), default=0)
    if steps and dims.pp > 1:
        # One replay per pipeline: the pp ranks that share their dp/tp coordinates (pp is the
        # outermost mesh dimension, so rank r belongs to pipeline r mod (world / pp)).
        per_pipeline = dims.world_size // dims.pp
        replays: dict[int, float] = {}
        typical = [with_median_cpu(events[:steps]) for _, events in per_rank]
        for k in range(steps):
            pipelines: dict[int, list[PipelineEvent]] = {}
            for (m, _), events in zip(per_rank, typical):
                pipelines.setdefault(m.rank % per_pipeline, []).extend(events[k])
            for pipeline_events in pipelines.values():
                for rank, value in replayed_idle_fraction(pipeline_events).items():
                    replays[rank] = replays.get(rank, 0.0) + value / steps
        by_stage: dict[int, list[float]] = {}
        for m in measured:
            by_stage.setdefault(m.pp_rank, []).append(replays[m.rank])
        stage_idle = {stage: sum(values) / len(values) for stage, values in by_stage.items()}
        measured = [replace(m, idle=stage_idle[m.pp_rank]) for m in measured]
    if len(batch_shape) < 2:
        raise ValueError(f"a training batch of shape {tuple(batch_shape)} is not (batch, sequence) tokens")
    kind = optimizer_kind(trainer.optimizers[0]) if trainer.optimizers else None
    accumulation = int(trainer.accumulate_grad_batches)
    training = run_training(
        int(batch_shape[1]), int(batch_shape[0]), dims.dp, accumulation=accumulation,
        precision=strategy.precision_plugin.precision, optimizer=kind or "adam",
    )
    per_node = int(getattr(strategy, "num_processes", 1) or 1)
    cluster = local_cluster(dims.world_size, per_node, strategy.root_device, peak_flops=peak_flops)
    estimate = predict_run(model, config, dims, training, cluster)
    if kind is None or accumulation > 1:
        # An optimizer the planner does not model has no optimizer prediction; a traced batch
        # under accumulation is one micro-step of the optimizer step the planner prices.
        measured = [
            replace(m, memory={k: v for k, v in m.memory.items() if kind is not None or k != "optimizer"},
                    comm={} if accumulation > 1 else m.comm)
            for m in measured
        ]
    return compare(estimate, measured, {name: dims.size(name) for name in DIM})


__all__ = ["check_run", "describe_for_prediction", "measure_rank"]
