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
from dataclasses import dataclass, field, fields
from typing import Optional

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import Estimate, format_bytes, layout_problems, price_layout
from lightning_para.plan.layout import FIXED_OPTIONS, Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.result import PlanResult, Rejected
from lightning_para.spec.dims import DIMS, divisors
from lightning_para.spec.options import (
    ACTIVATION_CHECKPOINTING,
    LAYOUT_RULES,
    OPTIONS,
    ZERO_ACCUMULATION,
    ZERO_STAGES,
    check_option,
    rule_problems,
)
from lightning_para.spec.schedules import PLANNED_SCHEDULES, check_planned, schedule_info

# SearchSpace's lists named otherwise than the option whose values they list.
_LISTS = {"schedules": "schedule", "recompute": "activation_checkpointing"}


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
    zero: Sequence[int] = ZERO_STAGES
    schedules: Sequence[str] = PLANNED_SCHEDULES
    virtual_stages: Sequence[int] = (1, 2, 4)
    microbatches: Sequence[Optional[int]] = (None,)
    recompute: Sequence[Optional[str]] = ACTIVATION_CHECKPOINTING
    sequence_parallel: Sequence[bool] = (True,)
    zero_accumulation: Sequence[str] = ZERO_ACCUMULATION
    tp_within_node: bool = True
    best_variant_only: bool = True
    options: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        # Each list's values are checked by the option they are values of (lightning_para.spec.options).
        for f in fields(self):
            option, values = _LISTS.get(f.name, f.name), getattr(self, f.name)
            if option not in OPTIONS or values is None:  # None degree lists: every divisor that can work
                continue
            if isinstance(values, str) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"`{f.name}={values!r}` must be a non-empty sequence of `{option}` values (or None).")
            try:
                for value in values:
                    check_option(option, value, tuple(v for v in OPTIONS[option].also if v != "auto"))
                    if option == "schedule":
                        check_planned(value)
            except ValueError as err:
                raise ValueError(f"`{f.name}={values!r}` must list `{option}` values: {err}") from None


def _variants(layout_degrees: dict, space: SearchSpace, per_step: Optional[int]) -> Iterator[Layout]:
    """Every variant of one choice of degrees and ZeRO stage."""
    tp, pp, zero = layout_degrees["tp"], layout_degrees["pp"], layout_degrees["zero"]
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        schedules = []
        for schedule in space.schedules:  # the stages per rank each runs (its rule), or those tried
            info = schedule_info(schedule)
            tried = range(info.min_virtual, info.max_virtual + 1) if info.max_virtual else space.virtual_stages
            schedules += [(schedule, v) for v in tried if v >= info.min_virtual]
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
    tps = space.tp or [t for t in divisors(world) if t <= gpn or not space.tp_within_node]
    pps = space.pp or [p for p in divisors(world) if p <= model.layers]
    eps = space.ep or (divisors(model.num_experts) if model.is_moe else [1])
    result = PlanResult(model, cluster, training)
    for tp in tps:
        for cp in space.cp:
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for ep in eps:
                    for dp_replicate in space.dp_replicate:
                        for zero in space.zero:
                            degrees = dict(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, dp_replicate=dp_replicate, zero=zero)
                            if not rule_problems(degrees, LAYOUT_RULES):  # no layout without them: not tried
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
        problems[:0] = [f"{d.name}={layout.group(d.name)[0]} spans more than one node ({cluster.gpus_per_node} GPUs per"
                        f" node)" for d in DIMS if d.within_node and space.tp_within_node
                        and layout.group(d.name)[1] > cluster.gpus_per_node]
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
