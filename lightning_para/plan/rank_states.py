"""What one pipeline rank holds: its parameter tensors (local shapes after tp/ep), the states it keeps between
optimizer steps (:func:`resident_states`), and the planner's record of a rank's memory (:class:`PredictedMemory`,
the predicted record the dry run and the profiler compare their measurements with)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PredictedMemory:
    """Bytes one rank holds at its peak."""

    params: float
    grads: float
    optimizer: float  # fp32 masters and optimizer state
    activations: float
    buffers: float  # ZeRO-3 gathered weights, autocast's 16-bit weight copies
    # Of `activations`: the larger of two transients (`transient`), what recomputing one layer in backward brings
    # back ("full", "selective_op"; else 0) and the logits the training step holds while the loss runs (the last
    # stage, eager torch code); the rest is what the in-flight microbatches hold when their forwards are done
    # (what the dry run measures).
    recomputed: float = 0.0
    loss_logits: float = 0.0
    # ParaStrategy's separate fp32 master (bf16-true, 16-true; ZeRO 0-2) keeps its fp32 gradient of the last step
    # beside the 16-bit one until `zero_grad`, which Lightning calls after the forward: both are held at the forward's
    # peak (docs/planner.md, "Memory terms"). Outside the ZeRO paper's model states.
    master_grads: float = 0.0
    # ParaStrategy's ring attention (cp_method="ring", eager torch code) computes fp32 scores per (query chunk, key
    # chunk) pair in tiles of query rows: two tiles (P and dP) live during a layer's backward, beside what that
    # layer's recomputation brought back (parallel/context/ring.py).
    ring_scores: float = 0.0
    # The loss's backward (the last stage, eager torch code): the gradients of the log-probabilities and of the
    # logits, two logits-sized tensors in the activation dtype (one for the vocab-parallel loss, fp32 after an
    # upcast), while the log-probabilities are still saved (docs/planner.md, "Memory terms"). By then Lightning's `zero_grad` has freed the last step's gradients, which the
    # forward's peak holds, unless this step's earlier microbatches have accumulated their own
    # (`loss_backward_freed`: the gradient bytes not held then).
    loss_backward: float = 0.0
    loss_backward_freed: float = 0.0
    # The optimizer step, when the activations are gone (`optimizer_step_total`): the states as the rank keeps them
    # between steps (`resident`: ZeRO-1/2 hold gradient shards by then), plus the larger of AdamW's multi-tensor
    # temporaries (torch's default on a GPU: an fp32 copy of every element the rank steps, `_foreach_sqrt` of the
    # second moments) and ZeRO-1/2's gather of the updated weights (one receive buffer of all of them, in the
    # weights' dtype). Counted by the dry run; the peak where the states outweigh the activations (short sequences,
    # an MoE rank's experts).
    optimizer_step_total: float = 0.0
    # A pipeline rank's gradients come into being chunk by chunk, at each chunk's first backward of the step
    # (autograd allocates `.grad` after `zero_grad(set_to_none=True)`): at the peak of activations plus gradients
    # (`plan.pipeline.lazy_gradient_peak` walks the schedule's order) these bytes of `grads` do not exist yet.
    # GPipe, and an interleaved schedule whose warm-up covers every microbatch (the Llama 3 16K-GPU rows), peak
    # when every forward is done and before most gradients exist. 0 without a pipeline, with accumulation over
    # several flushes, for the zero-bubble schedules and under `Training.persistent_grad_buffer`.
    grads_not_yet_allocated: float = 0.0
    # ZeRO-2's "reduce_each_microbatch" under a pipeline: one chunk's whole gradients during its backward, until
    # reduce-scattered, beyond the activations its backward has freed by then, plus the last bucket still on the
    # wire (`lazy_gradient_peak(freed_after_backward=True)`); a transient of backward, with a layer's recomputation.
    reducing: float = 0.0

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer state: the ZeRO paper's "model states"."""
        return self.params + self.grads + self.optimizer

    @property
    def held_grads(self) -> float:
        """Gradient bytes at the peak: the ZeRO paper's plus a separate master's fp32 gradients (or the last step's
        set aside under a pipeline), less those this step's schedule has not made yet."""
        return self.grads + self.master_grads - self.grads_not_yet_allocated

    @property
    def transient(self) -> float:
        """The peak's transient part of ``activations``: one layer's recomputation (with ring attention's score
        blocks and a chunk's gradients being reduced in its backward), the loss's logits, or the loss's backward
        less the gradients it finds freed."""
        return max(self.recomputed + self.ring_scores + self.reducing, self.loss_logits,
                   self.loss_backward - self.loss_backward_freed)

    @property
    def total(self) -> float:
        """The peak: the forward and backward's (model states, activations, gathered buffers), or the optimizer
        step's (``optimizer_step_total``), which comes after the activations are freed."""
        during_step = self.params + self.held_grads + self.optimizer + self.activations + self.buffers
        return max(during_step, self.optimizer_step_total)


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
    return PredictedMemory(params, grads, optimizer + counters, 0.0, 0.0)


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
    "PredictedMemory", "bucket_bytes", "rank_params", "rank_tensors", "resident_states", "zero3_ends", "zero3_kept_ends",
]
