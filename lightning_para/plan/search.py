"""``search(model, cluster, training)``: every layout of the world size, priced, ranked, or rejected with a reason.

The search enumerates degrees (``tp``, ``cp``, ``pp``, ``ep``, ``dp_replicate``; ``dp`` takes the
rest of the world), ZeRO stages and, per degree choice, the variants that trade memory for
time (schedule, virtual stages, recomputation, sequence parallelism, ZeRO accumulation).
A layout is rejected when a rule of :func:`~lightning_para.plan.cost.layout_problems` fails,
when ``tp`` would leave a node (by default), or when it does not fit in memory. Fitting
layouts are ranked by estimated step time; ties go to the lower ZeRO stage (fewer
collectives), then to less memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import Estimate, format_bytes, layout_problems, price_layout
from lightning_para.options import ACTIVATION_CHECKPOINTING, ZERO_ACCUMULATION
from lightning_para.plan.layout import FIXED_OPTIONS, Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import SCHEDULES, check_schedule
from lightning_para.plan.result import PlanResult, Rejected


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Which layouts :func:`search` tries. ``None`` degree lists mean "every divisor that can work".

    Args:
        tp: tensor-parallel degrees (default: divisors of the world up to ``gpus_per_node``
            when ``tp_within_node``, else all).
        pp: pipeline degrees (default: divisors of the world up to the number of layers).
        ep: expert-parallel degrees (default: divisors of the number of experts; 1 for dense).
        cp: context-parallel degrees.
        dp_replicate: hybrid-sharding replica counts (1: plain ZeRO over all of dp).
        zero: ZeRO stages.
        schedules: pipeline schedules (used when ``pp > 1``).
        virtual_stages: stages per rank tried by the multi-stage schedules ('interleaved' takes
            those >= 2, 'zero_bubble' also 1, 'zbv' always 2).
        microbatches: microbatches per pipeline flush; ``None``: all of a step's in one flush.
        recompute: activation recomputation choices.
        sequence_parallel: SP choices when ``tp > 1`` (it has the same traffic as TP and less
            memory, so ``True`` alone is the default).
        zero_accumulation: tried for ZeRO-2/3 when a step has several microbatches
            (``"reduce_each_microbatch"``: ZeRO-2 with ``pp > 1`` only).
        tp_within_node: reject ``tp > gpus_per_node``.
        best_variant_only: keep one layout (the fastest that fits) per choice of degrees and ZeRO
            stage, and one rejection (the nearest miss) per choice that has none.
        options: a layout whose options the search does not vary (``cp_method``, ``zero3_units``,
            ... :data:`~lightning_para.plan.layout.FIXED_OPTIONS`) are taken from; default:
            ParaStrategy's defaults. ``layout="auto"`` passes the user's, so its choice keeps them.
    """

    tp: Optional[Sequence[int]] = None
    pp: Optional[Sequence[int]] = None
    ep: Optional[Sequence[int]] = None
    cp: Sequence[int] = (1,)
    dp_replicate: Sequence[int] = (1,)
    zero: Sequence[int] = (0, 1, 2, 3)
    schedules: Sequence[str] = SCHEDULES
    virtual_stages: Sequence[int] = (1, 2, 4)
    microbatches: Sequence[Optional[int]] = (None,)
    recompute: Sequence[Optional[str]] = ACTIVATION_CHECKPOINTING
    sequence_parallel: Sequence[bool] = (True,)
    zero_accumulation: Sequence[str] = ZERO_ACCUMULATION
    tp_within_node: bool = True
    best_variant_only: bool = True
    options: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "dp_replicate", "virtual_stages"):
            values = getattr(self, name)
            if values is not None and (
                not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
            ):
                raise ValueError(f"`{name}={values!r}` must be a non-empty sequence of positive integers (or None).")
        if not self.zero or any(z not in (0, 1, 2, 3) for z in self.zero):
            raise ValueError(f"`zero={self.zero!r}` must list ZeRO stages from 0, 1, 2, 3.")
        for schedule in self.schedules:
            check_schedule(schedule)
        if any(r not in ACTIVATION_CHECKPOINTING for r in self.recompute):
            raise ValueError(
                f"`recompute={self.recompute!r}` must list choices from {', '.join(map(repr, ACTIVATION_CHECKPOINTING))}."
            )
        if any(z not in ZERO_ACCUMULATION for z in self.zero_accumulation):
            raise ValueError(
                f"`zero_accumulation={self.zero_accumulation!r}` must list choices from {', '.join(map(repr, ZERO_ACCUMULATION))}."
            )
        if any(m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1) for m in self.microbatches):
            raise ValueError(f"`microbatches={self.microbatches!r}` must list positive integers or None.")


def _variants(layout_degrees: dict, space: SearchSpace, per_step: Optional[int]) -> Iterator[Layout]:
    """Every variant of one choice of degrees and ZeRO stage."""
    tp, pp, zero = layout_degrees["tp"], layout_degrees["pp"], layout_degrees["zero"]
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        schedules = []
        for schedule in space.schedules:
            if schedule in ("gpipe", "1f1b"):
                schedules.append((schedule, 1))
            elif schedule == "zbv":
                schedules.append((schedule, 2))
            else:
                lowest = 2 if schedule == "interleaved" else 1
                schedules += [(schedule, v) for v in space.virtual_stages if v >= lowest]
    fixed = {name: getattr(space.options, name) for name in FIXED_OPTIONS}
    sp_choices = space.sequence_parallel if tp > 1 else (False,)
    accumulate = space.zero_accumulation if zero >= 2 and (per_step or 1) > 1 else ("no_sync",)
    # One reduction per pipeline microbatch: ZeRO-2 under a pipeline only (elsewhere it is "reduce_each_step").
    accumulate = [z for z in accumulate if z != "reduce_each_microbatch" or (zero == 2 and pp > 1)] or ["no_sync"]
    for schedule, v in dict.fromkeys(schedules):
        for microbatches in space.microbatches:
            for recompute in space.recompute:
                for sp in sp_choices:
                    for zero_accumulation in accumulate:
                        yield Layout(
                            **layout_degrees, **fixed, sequence_parallel=sp, schedule=schedule, virtual_stages=v,
                            microbatches=microbatches, activation_checkpointing=recompute, zero_accumulation=zero_accumulation,
                        )


def search(
    model: ModelDesc, cluster: Cluster, training: Training, space: Optional[SearchSpace] = None
) -> PlanResult:
    """Price every layout of ``cluster.world_size`` GPUs in ``space``; rank those that fit.

    Returns a :class:`PlanResult`; ``.best`` is the fastest layout that fits (``None`` if none).
    """
    space = space or SearchSpace()
    world, gpn = cluster.world_size, cluster.gpus_per_node
    tps = space.tp or [t for t in _divisors(world) if t <= gpn or not space.tp_within_node]
    pps = space.pp or [p for p in _divisors(world) if p <= model.layers]
    eps = space.ep or (_divisors(model.num_experts) if model.is_moe else [1])
    result = PlanResult(model, cluster, training)
    for tp in tps:
        for cp in space.cp:
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for ep in eps:
                    for dp_replicate in space.dp_replicate:
                        if dp % dp_replicate:
                            continue
                        for zero in space.zero:
                            if dp_replicate > 1 and zero == 0:
                                continue
                            degrees = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "cp": cp, "dp_replicate": dp_replicate, "zero": zero}
                            _price(model, cluster, training, space, degrees, result)
    result.fits.sort(key=lambda e: (e.step_seconds, e.layout.zero, e.memory.total))
    result.rejected.sort(key=lambda r: (r.estimate is None, -(r.estimate.headroom_bytes if r.estimate else 0)))
    return result


def _price(
    model: ModelDesc, cluster: Cluster, training: Training, space: SearchSpace, degrees: dict, result: PlanResult
) -> None:
    """Price the variants of one choice of degrees; add fits and rejections to ``result``."""
    dp, tp = degrees["dp"], degrees["tp"]
    if training.micro_batch is None:
        per_step: Optional[int] = training.accumulation  # the pipeline's microbatches never reduce in between
    else:
        per_step = None if training.global_batch % (dp * training.micro_batch) else training.microbatches_per_step(dp)
    fits: list[Estimate] = []
    misses: list[Rejected] = []
    for layout in _variants(degrees, space, per_step):
        problems = layout_problems(model, cluster, training, layout)
        if space.tp_within_node and tp > cluster.gpus_per_node:
            problems.insert(0, f"tp={tp} spans more than one node ({cluster.gpus_per_node} GPUs per node)")
        if problems:
            misses.append(Rejected(layout, "; ".join(problems)))
            continue
        priced = price_layout(model, cluster, training, layout)  # accepted just above: no second check
        if priced.fits:
            fits.append(priced)
        else:
            misses.append(Rejected(layout, (
                f"does not fit by {format_bytes(-priced.headroom_bytes)} (needs {format_bytes(priced.memory.total)} of"
                f" {format_bytes(cluster.usable_memory)} on pipeline rank {priced.peak_rank.pipeline_rank})"
            ), priced))
    if not space.best_variant_only:
        result.fits += fits
        result.rejected += misses
    elif fits:
        result.fits.append(min(fits, key=lambda e: (e.step_seconds, e.memory.total)))
    elif misses:
        priced_misses = [m for m in misses if m.estimate is not None]
        nearest = max(priced_misses, key=lambda m: m.estimate.headroom_bytes) if priced_misses else misses[0]  # type: ignore[union-attr]
        result.rejected.append(nearest)
