"""Per-operator overhead and element-wise traffic: what a step costs beyond its matmul FLOPs.

Every eager operator pays a fixed cost however small its tensors: the dispatcher, autograd's
graph bookkeeping, the kernel launch. On a GPU that cost hides behind the device's queue (the
GPU presets leave :attr:`~lightning_para.plan.cluster.Cluster.op_seconds` at 0); on a CPU rank
with a tiny model (the README demo: h=128, 64 tokens x 4 sequences per microbatch) it dominates
the step, which the roofline alone under-predicted by 2.6x (docs/planner.md).

The planner prices it as ``ops x op_seconds``: ``op_seconds`` is measured once per machine
(:func:`lightning_para.calibrate.measure.measure_op_seconds`: a chain of tiny operators, forward
and backward, divided by the aten operators it dispatched), and the operator counts below were
counted with ``TorchDispatchMode`` on the project's GPT recipe (``tests/unit/test_plan_overhead.py``
recounts them, so a change to the recipe that moves them fails a test instead of silently
mis-pricing).

Under tensor parallelism many of those operators go through DTensor's dispatch instead (sharding
propagation, redistribution, re-wrapping its local result), which costs ~15x a plain operator's
fixed cost on CPU; with sequence parallelism the whole block between the norms runs on DTensors.
The planner prices those separately, ``dtensor_ops x dtensor_op_seconds``
(:func:`lightning_para.calibrate.measure.measure_dtensor_op_seconds`). Their counts (the ``TP_*``
tables, ``(DTensor operators, plain operators)``) were counted on the GPT recipe at tp=2 under
torch's fake process group (``tests/unit/tp_op_counts.py``; ``tests/unit/test_plan_overhead.py``
recounts them). They do not depend on the tp degree: each rank runs the same operators on its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import RankLayers

# aten operators of one pre-norm block of the GPT recipe (RMSNorm, RoPE, SDPA, SwiGLU), counted
# with TorchDispatchMode on `GPT(preset="tiny").blocks[0]`: forward and backward.
LAYER_FORWARD_OPS = 104
LAYER_BACKWARD_OPS = 144
# The final norm, the output projection and the cross-entropy loss, forward + backward.
HEAD_OPS = 11 + 28 + 5 + 6
# The embedding lookup, forward + backward.
EMBEDDING_OPS = 1 + 2
# torch.optim.AdamW's per-tensor (for-loop) step on CPU: lerp_, mul_, addcmul_, sqrt, div, addcdiv_, ...
OPTIMIZER_OPS_PER_TENSOR = 10

@dataclass(frozen=True)
class TrafficCoefficients:
    """Bytes the non-matmul operators move (each one's inputs plus outputs, forward and backward; views, the
    matmuls and fused attention, priced by their FLOPs, left out), as multiples of what the planner already
    computes: ``layer_per_activation_byte x`` the activation bytes a layer keeps (``plan.memory``) ``+
    layer_per_param_byte x`` its parameter bytes (activations are written once and read several times; the
    weight gradients are written and accumulated; autocast casts the weights), the same for the head (final
    norm, output projection, loss) and the embedding and head weights, and AdamW's bytes per element stepped.
    Counted with :func:`lightning_para.calibrate.traffic.count_traffic_coefficients`."""

    layer_per_activation_byte: float
    layer_per_param_byte: float
    head_per_activation_byte: float
    embedding_head_per_param_byte: float
    optimizer_bytes_per_param: float
    accumulate_per_grad_byte: float  # a later microbatch adds each weight gradient into the one held


# Counted on `GPT(preset="tiny")` on CPU at 8 x 64 and 4 x 32 tokens (tests/unit/test_plan_overhead.py recounts
# them); wider recipes (h=256, f=1024; GQA) fit 7.5 per activation byte. The weight gradients come out of the
# matmuls (priced by FLOPs), so a first microbatch moves almost no bytes per parameter; a later one adds each
# gradient into the one held (read both, write the sum: 3 bytes per gradient byte). AdamW is torch's
# per-tensor loop (CPU's default): parameter, gradient, both moments and the temporaries of its 10 operators.
FP32_CPU_TRAFFIC = TrafficCoefficients(8.61, 0.05, 11.79, 0.01, 84.0, 3.0)
# Counted on an H100 (torch 2.11+cu130, benchmarks/gpu_step_model.py, benchmarks/results/gpu_step_model_h100.md)
# at Llama 3 8B's widths (h=4096, 32/8 heads, f=14,336) and 70B's (h=8192, 64/8, f=28,672), V=128,256, at
# 2 x 8,192 and 1 x 2,048 tokens; the two widths agree within 3%, the means are kept. bf16-mixed: autocast casts
# every fp32 weight to bf16 and every bf16 weight gradient back (3 bytes per fp32 parameter byte), and RoPE and
# the loss run in fp32. AdamW is CUDA's foreach implementation, as ParaStrategy's step ran it on the recipe
# (bytes per element counted there: 54.9, and 62.9 under bf16-true, which also copies each fp32 master into
# the bf16 weight).
BF16_MIXED_CUDA_TRAFFIC = TrafficCoefficients(10.77, 3.01, 8.48, 3.0, 54.9, 3.0)
BF16_TRUE_CUDA_TRAFFIC = TrafficCoefficients(7.54, 0.01, 7.52, 0.0, 62.9, 3.0)
# Per precision, where that precision runs: fp32 on the CPU demos, 16-bit on GPUs (fp16 moves what bf16 does).
TRAFFIC_BY_PRECISION: Mapping[str, TrafficCoefficients] = {
    "32-true": FP32_CPU_TRAFFIC, "bf16-mixed": BF16_MIXED_CUDA_TRAFFIC, "16-mixed": BF16_MIXED_CUDA_TRAFFIC,
    "bf16-true": BF16_TRUE_CUDA_TRAFFIC, "16-true": BF16_TRUE_CUDA_TRAFFIC,
}
# The planner divides the traffic by `Cluster.elementwise_bandwidth`.


# Under tp > 1, keyed by sequence parallelism: (operators through DTensor's dispatch, plain operators).
TP_LAYER_FORWARD: Mapping[bool, tuple[int, int]] = {False: (28, 91), True: (46, 84)}
TP_LAYER_BACKWARD: Mapping[bool, tuple[int, int]] = {False: (66, 90), True: (123, 80)}
# AdamW's step on a layer's 9 tensors (the TP-sharded ones are DTensors; under SP the norms' too).
TP_LAYER_OPTIMIZER: Mapping[bool, tuple[int, int]] = {False: (56, 34), True: (72, 18)}
# The vocab-parallel embedding, forward + backward.
TP_EMBEDDING: Mapping[bool, tuple[int, int]] = {False: (1, 21), True: (1, 26)}
# The final norm, the vocab-parallel output projection and the vocab-parallel loss, forward + backward.
TP_HEAD: Mapping[bool, tuple[int, int]] = {False: (21, 42), True: (46, 23)}
# AdamW on the embedding and head tensors (3 tensors, 32 operators with the profiler's pair).
TP_REST_OPTIMIZER: Mapping[bool, tuple[int, int]] = {False: (16, 16), True: (24, 8)}


def _layer_ops(layout: Layout, which: int) -> tuple[float, float]:
    """(DTensor, plain) operators of one layer's microbatch (which=0) or optimizer step (which=2)."""
    if layout.tp <= 1:
        if which == 2:
            return 0.0, 0.0  # priced per tensor by optimizer_ops
        forward, backward = (0, LAYER_FORWARD_OPS), (0, LAYER_BACKWARD_OPS)
    else:
        sp = layout.sequence_parallel
        if which == 2:
            return tuple(map(float, TP_LAYER_OPTIMIZER[sp]))  # type: ignore[return-value]
        forward, backward = TP_LAYER_FORWARD[sp], TP_LAYER_BACKWARD[sp]
    # Full recomputation, and torchtitan's per-op policy ("selective_op"), replay the forward.
    replays = 2 if layout.activation_checkpointing in ("full", "selective_op") else 1
    return (float(replays * forward[0] + backward[0]), float(replays * forward[1] + backward[1]))


def _microbatch_counts(layout: Layout, part: RankLayers) -> tuple[float, float]:
    dtensor, plain = _layer_ops(layout, 0)
    dtensor, plain = dtensor * len(part.layers), plain * len(part.layers)
    tp = layout.tp > 1
    if part.embedding:
        extra = TP_EMBEDDING[layout.sequence_parallel] if tp else (0, EMBEDDING_OPS)
        dtensor, plain = dtensor + extra[0], plain + extra[1]
    if part.head:
        extra = TP_HEAD[layout.sequence_parallel] if tp else (0, HEAD_OPS)
        dtensor, plain = dtensor + extra[0], plain + extra[1]
    return dtensor, plain


def microbatch_ops(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """Plain aten operators one rank dispatches for one microbatch, forward and backward (a full
    recomputation replays each layer's forward once more); under tp > 1 those outside DTensor's dispatch."""
    return _microbatch_counts(layout, part)[1]


def microbatch_dtensor_ops(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """Operators through DTensor's dispatch one rank runs for one microbatch (0 without tensor parallelism)."""
    return _microbatch_counts(layout, part)[0]


def parameter_tensors(model: ModelDesc, part: RankLayers) -> int:
    """Parameter tensors one rank holds (the optimizer steps each one)."""
    linears = 4 + (3 if model.gated_mlp else 2)  # q, k, v, out; gate/up, down
    per_layer = linears * (2 if model.bias else 1) + 2 * (2 if model.norm == "layernorm" and model.bias else 1)
    tensors = per_layer * len(part.layers)
    for i in part.layers:
        if model.is_moe_layer(i):
            tensors += 1  # the router (experts: one stacked tensor per matrix, counted as the MLP's)
    if part.embedding:
        tensors += 1 + (1 if model.learned_positions else 0)
    if part.head:
        tensors += 1 + (0 if model.tied_embeddings else 1)
    return tensors


def _optimizer_counts(model: ModelDesc, layout: Layout, part: RankLayers) -> tuple[float, float]:
    total = float(OPTIMIZER_OPS_PER_TENSOR * parameter_tensors(model, part))
    if layout.tp <= 1:
        return 0.0, total
    sp = layout.sequence_parallel
    dtensor = TP_LAYER_OPTIMIZER[sp][0] * len(part.layers)
    rest = TP_REST_OPTIMIZER[sp]
    non_layer = parameter_tensors(model, RankLayers(
        rank=part.rank, layers=(), embedding=part.embedding, head=part.head, sends_forward=0, sends_backward=0,
        in_flight=part.in_flight))
    dtensor += non_layer * OPTIMIZER_OPS_PER_TENSOR * rest[0] / (rest[0] + rest[1] - 2)  # less the profiler's pair
    dtensor = min(dtensor, total)
    return dtensor, total - dtensor


def optimizer_ops(model: ModelDesc, part: RankLayers, layout: Layout | None = None) -> float:
    """Plain aten operators of one optimizer step on one rank (under tp > 1, those outside DTensor's dispatch)."""
    if layout is None:
        return float(OPTIMIZER_OPS_PER_TENSOR * parameter_tensors(model, part))
    return _optimizer_counts(model, layout, part)[1]


def optimizer_dtensor_ops(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """Operators through DTensor's dispatch in one optimizer step on one rank (0 without tensor parallelism)."""
    return _optimizer_counts(model, layout, part)[0]


__all__ = ["BF16_MIXED_CUDA_TRAFFIC", "BF16_TRUE_CUDA_TRAFFIC", "EMBEDDING_OPS", "FP32_CPU_TRAFFIC", "HEAD_OPS",
           "TRAFFIC_BY_PRECISION", "TrafficCoefficients", "LAYER_BACKWARD_OPS", "LAYER_FORWARD_OPS", "OPTIMIZER_OPS_PER_TENSOR",
           "TP_EMBEDDING", "TP_HEAD", "TP_LAYER_BACKWARD", "TP_LAYER_FORWARD", "TP_LAYER_OPTIMIZER",
           "TP_REST_OPTIMIZER", "microbatch_dtensor_ops", "microbatch_ops", "optimizer_dtensor_ops", "optimizer_ops",
           "parameter_tensors"]
