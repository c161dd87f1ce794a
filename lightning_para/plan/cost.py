"""``estimate(model, cluster, training, layout)``: memory, communication, bubble and step time of one layout.

Roofline step time: per pipeline rank, a microbatch's compute at the rank's matmul efficiency (and its non-matmul
bytes over the element-wise bandwidth, for eager torch code) plus its exposed tp, ep, cp and pp communication; the
bubble stretches the busiest rank's time, ``M t_mb / (1 - bubble)``; the data-parallel communication adds what it
does not overlap (a well-overlapped engine's: the last bucket of the gradient reduction, the first of the weight
gather, ZeRO-3's first layer). Every assumption, its source and what is not modelled: ``docs/planner.md``, "Step
time and MFU (roofline)"; the memory and communication terms: "Memory per rank" and "Communication per step".
``compile`` (and ``fp8`` with it) divide the compute time by torchtitan's measured speedups (:data:`COMPILE_SPEEDUP`,
:data:`COMPILE_FP8_SPEEDUP`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.comm import Collective, crosses_nodes
from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import pipeline_ranks
from lightning_para.plan.rank import COMPILE_FP8_SPEEDUP, COMPILE_SPEEDUP, RankEstimate, price_rank
from lightning_para.plan.shape import RankShape, bucket_bytes
from lightning_para.spec.dims import PRICED
from lightning_para.spec.memory import PredictedMemory
from lightning_para.spec.options import RUN_RULES, rule_problems
from lightning_para.spec.schedules import (
    PLANNED_SCHEDULES,
    default_microbatches,
    expected_bubble,
    fill_factor,
    schedule_problem,
)
from lightning_para.spec.split import explicit_split

__all__ = [
    "COMPILE_FP8_SPEEDUP", "COMPILE_SPEEDUP", "Estimate", "Layout", "PredictedMemory", "RankEstimate", "bucket_bytes", "estimate", "layout_problems", "resolve_batch",
]

@dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one layout. ``memory`` and ``collectives`` are the
    most memory-loaded pipeline rank's; ``ranks`` has every pipeline rank."""

    model: ModelDesc
    cluster: Cluster
    training: Training
    layout: Layout
    microbatches: int  # per pipeline flush (1 without a pipeline)
    accumulation: int  # flushes per optimizer step: Lightning's accumulate_grad_batches
    ranks: tuple[RankEstimate, ...]
    bubble: float
    step_seconds: float
    model_flops_per_step: float

    @property
    def peak_rank(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.memory.total)

    @property
    def memory(self) -> PredictedMemory:
        return self.peak_rank.memory

    @property
    def collectives(self) -> tuple[Collective, ...]:
        return self.peak_rank.collectives

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.cluster.usable_memory

    @property
    def headroom_bytes(self) -> float:
        """Usable memory left on the peak rank (negative: short by that much)."""
        return self.cluster.usable_memory - self.memory.total

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization (PaLM, Appendix B): model FLOPs over step time and peak."""
        return self.model_flops_per_step / (self.step_seconds * self.cluster.world_size * self.cluster.peak_flops)

    def comm_bytes(self) -> dict[str, float]:
        """Bytes per step per mesh dimension on the peak rank (comm tracer accounting)."""
        totals: dict[str, float] = {}
        for item in self.collectives:
            totals[item.dim] = totals.get(item.dim, 0.0) + item.bytes
        return totals

    def idle_fractions(self) -> tuple[float, ...]:
        """Predicted idle fraction of each pipeline rank (waiting, not computing), from its own
        microbatch time ``t_r`` (compute plus exposed tp/ep/pp communication).

        The schedule's fill and drain add ``k (sum_r t_r - t_max)`` to the ``m t_max`` the slowest
        rank needs, with ``k = 1`` for GPipe and 1F1B, ``1/v`` interleaved, ``1/3`` zero-bubble (ZB-H1)
        and 0 for ZB-V; rank ``r`` idles ``1 - m t_r / T``. With equal ``t_r`` it is exactly
        :func:`~lightning_para.spec.schedules.bubble_fraction` of the papers (see
        :mod:`~lightning_para.spec.schedules`); unequal stages (the embedding's and the head's)
        make the faster ranks wait more.
        """
        if self.layout.pp == 1:
            return (0.0,)
        layout, m = self.layout, self.microbatches
        k = fill_factor(layout.schedule, layout.virtual_stages)
        times = [r.microbatch_seconds for r in self.ranks]
        slowest = max(times)
        step = m * slowest + k * (sum(times) - slowest)
        return tuple(1.0 - m * t / step if step > 0 else 0.0 for t in times)

    def crosses_nodes(self) -> dict[str, bool]:
        """For each dimension of degree > 1: whether its group spans nodes."""
        dims = [d for d in PRICED if self.layout.group(d)[0] > 1 and (d != "edp" or self.model.is_moe)]
        return {dim: crosses_nodes(self.layout.group(dim), self.cluster) for dim in dims}

    def summary(self) -> str:
        m, unit = self.memory, memory_unit(self.memory.total)
        return (
            f"{self.layout.label()}: {format_bytes(m.total, unit)} of {format_bytes(self.cluster.usable_memory)}"
            f" (params {format_bytes(m.params, unit, False)}, grads {format_bytes(m.held_grads, unit, False)},"
            f" optimizer {format_bytes(m.optimizer, unit, False)}, activations {format_bytes(m.activations, unit, False)},"
            f" buffers {format_bytes(m.buffers, unit, False)}), bubble {self.bubble:.1%},"
            f" step {self.step_seconds:.3g} s, MFU {self.mfu:.1%}"
        )


def memory_unit(nbytes: float) -> tuple[str, float]:
    """GB for a billion bytes and more, else MB: tiny CPU models stay readable."""
    return ("GB", 1e9) if abs(nbytes) >= 1e9 else ("MB", 1e6)


def format_bytes(nbytes: float, unit: Optional[tuple[str, float]] = None, suffix: bool = True) -> str:
    """``nbytes`` in ``unit`` (default: :func:`memory_unit`), e.g. ``"12.3 MB"``."""
    name, scale = unit or memory_unit(nbytes)
    value = nbytes / scale
    text = f"{value:.1f}" if abs(value) >= 10 or value == 0 else f"{value:.3g}"
    return f"{text} {name}" if suffix else text


def _flush(layout: Layout, per_step: int) -> int:
    """Microbatches per pipeline flush: the layout's choice, else all of the step's; without a
    pipeline each microbatch is its own accumulation step."""
    if layout.pp == 1:
        return 1
    return layout.microbatches or per_step


def _default_microbatches(layout: Layout) -> int:
    """ParaStrategy's microbatches per pipeline step when none are given: one per stage."""
    return layout.microbatches or (default_microbatches(layout.pp, layout.virtual_stages) if layout.pp > 1 else 1)


def resolve_batch(training: Training, layout: Layout) -> tuple[Training, int, int]:
    """``(training with an integer micro_batch, microbatches per pipeline flush, flushes per step)``.

    With ``training.micro_batch=None`` (a Lightning run under ParaStrategy) each data-parallel
    rank loads ``global_batch / (accumulation * dp)`` sequences per batch, and the pipeline splits
    them into its microbatches; otherwise the step's microbatches go in flushes of
    ``layout.microbatches`` (all in one by default). Raises ``ValueError`` when a division fails
    (:func:`layout_problems` reports the same reasons).
    """
    if training.micro_batch is not None:
        per_step = training.microbatches_per_step(layout.dp)
        flush = _flush(layout, per_step)
        return training, flush, per_step // flush
    problem = _batch_problem(training, layout)
    if problem:
        raise ValueError(problem)
    microbatches = _default_microbatches(layout)
    per_rank = _rank_batch(training, layout)
    global_batch = per_rank * layout.dp * training.accumulation
    resolved = replace(training, global_batch=global_batch, batch_per_rank=None, micro_batch=per_rank // microbatches)
    return resolved, microbatches, training.accumulation


def _rank_batch(training: Training, layout: Layout) -> int:
    """Sequences a data-parallel rank loads per batch (``micro_batch=None``)."""
    if training.batch_per_rank is not None:
        return training.batch_per_rank
    return training.global_batch // training.accumulation // layout.dp  # type: ignore[operator]


def _batch_problem(training: Training, layout: Layout) -> Optional[str]:
    """Why the batch cannot be split for ``layout`` (``micro_batch=None``), or ``None``."""
    if training.batch_per_rank is None:
        per_step = training.global_batch // training.accumulation  # type: ignore[operator]
        if per_step % layout.dp:
            return f"batch {per_step} per step not divisible by dp={layout.dp}"
    per_rank, microbatches = _rank_batch(training, layout), _default_microbatches(layout)
    if per_rank % microbatches:
        return f"batch {per_rank} per dp rank not divisible by microbatches={microbatches}"
    return None


def layout_problems(model: ModelDesc, cluster: Cluster, training: Training, layout: Layout) -> list[str]:
    """Why ``layout`` cannot run ``model`` (readable reasons; empty when it can). Memory is not checked."""
    lay, problems = layout, []
    if lay.world_size != cluster.world_size:
        problems.append(f"layout uses {lay.world_size} GPUs, the cluster has {cluster.world_size}")
    checks = [("heads", model.heads), ("kv_heads", model.kv_heads)]
    if model.num_moe_layers < model.layers:  # the dense MLP is tensor parallel; experts are not
        checks.append(("ffn", model.ffn))
    for name, value in checks:
        if value % lay.tp:
            problems.append(f"{name} {value} not divisible by tp={lay.tp}")
    if lay.cp > 1 and lay.cp_method == "all_to_all":  # Ulysses splits each tp rank's heads over cp
        for name, value in (("heads", model.heads), ("kv_heads", model.kv_heads)):
            if value % (lay.cp * lay.tp):
                problems.append(f"{name} {value} not divisible by cp x tp = {lay.cp * lay.tp} (Ulysses)")
    # ParaStrategy's rules between options (lightning_para.spec.options.RUN_RULES: ep divides dp_shard, ...), in its words.
    problems += [problem for problem, _ in rule_problems(lay.strategy_kwargs(), RUN_RULES)]
    if lay.ep > 1 and not model.is_moe:
        problems.append(f"ep={lay.ep} needs experts, the model has none")
    elif model.is_moe and model.num_experts % lay.ep:
        problems.append(f"experts {model.num_experts} not divisible by ep={lay.ep}")
    chunks = lay.pp * lay.virtual_stages
    if lay.pp > 1 and chunks > len(model.units()):
        problems.append(f"pipeline layers {len(model.units())} fewer than pp*virtual_stages = {chunks}")
    if lay.cp > 1 and lay.cp_load_balance and training.seq_len % (2 * lay.cp):  # two chunks per cp rank
        problems.append(f"seq_len {training.seq_len} not divisible by 2*cp={2 * lay.cp} (load-balanced chunks)")
    elif lay.cp > 1 and not lay.cp_load_balance and training.seq_len % lay.cp:
        problems.append(f"seq_len {training.seq_len} not divisible by cp={lay.cp}")
    elif lay.sequence_parallel and (training.seq_len // lay.cp) % lay.tp:
        problems.append(f"seq_len/cp = {training.seq_len // lay.cp} not divisible by tp={lay.tp} (sequence parallel)")
    if lay.pp > 1 and lay.schedule not in PLANNED_SCHEDULES:
        problems.append(f"schedule '{lay.schedule}' runs under ParaStrategy, but the planner has no bubble model for it")
        return problems
    if lay.pipeline_split is not None and lay.pp > 1:
        try:
            explicit_split(lay.pipeline_split, len(model.units()), lay.pp * lay.virtual_stages)
        except ValueError as err:
            problems.append(str(err))
    if training.micro_batch is None:
        problem = _batch_problem(training, lay)
        if problem:
            problems.append(problem)
            return problems
        flush, per_step = _default_microbatches(lay), _default_microbatches(lay) * training.accumulation
    elif training.global_batch % (lay.dp * training.micro_batch):
        problems.append(
            f"global_batch {training.global_batch} not divisible by dp*micro_batch = {lay.dp * training.micro_batch}"
        )
        return problems
    else:
        per_step = training.microbatches_per_step(lay.dp)
        flush = _flush(lay, per_step)
    if per_step % flush:
        problems.append(f"microbatches={flush} does not divide the {per_step} microbatches per step of a dp rank")
    elif lay.pp > 1:
        # The schedule is one the planner prices (checked above): ask its own rules.
        problem = schedule_problem(lay.schedule, lay.pp, flush, lay.virtual_stages)
        if problem:
            problems.append(problem[0])
    return problems


def estimate(model: ModelDesc, cluster: Cluster, training: Training, layout: Layout) -> Estimate:
    """Predict memory per rank, communication, bubble and step time of ``layout``.

    Raises ``ValueError`` listing every reason when the layout cannot run the model (see
    :func:`layout_problems`); a layout that runs out of memory is still estimated (``fits``).
    """
    problems = layout_problems(model, cluster, training, layout)
    if problems:
        raise ValueError(f"Layout {layout.label()} cannot run {model.name}: " + "; ".join(problems) + ".")
    return price_layout(model, cluster, training, layout)


def price_layout(model: ModelDesc, cluster: Cluster, training: Training, layout: Layout) -> Estimate:
    """:func:`estimate` of a layout :func:`layout_problems` already accepted: one downward pass that splits the
    model once (:func:`~lightning_para.plan.pipeline.pipeline_ranks`) and reads the schedule's own math."""
    training, flush, flushes = resolve_batch(training, layout)
    per_step = flush * flushes
    parts = pipeline_ranks(model, layout.schedule, layout.pp, layout.virtual_stages, flush, layout.pipeline_split)
    # Ranks with the same content (layer kinds, ends, sends, in-flight) cost the same: price once.
    priced: dict[tuple, RankEstimate] = {}
    ranks = []
    for part in parts:
        kinds = tuple(model.is_moe_layer(i) for i in part.layers)
        chunks = tuple((tuple(model.is_moe_layer(i) for i in c.layers), c.embedding, c.last_stage, c.sends_forward)
                       for c in part.chunks)
        key = (kinds, part.embedding, part.head, part.final_norm, part.last_stage, part.sends_forward,
               part.sends_backward, part.in_flight, chunks)
        if key not in priced:
            priced[key] = price_rank(RankShape(model, training, layout, part, per_step, flushes), cluster)
        ranks.append(replace(priced[key], pipeline_rank=part.rank))
    bubble = expected_bubble(layout.schedule, layout.pp, flush, layout.virtual_stages) or 0.0
    pipeline_seconds = per_step * max(r.microbatch_seconds for r in ranks) / (1.0 - bubble)
    step = pipeline_seconds + max(r.dp_exposed_seconds + r.optimizer_seconds for r in ranks)
    step += cluster.step_overhead_seconds  # the framework's fixed cost per step (0 on the GPU presets)
    return Estimate(
        model=model, cluster=cluster, training=training, layout=layout, microbatches=flush,
        accumulation=flushes, ranks=tuple(ranks), bubble=bubble, step_seconds=step,
        model_flops_per_step=model.flops_per_token(training.seq_len) * training.tokens_per_step,
    )
