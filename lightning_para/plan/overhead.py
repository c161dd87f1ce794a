"""Per-operator overhead: what a step costs beyond its FLOPs and bytes (issue 23, item 3).

Every eager operator pays a fixed cost however small its tensors: the dispatcher, autograd's
graph bookkeeping, the kernel launch. On a GPU that cost hides behind the device's queue (the
GPU presets leave :attr:`~lightning_para.plan.cluster.Cluster.op_seconds` at 0); on a CPU rank
with a tiny model (the README demo: h=128, 64 tokens x 4 sequences per microbatch) it dominates
the step, which the roofline alone under-predicted by 2.6x (docs/planner.md).

The planner prices it as ``ops x op_seconds``: ``op_seconds`` is measured once per machine
(:func:`lightning_para.plan.calibrate.measure_op_seconds`: a chain of tiny operators, forward
and backward, divided by the aten operators it dispatched), and the operator counts below were
counted with ``TorchDispatchMode`` on the project's GPT recipe (``tests/unit/test_plan_overhead.py``
recounts them, so a change to the recipe that moves them fails a test instead of silently
mis-pricing).
"""

from __future__ import annotations

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


def microbatch_ops(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """aten operators one rank dispatches for one microbatch, forward and backward (a full
    recomputation replays each layer's forward once more)."""
    layer = LAYER_FORWARD_OPS + LAYER_BACKWARD_OPS
    if layout.activation_checkpointing in ("full", "selective_op"):
        layer += LAYER_FORWARD_OPS
    ops = float(layer * len(part.layers))
    if part.embedding:
        ops += EMBEDDING_OPS
    if part.head:
        ops += HEAD_OPS
    return ops


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


def optimizer_ops(model: ModelDesc, part: RankLayers) -> float:
    """aten operators of one optimizer step on one rank."""
    return float(OPTIMIZER_OPS_PER_TENSOR * parameter_tensors(model, part))


__all__ = ["EMBEDDING_OPS", "HEAD_OPS", "LAYER_BACKWARD_OPS", "LAYER_FORWARD_OPS", "OPTIMIZER_OPS_PER_TENSOR",
           "microbatch_ops", "optimizer_ops", "parameter_tensors"]
