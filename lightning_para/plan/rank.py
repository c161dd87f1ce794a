"""One pipeline rank's price: its compute, its non-matmul traffic and the collectives of every dimension with their
overlap (the per-rank half of :func:`~lightning_para.plan.cost.estimate`); its memory is :mod:`.rank_memory`'s. Every
term reads one :class:`~lightning_para.plan.shape.RankShape`, resolved once per rank.

The assumptions, the formulas' sources and the measurements behind the terms: ``docs/planner.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.comm import Collective, collective, per_call_seconds
from lightning_para.plan.gemm import model_gemms
from lightning_para.plan.layout import Layout
from lightning_para.plan.memory import layer_activation_bytes, selective_op_recompute_params
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.overhead import (
    TRAFFIC_BY_PRECISION,
    microbatch_dtensor_ops,
    microbatch_ops,
    optimizer_dtensor_ops,
    optimizer_ops,
)
from lightning_para.plan.rank_memory import head_bytes, peak_memory
from lightning_para.plan.shape import RankShape, activation_kwargs, bucket_bytes, resident_states, zero3_ends
from lightning_para.plan.tensors import layer_tensors, muon_steps, shard_numel, total_numel
from lightning_para.spec.memory import PredictedMemory


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank (every dp/tp/cp rank of a stage looks the same)."""

    pipeline_rank: int
    layers: int
    embedding: bool
    head: bool
    in_flight: float
    memory: PredictedMemory
    # What the rank holds between optimizer steps, as ParaStrategy keeps it and
    # `ParaStrategy.memory_breakdown()` measures it (activations and buffers are 0): see `resident_states`.
    resident: PredictedMemory
    collectives: tuple[Collective, ...]
    compute_seconds: float  # per microbatch
    microbatch_seconds: float  # compute plus exposed tp/ep/cp/pp communication, per microbatch
    dp_exposed_seconds: float  # per step
    optimizer_seconds: float = 0.0  # per step: the optimizer step's per-operator overhead (CPU)


def _layer_parts(model: ModelDesc, index: int) -> tuple[float, float, float]:
    """Layer ``index``'s parameters as ``(tensor parallel, replicated over tp, routed experts)``.

    Attention and the dense MLP are tensor parallel (Megatron-LM); norms are not, and neither is
    an MoE block (router, shared experts, experts): lightning-para's experts are whole per rank.
    """
    parallel = model.attention_block_params()
    replicated = 2 * model.norm_params()
    if not model.is_moe_layer(index):
        return parallel + model.mlp_params(model.ffn), replicated, 0.0
    moe_dense = model.layer_dense_params(index) - parallel - replicated  # router and shared experts
    return parallel, replicated + moe_dense, model.routed_expert_params_per_layer()


def layer_traffic_basis(model: ModelDesc, training: Training, layout: Layout, index: int) -> float:
    """The activation bytes layer ``index`` keeps for one microbatch without recomputation: what its
    non-matmul traffic is priced per (``TrafficCoefficients.layer_per_activation_byte``)."""
    return layer_activation_bytes(
        model, training.seq_len, training.micro_batch, flash_attention=training.flash_attention,
        activation_bytes=training.bytes.activation, moe_layer=model.is_moe_layer(index),
        **activation_kwargs(training, layout)[1],
    )


def microbatch_traffic_bytes(shape: RankShape, accumulating: float = 0.0) -> float:
    """Bytes the non-matmul operators of one rank read and write for one microbatch, forward and backward
    (coefficients per precision and their counting in :mod:`lightning_para.plan.overhead`): each layer's
    activations as they would be kept without recomputation (a recomputed forward moves its share, a third,
    once more), the head's, the weight casts, and, for the ``accumulating`` fraction of microbatches that are
    not a step's first (``(m - 1) / m``), the weight gradients added into those held (ZeRO-3: their shards)."""
    model, training, layout, part = shape.model, shape.training, shape.layout, shape.part
    rates = TRAFFIC_BY_PRECISION[training.precision]
    layers = sum(layer_traffic_basis(model, training, layout, i) for i in part.layers)
    if layout.activation_checkpointing in ("full", "selective_op"):
        layers *= 4.0 / 3.0  # the forward, replayed
    traffic = rates.layer_per_activation_byte * layers
    layer_params = sum(total_numel(layer_tensors(model, i, layout.tp, layout.ep)) for i in part.layers)
    dense, expert = shape.dense, shape.expert
    weight = training.bytes.weight
    traffic += rates.layer_per_param_byte * layer_params * weight
    traffic += rates.embedding_head_per_param_byte * max(0.0, dense + expert - layer_params) * weight
    if part.last_stage:
        traffic += rates.head_per_activation_byte * head_bytes(model, training, layout)
    if accumulating:
        if layout.zero == 3:
            dense, expert = dense / shape.shards[0], expert / shape.shards[1]
        traffic += accumulating * rates.accumulate_per_grad_byte * (dense + expert) * training.bytes.grad
    return traffic


def optimizer_traffic_bytes(shape: RankShape) -> float:
    """Bytes one rank's AdamW step reads and writes: ``optimizer_bytes_per_param`` per element it steps (its
    1/N shard under ZeRO; SGD counted alike, an upper bound)."""
    dense, expert = shape.dense, shape.expert
    if shape.layout.zero >= 1:
        dense, expert = dense / shape.shards[0], expert / shape.shards[1]
    return TRAFFIC_BY_PRECISION[shape.training.precision].optimizer_bytes_per_param * (dense + expert)


def _compute_flops(shape: RankShape) -> tuple[float, float]:
    """``(all, attention scores)`` FLOPs of one microbatch, forward and backward, on one rank."""
    model, training, layout, part, tokens = shape.model, shape.training, shape.layout, shape.part, shape.tokens
    tp, expert_tp = layout.tp, (layout.tp if layout.sequence_parallel else 1)
    scores = 12.0 * model.q_dim * training.seq_len * tokens * len(part.layers) / tp
    flops = scores
    for i in part.layers:
        parallel, replicated, _ = _layer_parts(model, i)
        flops += 6.0 * parallel * tokens / tp
        if model.is_moe_layer(i):
            # Without SP every tp rank routes all of its tokens through its (whole) experts.
            active = model.top_k * model.mlp_params(model.moe_ffn) * (model.capacity_factor or 1.0)  # type: ignore[arg-type]
            flops += 6.0 * (active + replicated) * tokens / expert_tp
        else:
            flops += 6.0 * replicated * tokens / tp  # norms: negligible, counted as in 6N
    if layout.activation_checkpointing == "full":
        flops *= 4.0 / 3.0
    elif layout.activation_checkpointing in ("selective", "selective_op") and not training.flash_attention:
        flops += scores / 3.0  # the score forward, once more
    if layout.activation_checkpointing == "selective_op":
        # The matmuls its policy recomputes (k, o, one h x f matrix), forward once more.
        for i in part.layers:
            moe = model.is_moe_layer(i)
            flops += 2.0 * selective_op_recompute_params(model, moe) * tokens / tp
    if part.head:
        flops += 6.0 * model.vocab * model.hidden * tokens / tp
    return flops, scores


def _microbatch_collectives(shape: RankShape, cluster: Cluster) -> list[tuple[Collective, bool]]:
    """tp, ep, cp and pp collectives of one step, each with whether it is on the critical path."""
    model, training, layout, part, per_step = shape.model, shape.training, shape.layout, shape.part, shape.per_step
    e, tokens = training.bytes.activation, shape.tokens
    activation = tokens * model.hidden * e
    full = layout.activation_checkpointing == "full"
    # torchtitan's per-op policy keeps reduce-scatter outputs only: the recomputation runs SP's
    # all-gathers (no SP: the all-reduces) and the MoE all-to-alls again, as full recomputation does.
    op_sac = layout.activation_checkpointing == "selective_op"
    n_moe = sum(model.is_moe_layer(i) for i in part.layers)
    found: list[tuple[Collective, bool]] = []

    def add(dim: str, op: str, what: str, payload: float, calls_per_microbatch: float, critical: bool = True) -> None:
        if calls_per_microbatch > 0 and shape.groups[dim][0] > 1:
            found.append((collective(shape.groups[dim], cluster, dim, op, what, payload, calls_per_microbatch * per_step), critical))

    # tp: one collective before and after each tensor-parallel block (attention; dense MLP) per
    # direction; MoE blocks are not tensor parallel. Embedding and head add one each.
    blocks = 2 * len(part.layers) - n_moe
    ends = int(part.embedding) + int(part.head)
    forward = blocks * (2 if full else 1)
    if layout.sequence_parallel:
        add("tp", "all_gather", "layer activations", activation, forward + blocks + ends + (blocks if op_sac else 0))
        add("tp", "reduce_scatter", "layer activations", activation, forward + blocks + ends)
        if not (full or op_sac):
            add("tp", "all_gather", "saved input shards (backward)", activation, blocks, critical=False)
    else:
        add("tp", "all_reduce", "layer activations", activation, forward + blocks + ends + (blocks if op_sac else 0))
    tp_tokens = tokens / (layout.tp if layout.sequence_parallel else 1)
    routed = tp_tokens * model.top_k * (model.capacity_factor or 1.0) * model.hidden * e
    add("ep", "all_to_all", "routed tokens", routed, n_moe * (6 if full or op_sac else 4))
    # Dropless dispatch first tells every rank how many rows it will receive: one int64 per expert
    # (lightning_para's AllToAllDispatcher), in each forward.
    add("ep", "all_to_all", "rows per expert", 8 * model.num_experts, n_moe * (2 if full or op_sac else 1))
    layers = len(part.layers)
    if layout.cp_method == "all_to_all":
        # Ulysses (lightning_para.parallel.context.ulysses): q, k, v to heads and the output back,
        # 4 all-to-alls per layer forward (again under full recomputation) and their 4 adjoints.
        passes = layers * ((2 if full else 1) + 1)
        add("cp", "all_to_all", "q and attention output (Ulysses)", tokens * model.q_dim * e / layout.tp, 2 * passes)
        add("cp", "all_to_all", "k and v (Ulysses)", tokens * model.kv_dim * e / layout.tp, 2 * passes)
    else:
        # Ring attention (lightning_para.parallel.context.ring): c - 1 K/V hops per layer forward,
        # again under full recomputation and once more in backward; the dK/dV accumulators travel
        # in fp32 with their block and take one last hop home: c hops.
        kv_block = 2 * tokens * model.kv_dim * e / layout.tp  # one K and one V block
        hops = (layout.cp - 1) * layers
        add("cp", "send_recv", "K/V blocks", kv_block, hops * ((2 if full else 1) + 1))
        add("cp", "send_recv", "dK/dV accumulators (fp32, backward)", kv_block * 4 / e, layout.cp * layers)
    add("pp", "send_recv", "stage activations / gradients", activation / (layout.tp if layout.sequence_parallel else 1),
        part.sends_forward + part.sends_backward)
    if layout.pp > 1:
        # ParaStrategy's pipeline shares the last stage's fp32 step loss with every stage: one all-reduce per step.
        found.append((collective(shape.groups["pp"], cluster, "pp", "all_reduce", "step loss", 4, 1), True))
    return found


def _dp_collectives(
    shape: RankShape, cluster: Cluster, backward_window: float, forward_window: float
) -> tuple[list[Collective], float]:
    """dp/edp/dp_replicate collectives of one step and their exposed seconds (module docstring).

    Payloads are ParaStrategy's: a tensor split by rows over ``N`` ranks occupies ``N`` chunks of
    ``ceil(rows / N)`` rows in a ZeRO-1/2 bucket and in an FSDP2 all-gather (padding included);
    ZeRO-3 gathers in the parameters' dtype (fp32 but under ``bf16-true``). ``flushes``: pipeline
    flushes (accumulation steps) per optimizer step; ``reduce_each_step`` reduces after each,
    ``reduce_each_microbatch`` (ZeRO-2 under a pipeline) after each of the ``per_step`` microbatches: each
    reduction overlaps that microbatch's backward and the forward after it, the last bucket's tail only once a
    step (a stage's buckets are not waited for until the next backward starts).
    """
    training, layout, tensors, per_step = shape.training, shape.layout, shape.tensors, shape.per_step
    g, w = training.grad_bytes, training.bytes.weight
    each_step = layout.zero_accumulation in ("reduce_each_step", "reduce_each_microbatch") and layout.zero >= 2
    reductions = shape.flushes if each_step else 1
    each_microbatch = layout.reduces_each_microbatch
    if each_microbatch:
        reductions = per_step
    grad_sync: list[Collective] = []
    after_step: list[Collective] = []
    zero3: list[Collective] = []
    for expert, n in zip((False, True), shape.shards):
        dim, group = "edp" if expert else "dp", [t for t in tensors if t.expert == expert]
        if not group or n == 1:
            continue
        params, padded = total_numel(group), n * shard_numel(group, n)
        capacity = layout.bucket_size_mb * 2**20 if layout.bucket_size_mb is not None else bucket_bytes(n, g)
        buckets = max(1, math.ceil(params * g / capacity))
        if layout.zero == 0:
            grad_sync.append(collective(shape.groups[dim], cluster, dim, "all_reduce", "gradients", params * g / buckets, buckets))
        elif layout.zero < 3:
            if cluster.reduce_scatter_by_send_recv:  # gloo: each rank sends every peer the rows it owes it
                grad_sync.append(collective(shape.groups[dim], cluster, dim, "send_recv", "gradients",
                                            padded * g / (n * buckets), buckets * reductions * (n - 1)))
            else:
                grad_sync.append(collective(shape.groups[dim], cluster, dim, "reduce_scatter", "gradients",
                                            padded * g / buckets, buckets * reductions))
            after_step.append(collective(shape.groups[dim], cluster, dim, "all_gather", "updated weights", padded * w / buckets,
                                         buckets))
        else:
            gathered, gathers, units = _zero3_gathers(shape, expert, n)
            zero3.append(collective(shape.groups[dim], cluster, dim, "all_gather", "weights (forward, backward)",
                                    gathered * w / gathers, gathers * reductions))
            zero3.append(collective(shape.groups[dim], cluster, dim, "reduce_scatter", "gradients", padded * g / units,
                                    units * reductions))
    if layout.dp_replicate > 1:
        dense = total_numel(t for t in tensors if not t.expert)
        expert_params = total_numel(t for t in tensors if t.expert)
        shard = (dense / shape.shards[0] + expert_params / max(1, shape.shards[1])) * g
        grad_sync.append(collective(shape.groups["dp_replicate"], cluster, "dp_replicate", "all_reduce", "gradient shards", shard, reductions))
    exposed: list[Collective] = _muon_routes(shape, cluster) if training.optimizer == "muon" else []
    if grad_sync:
        total = sum(c.seconds for c in grad_sync) / reductions
        last_bucket = max(per_call_seconds(c) for c in grad_sync)
        # One microbatch's reduction runs behind its backward and, not waited for until the next backward
        # starts, behind the forward that follows it (`each_microbatch`); a flush's only behind its backward.
        window = backward_window + (forward_window if each_microbatch else 0.0)
        exposed_total = reductions * max(0.0, total - window) + last_bucket
        exposed += [c.exposed(exposed_total * c.seconds / (total * reductions)) for c in grad_sync]
    if after_step:
        # The next step's forward waits only for the first bucket (Megatron-LM's overlapped
        # parameter all-gather); the rest streams behind the first microbatch's forward.
        # ParaStrategy itself gathers in the optimizer's step hook (see the cost module docstring).
        total = sum(c.seconds for c in after_step)
        first_bucket = max(per_call_seconds(c) for c in after_step)
        exposed_total = max(total - forward_window, first_bucket)
        exposed += [c.exposed(exposed_total * c.seconds / total) for c in after_step]
    if zero3:
        gathers = sum(c.seconds for c in zero3 if c.op == "all_gather") / reductions
        scatters = sum(c.seconds for c in zero3 if c.op == "reduce_scatter") / reductions
        first = max(per_call_seconds(c) for c in zero3 if c.op == "all_gather")
        per_flush = max(0.0, gathers / 2 - forward_window) + max(0.0, gathers / 2 + scatters - backward_window)
        exposed_total = reductions * per_flush + first
        total = (gathers + scatters) * reductions
        exposed += [c.exposed(exposed_total * c.seconds / total) for c in zero3]
    return exposed, sum(c.exposed_seconds for c in exposed)


def _muon_routes(shape: RankShape, cluster: Cluster) -> list[Collective]:
    """Muon's owner routing (``lightning_para.optim.routing``), on the optimizer step's critical path: per mesh
    dimension that shards its matrices (dp under ZeRO >= 1, tp), an all-to-all of this rank's pieces in bfloat16 to
    the owners and one back. Expert matrices are whole on their rank: none."""
    layout = shape.layout
    matrices = [t for t in shape.tensors if not t.expert and muon_steps(t)]
    n = shape.shards[0] if layout.zero >= 1 else 1
    held = 2 * (shard_numel(matrices, n) if n > 1 else total_numel(matrices))
    return [collective(shape.groups[dim], cluster, dim, "all_to_all", "Muon pieces to owners and back", held, 2)
            for dim, size in (("dp", n), ("tp", layout.tp)) if size > 1 and held]


def _zero3_gathers(shape: RankShape, expert: bool, n: int) -> tuple[int, int, int]:
    """``(elements gathered, all-gathers, units)`` per ZeRO-3 step on one rank, as
    ``parallel/data/fsdp.py`` shards (padding included; ``expert``: the expert units over edp).

    Blocks gather for forward and again for backward, except the last block, which stays gathered;
    the embedding and the head (tied or not) are gathered once (the embedding's backward needs no
    weight, the head stays gathered); grouped or a unit each (:func:`zero3_ends`).
    """
    model, part, tp, ep = shape.model, shape.part, shape.layout.tp, shape.layout.ep
    if expert:  # one expert unit per MoE layer, resharded after forward like any block
        tensors = [t for i in part.layers for t in layer_tensors(model, i, tp, ep) if t.expert]
        units = sum(1 for i in part.layers if any(t.expert for t in layer_tensors(model, i, tp, ep)))
        return 2 * n * shard_numel(tensors, n), 2 * units, units
    layers = [[t for t in layer_tensors(model, i, tp, ep) if not t.expert] for i in part.layers]
    ends, grouped = zero3_ends(shape)
    twice = [t for layer in layers[:-1] for t in layer]
    once = (layers[-1] if layers else []) + ends
    end_units = (1 if grouped else int(part.embedding) + int(part.head or part.final_norm)) if ends else 0
    units = len(layers) + end_units
    gathers = 2 * max(0, len(layers) - 1) + int(bool(layers)) + end_units
    return n * (2 * shard_numel(twice, n) + shard_numel(once, n)), gathers, units


# Compute-time speedups of ParaStrategy's performance options, from torchtitan's published
# Llama 3.1 8B run on 8 H100s (FSDP, selective recomputation, sequence 8,192; torchtitan
# docs/performance.md): 5,762 tokens/s/GPU eager, 6,667 with torch.compile, 8,532 with compile and
# float8 (tensorwise). The factors divide the compute time only (communication is unchanged).
COMPILE_SPEEDUP = 6667 / 5762  # ~1.157: fused elementwise ops, fewer kernel launches
COMPILE_FP8_SPEEDUP = 8532 / 5762  # ~1.48: compile plus float8 matmuls (H100 FP8 tensor cores)


def compute_speedup(layout: Layout) -> float:
    """How much faster the compute of ``layout`` runs than eager (``compile``; ``fp8`` only counts with compile)."""
    if layout.compile:
        return COMPILE_FP8_SPEEDUP if getattr(layout, "fp8", None) else COMPILE_SPEEDUP
    return 1.0


def price_rank(shape: RankShape, cluster: Cluster) -> RankEstimate:
    """Memory, compute and communication of one pipeline rank (:class:`~lightning_para.plan.shape.RankShape`: its
    part of the model for one optimizer step of ``per_step`` microbatches in ``flushes`` pipeline flushes; overlap
    rules in :mod:`lightning_para.plan.cost`)."""
    model, training, layout, part, per_step = shape.model, shape.training, shape.layout, shape.part, shape.per_step
    resident = resident_states(shape)
    flops, score_flops = _compute_flops(shape)
    speed = cluster.peak_flops * cluster.matmul_efficiency(shape.tokens, model_gemms(model, shape.tokens, layout.tp, layout.ep))
    compute = flops / speed / compute_speedup(layout)
    # Per-operator overhead (0 on the GPU presets): dispatcher, autograd, launch (plan/overhead.py).
    compute += microbatch_ops(model, layout, part) * cluster.op_seconds
    compute += microbatch_dtensor_ops(model, layout, part) * cluster.dtensor_op_seconds
    optimizer_dtensor_seconds = cluster.dtensor_optimizer_op_seconds or cluster.dtensor_op_seconds
    optimizer_seconds = (optimizer_ops(model, part, layout) * cluster.op_seconds
                         + optimizer_dtensor_ops(model, layout, part) * optimizer_dtensor_seconds)
    if cluster.elementwise_bandwidth > 0 and training.activation_profile == "torch":
        # The non-matmul operators' bytes (plan/overhead.py). Eager torch code only: Megatron-LM's fused kernels
        # (norm + linear, SwiGLU, RoPE, cross-entropy) move a fraction of them, which is left in `efficiency`.
        traffic = microbatch_traffic_bytes(shape, (per_step - 1) / per_step)
        compute += traffic / cluster.elementwise_bandwidth / compute_speedup(layout)
        optimizer_seconds += optimizer_traffic_bytes(shape) / cluster.elementwise_bandwidth
    collectives, critical = _exposed_microbatch_collectives(shape, cluster, per_step * score_flops / speed)
    backward_share = 0.75 if layout.activation_checkpointing == "full" else 2.0 / 3.0
    dp_items, dp_exposed = _dp_collectives(shape, cluster, backward_share * compute, (1 - backward_share) * compute)
    return RankEstimate(
        pipeline_rank=part.rank, layers=len(part.layers), embedding=part.embedding, head=part.head,
        in_flight=part.in_flight, memory=peak_memory(shape, resident), resident=resident,
        collectives=tuple(collectives + dp_items), compute_seconds=compute,
        microbatch_seconds=compute + critical / per_step, dp_exposed_seconds=dp_exposed,
        optimizer_seconds=optimizer_seconds,
    )


def _exposed_microbatch_collectives(shape: RankShape, cluster: Cluster, attention_seconds: float
                                    ) -> tuple[list[Collective], float]:
    """The tp, ep, cp and pp collectives with their exposed seconds, and those seconds' sum (the critical path's):
    ring attention's exchanges overlap the step's blockwise attention (``attention_seconds``), all-to-alls do not."""
    critical, cp_seconds = 0.0, 0.0
    collectives: list[Collective] = []
    for item, on_path in _microbatch_collectives(shape, cluster):
        if item.dim == "cp" and item.op == "send_recv":
            cp_seconds += item.seconds
            collectives.append(item)
            continue
        item = item.exposed(item.seconds if on_path else 0.0)
        critical += item.exposed_seconds
        collectives.append(item)
    if cp_seconds:
        spare = max(0.0, cp_seconds - attention_seconds)
        collectives = [c.exposed(spare * c.seconds / cp_seconds) if c.dim == "cp" else c for c in collectives]
        critical += spare
    return collectives, critical
