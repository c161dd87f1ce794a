"""What one pipeline rank holds: its parameter tensors (local shapes after tp/ep), the states it keeps between
optimizer steps (:func:`resident_states`, a :class:`~lightning_para.memory.PredictedMemory`, the predicted record the
dry run and the profiler compare their measurements with)."""

from __future__ import annotations

from lightning_para.spec.memory import PredictedMemory
from lightning_para.plan.cluster import Training
from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import RankLayers
from lightning_para.plan.tensors import ParamTensor, layer_tensors, part_tensors, shard_numel, total_numel


def bucket_bytes(group_size: int, grad_bytes: int) -> float:
    """Gradient bucket for ZeRO-0/1/2 over ``group_size`` ranks: ``max(40M, 1M * n)`` elements,
    Megatron-LM's rule (``megatron/core/distributed``), so that each ring collective moves enough
    bytes per step to amortize its ``n - 1`` hop latencies. Rendered as ``bucket_size_mb``."""
    return max(40e6, 1e6 * group_size) * grad_bytes


def rank_tensors(model: ModelDesc, layout: Layout, part: RankLayers) -> list[ParamTensor]:
    """The parameter tensors one rank of pipeline rank ``part`` holds (local shapes after tp/ep)."""
    # A tied head on another rank than the embedding keeps its own copy (Megatron-LM does too).
    own_matrix = part.head and (not model.tied_embeddings or not part.embedding)
    return part_tensors(
        model, part.layers, embedding=part.embedding, final_norm=part.final_norm, head_matrix=own_matrix,
        tp=layout.tp, ep=layout.ep,
    )


def rank_params(model: ModelDesc, layout: Layout, part: RankLayers) -> tuple[float, float, float]:
    """``(dense, expert, largest layer)`` parameters on one rank of this pipeline rank's stage."""
    tensors = rank_tensors(model, layout, part)
    dense = total_numel(t for t in tensors if not t.expert)
    expert = total_numel(t for t in tensors if t.expert)
    largest = max((total_numel(layer_tensors(model, i, layout.tp, layout.ep)) for i in part.layers), default=0)
    return float(dense), float(expert), float(largest)


def resident_states(model: ModelDesc, training: Training, layout: Layout, part: RankLayers) -> PredictedMemory:
    """Parameters, gradients and optimizer state one rank holds *between* optimizer steps, as
    ParaStrategy keeps them (what ``strategy.memory_breakdown()`` measures after a step).

    It differs from the ZeRO paper's peak (:class:`PredictedMemory` of ``memory``) where the
    implementation frees or re-types tensors once a step is done:

    * ZeRO-1 and 2 keep only the reduced gradient *shard* (the full gradients are freed into the
      reduce-scatter buckets), in the dtype of the optimizer's tensor: fp32;
    * a separate fp32 master (``bf16-true``, ``16-true``) holds the fp32 gradient, and the model's
      ``p.grad`` shows the reduced 16-bit gradient beside it until the next backward
      (``ZeroDataParallel._finish``: the bucket's reduced shard under ZeRO-1/2, the whole reduced
      bucket under ZeRO-0), so such a rank holds ``4 + 2`` gradient bytes per element it steps
      (the dry run counts these 6 bytes: tests/unit/test_dryrun.py); without a
      separate master (``32-true``, ``*-mixed``) a ZeRO-1/2 master is a view of the parameter's own
      rows and its gradient is the one shown (no extra bytes);
    * ZeRO-3 (FSDP2) keeps its sharded parameters in fp32 (they are the master), gradients too;
    * shards are ``ceil(rows / N)`` rows of each tensor, padding included (:mod:`.tensors`);
    * Adam keeps a 4-byte ``step`` tensor per parameter tensor next to its two moments.
    """
    tensors = rank_tensors(model, layout, part)
    precision = training.bytes
    separate_master = precision.master > 0 and layout.zero < 3
    fp32, state = 4, training.optimizer_state_bytes
    counters = 4 * len(tensors) if training.optimizer == "adam" else 0
    params = grads = optimizer = 0.0
    for expert, dim in ((False, "dp"), (True, "edp")):
        group = [t for t in tensors if t.expert == expert]
        if not group:
            continue
        full, shard = total_numel(group), shard_numel(group, layout.group(dim)[0])
        held = shard if layout.zero >= 1 else full  # what the optimizer steps on this rank
        if layout.zero == 3:
            params += fp32 * shard
            grads += fp32 * shard
        else:
            params += precision.weight * full
            if separate_master:  # the master's fp32 gradient and the 16-bit one `p.grad` shows
                grads += (fp32 + precision.grad) * held
            else:
                grads += (fp32 if layout.zero >= 1 else precision.grad) * held
        optimizer += state * held + (precision.master * held if separate_master else 0)
    return PredictedMemory(params, grads, optimizer + counters)


def zero3_ends(model: ModelDesc, layout: Layout, part: RankLayers) -> tuple[list[ParamTensor], bool]:
    """The tensors outside the blocks (embedding, final norm, head; tied or not) and whether they
    form one grouped unit: always under ``zero3_units="blocks"``, never under ``"blocks_and_ends"``,
    and under ``"auto"`` when they hold no more than the largest block, experts included
    (``parallel/data/fsdp.py``'s rule, on the same local sizes)."""
    layers = [layer_tensors(model, i, layout.tp, layout.ep) for i in part.layers]
    in_layers = {t for layer in layers for t in layer}
    ends = [t for t in rank_tensors(model, layout, part) if t not in in_layers]
    if layout.zero3_units != "auto":  # the user's choice: "blocks" groups the ends, "blocks_and_ends" does not
        return ends, layout.zero3_units == "blocks"
    grouped = bool(layers) and total_numel(ends) <= max(total_numel(layer) for layer in layers)
    return ends, grouped


def zero3_kept_ends(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """Parameters outside the blocks that ZeRO-3 holds gathered from forward to backward: all of
    them when they form one grouped unit, else the head and final norm."""
    ends, grouped = zero3_ends(model, layout, part)
    return float(total_numel(ends if grouped else (t for t in ends if not t.name.startswith("embedding"))))


__all__ = [
    "bucket_bytes", "rank_params", "rank_tensors", "resident_states", "zero3_ends", "zero3_kept_ends",
]
