"""One pipeline rank's memory, compute and communication: the per-rank half of :func:`~lightning_para.plan.cost.estimate`.

The assumptions are listed in :mod:`lightning_para.plan.cost`; the formulas' sources in
:mod:`~lightning_para.plan.memory` and :mod:`~lightning_para.plan.comm`.

Why this module is long: one rank's price has four parts (resident state, peak memory, compute,
the collectives of every dimension with their overlap), and each mirrors what ParaStrategy does
on that rank, down to which ZeRO-3 unit is gathered how often; split apart, each part would
re-derive the rank's tensors and windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

from lightning_para.parallel.context.ring import score_tile_rows
from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.comm import Collective, collective, per_call_seconds
from lightning_para.plan.layout import Layout
from lightning_para.plan.gemm import model_gemms
from lightning_para.plan.memory import (
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    selective_op_recompute_params,
    zero_state_bytes,
)
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.overhead import (
    TRAFFIC_BY_PRECISION,
    microbatch_dtensor_ops,
    microbatch_ops,
    optimizer_dtensor_ops,
    optimizer_ops,
)
from lightning_para.parallel.pipeline.schedules import compute_order
from lightning_para.plan.pipeline import RankLayers, held_activations_peak, lazy_gradient_peak
from lightning_para.plan.tensors import (
    ParamTensor,
    layer_tensors,
    part_tensors,
    shard_numel,
    total_numel,
)


def bucket_bytes(group_size: int, grad_bytes: int) -> float:
    """Gradient bucket for ZeRO-0/1/2 over ``group_size`` ranks: ``max(40M, 1M * n)`` elements,
    Megatron-LM's rule (``megatron/core/distributed``), so that each ring collective moves enough
    bytes per step to amortize its ``n - 1`` hop latencies. Rendered as ``bucket_size_mb``."""
    return max(40e6, 1e6 * group_size) * grad_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
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
    # peak (measured on an H100, benchmarks/results/gpu_step_model_h100.md). Outside the ZeRO paper's model states.
    master_grads: float = 0.0
    # ParaStrategy's ring attention (cp_method="ring", eager torch code) computes fp32 scores per (query chunk, key
    # chunk) pair in tiles of query rows: two tiles (P and dP) live during a layer's backward, beside what that
    # layer's recomputation brought back (parallel/context/ring.py; the dry run measured them at 131K, cp=16).
    ring_scores: float = 0.0
    # The loss's backward (the last stage, eager torch code): the gradients of the log-probabilities and of the
    # logits, two logits-sized tensors in the activation dtype (one for the vocab-parallel loss, fp32 after an
    # upcast), while the log-probabilities are still saved
    # (measured on an H100: +7.8 GB in bf16-true and +7.9 GB in bf16-mixed at 2 x 8,192 tokens x 128K; the dry run:
    # the same two under FSDP2). By then Lightning's `zero_grad` has freed the last step's gradients, which the
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


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank (every dp/tp/cp rank of a stage looks the same)."""

    pipeline_rank: int
    layers: int
    embedding: bool
    head: bool
    in_flight: float
    memory: MemoryBreakdown
    # What the rank holds between optimizer steps, as ParaStrategy keeps it and
    # `ParaStrategy.memory_breakdown()` measures it (activations and buffers are 0): see `resident_states`.
    resident: MemoryBreakdown
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


def rank_tensors(model: ModelDesc, layout: Layout, part: RankLayers) -> list[ParamTensor]:
    """The parameter tensors one rank of pipeline rank ``part`` holds (local shapes after tp/ep)."""
    # A tied head on another rank than the embedding keeps its own copy (Megatron-LM does too).
    own_matrix = part.head and (not model.tied_embeddings or not part.embedding)
    return part_tensors(
        model, part.layers, embedding=part.embedding, final_norm=part.final_norm, head_matrix=own_matrix,
        tp=layout.tp, ep=layout.ep,
    )


def _rank_params(model: ModelDesc, layout: Layout, part: RankLayers) -> tuple[float, float, float]:
    """``(dense, expert, largest layer)`` parameters on one rank of this pipeline rank's stage."""
    tensors = rank_tensors(model, layout, part)
    dense = total_numel(t for t in tensors if not t.expert)
    expert = total_numel(t for t in tensors if t.expert)
    largest = max((total_numel(layer_tensors(model, i, layout.tp, layout.ep)) for i in part.layers), default=0)
    return float(dense), float(expert), float(largest)


def resident_states(model: ModelDesc, training: Training, layout: Layout, part: RankLayers) -> MemoryBreakdown:
    """Parameters, gradients and optimizer state one rank holds *between* optimizer steps, as
    ParaStrategy keeps them (what ``strategy.memory_breakdown()`` measures after a step).

    It differs from the ZeRO paper's peak (:class:`MemoryBreakdown` of ``memory``) where the
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
    return MemoryBreakdown(params, grads, optimizer + counters, 0.0, 0.0)


def _activation_kwargs(training: Training, layout: Layout) -> tuple[dict, dict]:
    """Keyword arguments of the activation formulas for this layout: ``(every term's, a layer's)``."""
    kwargs = {"tp": layout.tp, "sequence_parallel": layout.sequence_parallel, "cp": layout.cp}
    torch_code = training.activation_profile == "torch"
    # ParaStrategy saves each sublayer's input shard under SP (`sp_save_input_shard`, Megatron-SP) unless
    # activation checkpointing is on (parallelize.py): then "selective" keeps the gathered input.
    gathered = torch_code and (not layout.sp_save_input_shard or layout.activation_checkpointing in ("selective", "selective_op"))
    layer_kwargs = {**kwargs, "sp_saves_gathered_inputs": gathered, "swiglu_tensors": 4 if torch_code else 3,
                    "expert_parallel": layout.ep > 1}
    return kwargs, layer_kwargs


def head_bytes(model: ModelDesc, training: Training, layout: Layout) -> float:
    """The head's (final norm, output projection, loss) activation bytes for one microbatch on one rank: what its
    memory holds and what its traffic is priced per (``TrafficCoefficients.head_per_activation_byte``)."""
    e, torch_code = training.bytes.activation, training.activation_profile == "torch"
    # Autocast runs the cross-entropy in fp32, and so does a loss that casts the logits first (`loss_upcast`);
    # without either (``*-true``) torch's keeps the dtype of the logits.
    logit_bytes = e if torch_code and not training.bytes.autocast and not model.loss_upcast else 4
    held = head_activation_bytes(
        model, training.seq_len, training.micro_batch, activation_bytes=e, logit_bytes=logit_bytes,
        sp_saves_gathered_inputs=torch_code, **_activation_kwargs(training, layout)[0],
    )
    if torch_code and training.bytes.autocast:
        # Measured on an H100 (`benchmarks/gpu_fake_world.py`): under autocast the cross-entropy holds,
        # after the forward, a 16-bit logits-sized tensor besides its fp32 log-probabilities (3.91 GiB at
        # 2 x 8,192 tokens x 128K in bf16-mixed, at 2 and 8 layers; none in bf16-true).
        held += e * training.seq_len / layout.cp * training.micro_batch * model.vocab / layout.tp
    return held


def layer_traffic_basis(model: ModelDesc, training: Training, layout: Layout, index: int) -> float:
    """The activation bytes layer ``index`` keeps for one microbatch without recomputation: what its
    non-matmul traffic is priced per (``TrafficCoefficients.layer_per_activation_byte``)."""
    return layer_activation_bytes(
        model, training.seq_len, training.micro_batch, flash_attention=training.flash_attention,
        activation_bytes=training.bytes.activation, moe_layer=model.is_moe_layer(index),
        **_activation_kwargs(training, layout)[1],
    )


def microbatch_traffic_bytes(model: ModelDesc, training: Training, layout: Layout, part: RankLayers,
                             accumulating: float = 0.0) -> float:
    """Bytes the non-matmul operators of one rank read and write for one microbatch, forward and backward
    (coefficients per precision and their counting in :mod:`lightning_para.plan.overhead`): each layer's
    activations as they would be kept without recomputation (a recomputed forward moves its share, a third,
    once more), the head's, the weight casts, and, for the ``accumulating`` fraction of microbatches that are
    not a step's first (``(m - 1) / m``), the weight gradients added into those held (ZeRO-3: their shards)."""
    rates = TRAFFIC_BY_PRECISION[training.precision]
    layers = sum(layer_traffic_basis(model, training, layout, i) for i in part.layers)
    if layout.activation_checkpointing in ("full", "selective_op"):
        layers *= 4.0 / 3.0  # the forward, replayed
    traffic = rates.layer_per_activation_byte * layers
    layer_params = sum(total_numel(layer_tensors(model, i, layout.tp, layout.ep)) for i in part.layers)
    dense, expert, _ = _rank_params(model, layout, part)
    weight = training.bytes.weight
    traffic += rates.layer_per_param_byte * layer_params * weight
    traffic += rates.embedding_head_per_param_byte * max(0.0, dense + expert - layer_params) * weight
    if part.last_stage:
        traffic += rates.head_per_activation_byte * head_bytes(model, training, layout)
    if accumulating:
        if layout.zero == 3:
            dense, expert = dense / layout.group("dp")[0], expert / layout.group("edp")[0]
        traffic += accumulating * rates.accumulate_per_grad_byte * (dense + expert) * training.bytes.grad
    return traffic


def optimizer_traffic_bytes(model: ModelDesc, training: Training, layout: Layout, part: RankLayers) -> float:
    """Bytes one rank's AdamW step reads and writes: ``optimizer_bytes_per_param`` per element it steps (its
    1/N shard under ZeRO; SGD counted alike, an upper bound)."""
    dense, expert, _ = _rank_params(model, layout, part)
    if layout.zero >= 1:
        dense, expert = dense / layout.group("dp")[0], expert / layout.group("edp")[0]
    return TRAFFIC_BY_PRECISION[training.precision].optimizer_bytes_per_param * (dense + expert)


def _memory(
    model: ModelDesc, training: Training, layout: Layout, part: RankLayers, per_step: int, resident: MemoryBreakdown,
    flushes: int = 1,
) -> MemoryBreakdown:
    """The peak (see :class:`MemoryBreakdown`); ``resident``: :func:`resident_states` of the same rank."""
    dense, expert, largest = _rank_params(model, layout, part)
    precision = training.bytes
    k_bytes = precision.master + training.optimizer_state_bytes
    # Gradients stay whole until reduced: across a pipeline flush (every pipeline engine accumulates its
    # microbatches locally, but ZeRO-2's "reduce_each_microbatch"), and across accumulation steps with "no_sync".
    each_microbatch = layout.reduces_each_microbatch
    full_grads = layout.zero >= 2 and (
        (layout.pp > 1 and not each_microbatch) or (layout.zero_accumulation == "no_sync" and per_step > 1)
    )
    shards = {"dense": layout.group("dp")[0], "expert": layout.group("edp")[0]}
    states = [0.0, 0.0, 0.0]
    for params, n in ((dense, shards["dense"]), (expert, shards["expert"])):
        parts = zero_state_bytes(
            params, zero=layout.zero, shards=n, weight_bytes=precision.weight, grad_bytes=training.grad_bytes,
            optimizer_bytes=k_bytes, full_grads=full_grads,
        )
        states = [a + b for a, b in zip(states, parts, strict=True)]
    buffers = 0.0
    # Autocast's 16-bit copy of a weight, which its matmul saves for backward. Inside a block that recomputes
    # (any `activation_checkpointing`) the copy is not kept: backward casts again. Then only the output
    # projection's copy is (on an H100, rank 0 of ZeRO-3 jobs of Llama 3 8B; on CPU, per layer).
    if not precision.autocast:
        autocast_copies = 0.0
    elif layout.activation_checkpointing and part.layers:
        autocast_copies = 2.0 * model.vocab * model.hidden / layout.tp if part.last_stage else 0.0
    else:
        autocast_copies = 2.0 * (dense + expert)
    if layout.zero == 3:
        # Gathered weights, in the parameters' dtype (fp32 under autocast: FSDP2 gathers what it holds):
        # all of them while "no_sync" keeps them, else the current and the prefetched layer and the units
        # kept gathered for backward (the head, or the grouped embedding, norm and head), plus one layer's
        # unsharded gradients before its reduce-scatter.
        gathered = (dense + expert) if full_grads else 2 * largest + _zero3_kept_ends(model, layout, part)
        buffers = gathered * precision.weight + (0 if full_grads else largest * training.grad_bytes) + autocast_copies
    else:
        buffers = autocast_copies
    kwargs, layer_kwargs = _activation_kwargs(training, layout)
    if precision.autocast:  # the residual stream is in the weights' dtype (`layer_activation_bytes`)
        layer_kwargs = {**layer_kwargs, "residual_bytes": precision.weight}
    s, b, e = training.seq_len, training.micro_batch, precision.activation
    torch_code = training.activation_profile == "torch"
    per_layer = [
        layer_activation_bytes(
            model, s, b, recompute=layout.activation_checkpointing, flash_attention=training.flash_attention,
            activation_bytes=e, moe_layer=model.is_moe_layer(i), **layer_kwargs,
        ) for i in part.layers
    ]
    held = sum(per_layer)
    # torch.distributed.pipelining keeps each chunk's output until its backward (the stage's `fwd_cache`); no
    # layer of the chunk saves it (the dry run's held bytes). Megatron-LM frees the sent output's data
    # (`deallocate_pipeline_outputs`), so its profile does not count it.
    stage_output = e * s / layout.cp * b * model.hidden / (layout.tp if layout.sequence_parallel else 1) \
        if torch_code else 0.0
    held += part.sends_forward * stage_output
    if part.embedding:
        held += embedding_activation_bytes(model, s, b, **kwargs)
    if part.last_stage:
        held += head_bytes(model, training, layout)
    activations, recomputed = part.in_flight * held, 0.0
    # The order this rank runs its forwards and backwards in (one flush; None for the zero-bubble schedules).
    walk = compute_order(layout.schedule, layout.pp, per_step, layout.virtual_stages, part.rank) \
        if layout.pp > 1 and flushes == 1 else None
    # Several chunks per rank (interleaved): they hold different bytes (the embedding's or the head's chunk), and
    # the schedule's order decides how many microbatches of each are held at once: walk it (spread evenly over the
    # chunks, rank 0 of Llama 3 405B at v=8 was 8% over the dry run's walk of the same order).
    chunk_held: Optional[list[float]] = None
    if len(part.chunks) > 1:
        by_layer = dict(zip(part.layers, per_layer))
        chunk_held = [
            sum(by_layer[i] for i in chunk.layers) + chunk.sends_forward * stage_output
            + (embedding_activation_bytes(model, s, b, **kwargs) if chunk.embedding else 0.0)
            + (head_bytes(model, training, layout) if chunk.last_stage else 0.0)
            for chunk in part.chunks
        ]
        if walk is not None:
            activations = held_activations_peak(walk, chunk_held)
    if layout.activation_checkpointing == "full" and part.layers:
        # Backward recomputes one layer at a time: its full activations are live once more.
        recomputed = max(
            layer_activation_bytes(
                model, s, b, flash_attention=training.flash_attention, activation_bytes=e,
                moe_layer=model.is_moe_layer(i), **layer_kwargs,
            ) for i in part.layers
        )
    elif layout.activation_checkpointing == "selective_op" and part.layers:
        # The recomputation of one layer brings back what its policy dropped, until that layer's
        # backward is done: its activations without recomputation, less what stayed kept.
        recomputed = max(
            layer_activation_bytes(
                model, s, b, flash_attention=training.flash_attention, activation_bytes=e,
                moe_layer=model.is_moe_layer(i), **layer_kwargs,
            ) - per_layer[k] for k, i in enumerate(part.layers)
        )
    loss_logits = 0.0
    logit_elements = s / layout.cp * b * model.vocab / layout.tp
    if torch_code and part.last_stage:
        # The training step holds the logits (activation dtype) while the cross-entropy makes its log-probabilities
        # (counted in `head_bytes`); measured on an H100: the forward's peak, 3.9 GiB at 2 x 8,192 tokens x 128K.
        # A loss that casts 16-bit logits to fp32 first (`ModelDesc.loss_upcast`) holds that copy too while it runs.
        loss_logits = (e + (4 if model.loss_upcast and e < 4 else 0)) * logit_elements
        if layout.tp > 1 and layout.loss_parallel:
            # The vocab-parallel log-softmax (torch's `loss_parallel`, run op by op inside DTensor's handler) makes
            # fp32 copies of the local logits: the input cast to fp32 (when it is 16-bit), the max-shifted input and
            # its exp (then the result), before the 16-bit log-probabilities. Measured on an H200
            # (`benchmarks/gpu_fake_world.py --tp 2`): 14 bytes per local logit at the loss's peak in bf16-true,
            # 13.7 GiB at 2 x 8,192 tokens x 64K; a fused single-device kernel makes none of them.
            sixteen_bit_input = e < 4 and not model.loss_upcast and not precision.autocast
            loss_logits += (12 if sixteen_bit_input else 8) * logit_elements
    master_grads = 0.0
    lazy = layout.pp > 1 and not training.persistent_grad_buffer
    if torch_code and lazy:
        # ParaStrategy's pipeline runner sets the last step's gradients aside while the schedule runs (Lightning's
        # `zero_grad` comes after the training step): all of them, as the rank keeps them between steps, are held
        # beside this step's (ZeRO-1/2: shards; ZeRO-0: whole, plus a separate master's fp32 ones).
        master_grads = resident.grads
    elif torch_code and precision.master > 0 and layout.zero < 3:
        master_grads = max(0.0, resident.grads - states[1])  # beyond what the ZeRO paper's peak already holds
    ring_scores = 0.0
    if torch_code and layout.cp > 1 and layout.cp_method == "ring" and part.layers:
        # Two fp32 [b, heads/t, rows, c] tiles (P and dP) of a chunk pair, c = s / cp / 2 with head-tail chunks,
        # rows as the ring itself chooses them.
        chunk = int(s // layout.cp // (2 if layout.cp_load_balance else 1))
        heads = max(1, model.heads // layout.tp)
        ring_scores = 2 * 4.0 * b * heads * score_tile_rows(b, heads, chunk) * chunk
    # The loss's backward (see MemoryBreakdown.loss_backward): with one microbatch per step it finds the last step's
    # gradients freed by `zero_grad`, so of the states only the weights and optimizer state as the rank keeps them
    # between steps (`resident`: FSDP2's fp32 shards, where the paper's peak counts 16-bit weights and gradients);
    # a later microbatch finds this step's accumulated gradients.
    # Counted on meta tensors (the eager ops' own outputs): torch's cross-entropy backward makes two logits-sized
    # gradients (of the log-probabilities, then of the logits), the vocab-parallel one (tp > 1) one, in the loss's
    # dtype (fp32 after an upcast; under autocast the activation dtype's size, as the H100 measured).
    loss_grads = 1 if layout.tp > 1 and layout.loss_parallel else 2
    loss_backward = loss_grads * (4 if model.loss_upcast else e) * logit_elements if loss_logits else 0.0
    freed = 0.0
    if per_step == 1:
        freed = max(0.0, sum(states) + master_grads - resident.params - resident.optimizer)
    stepped = (dense / shards["dense"] + expert / shards["expert"]) if layout.zero >= 1 else dense + expert
    step_temporaries = 4.0 * stepped if training.optimizer == "adam" else 0.0
    if layout.zero in (1, 2) and max(shards.values()) > 1:
        step_temporaries = max(step_temporaries, precision.weight * (dense + expert))  # the updated weights' gather
    optimizer_step_total = resident.params + resident.grads + resident.optimizer + step_temporaries
    not_yet = 0.0
    order = walk if lazy and part.layers else None
    reducing = 0.0
    if each_microbatch:
        # One chunk's whole gradients exist during each of its backwards, until reduce-scattered
        # (`parallel/data/zero.py`); the last bucket may still be on the wire while the next forward runs.
        v = layout.virtual_stages
        chunk_grads = training.grad_bytes * (dense + expert) / v
        if order is not None:
            peak = lazy_gradient_peak(order, _layers_per_chunk(part, v), chunk_held or held / v, chunk_grads,
                                      freed_after_backward=True)
            reducing = max(0.0, peak - activations)
        else:
            reducing = chunk_grads
        n = shards["dense"]
        capacity = layout.bucket_size_mb * 2**20 if layout.bucket_size_mb is not None else bucket_bytes(n, training.grad_bytes)
        reducing += min(capacity, chunk_grads)
    elif order is not None:
        v = layout.virtual_stages
        peak = lazy_gradient_peak(order, _layers_per_chunk(part, v), chunk_held or held / v, states[1] / v)
        not_yet = max(0.0, activations + states[1] - peak)
    breakdown = MemoryBreakdown(states[0], states[1], states[2], activations, buffers, recomputed, loss_logits,
                                master_grads, ring_scores, loss_backward, freed, optimizer_step_total, not_yet, reducing)
    return replace(breakdown, activations=activations + breakdown.transient)


def _layers_per_chunk(part: RankLayers, virtual_stages: int) -> Union[int, list[int]]:
    """Layers in each of the rank's chunks (what `lazy_gradient_peak` spreads a chunk's backward over)."""
    if len(part.chunks) > 1:
        return [max(1, len(chunk.layers)) for chunk in part.chunks]
    return max(1, round(len(part.layers) / virtual_stages))


def _compute_flops(model: ModelDesc, training: Training, layout: Layout, part: RankLayers) -> tuple[float, float]:
    """``(all, attention scores)`` FLOPs of one microbatch, forward and backward, on one rank."""
    tokens = training.micro_batch * training.seq_len / layout.cp
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


def _microbatch_collectives(
    model: ModelDesc, cluster: Cluster, training: Training, layout: Layout, part: RankLayers, per_step: int
) -> list[tuple[Collective, bool]]:
    """tp, ep, cp and pp collectives of one step, each with whether it is on the critical path."""
    e = training.bytes.activation
    tokens = training.micro_batch * training.seq_len / layout.cp
    activation = tokens * model.hidden * e
    full = layout.activation_checkpointing == "full"
    # torchtitan's per-op policy keeps reduce-scatter outputs only: the recomputation runs SP's
    # all-gathers (no SP: the all-reduces) and the MoE all-to-alls again, as full recomputation does.
    op_sac = layout.activation_checkpointing == "selective_op"
    n_moe = sum(model.is_moe_layer(i) for i in part.layers)
    found: list[tuple[Collective, bool]] = []

    def add(dim: str, op: str, what: str, payload: float, calls_per_microbatch: float, critical: bool = True) -> None:
        if calls_per_microbatch > 0 and layout.group(dim)[0] > 1:
            found.append((collective(layout, cluster, dim, op, what, payload, calls_per_microbatch * per_step), critical))

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
        found.append((collective(layout, cluster, "pp", "all_reduce", "step loss", 4, 1), True))
    return found


def _dp_collectives(
    model: ModelDesc, cluster: Cluster, training: Training, layout: Layout, part: RankLayers, flushes: int,
    backward_window: float, forward_window: float, per_step: int = 1,
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
    tensors = rank_tensors(model, layout, part)
    g, w = training.grad_bytes, training.bytes.weight
    each_step = layout.zero_accumulation in ("reduce_each_step", "reduce_each_microbatch") and layout.zero >= 2
    reductions = flushes if each_step else 1
    each_microbatch = layout.reduces_each_microbatch
    if each_microbatch:
        reductions = per_step
    grad_sync: list[Collective] = []
    after_step: list[Collective] = []
    zero3: list[Collective] = []
    for dim, expert in (("dp", False), ("edp", True)):
        group, n = [t for t in tensors if t.expert == expert], layout.group(dim)[0]
        if not group or n == 1:
            continue
        params, padded = total_numel(group), n * shard_numel(group, n)
        capacity = layout.bucket_size_mb * 2**20 if layout.bucket_size_mb is not None else bucket_bytes(n, g)
        buckets = max(1, math.ceil(params * g / capacity))
        if layout.zero == 0:
            grad_sync.append(collective(layout, cluster, dim, "all_reduce", "gradients", params * g / buckets, buckets))
        elif layout.zero < 3:
            # gloo: the bucket is all-reduced in place (its reduce-scatter would send as much, plus a copy).
            op = "all_reduce" if cluster.reduce_scatter_is_all_reduce else "reduce_scatter"
            grad_sync.append(collective(layout, cluster, dim, op, "gradients", padded * g / buckets, buckets * reductions))
            after_step.append(collective(layout, cluster, dim, "all_gather", "updated weights", padded * w / buckets,
                                         buckets))
        else:
            gathered, gathers, units = _zero3_gathers(model, layout, part, expert, n)
            zero3.append(collective(layout, cluster, dim, "all_gather", "weights (forward, backward)",
                                    gathered * w / gathers, gathers * reductions))
            zero3.append(collective(layout, cluster, dim, "reduce_scatter", "gradients", padded * g / units,
                                    units * reductions))
    if layout.dp_replicate > 1:
        dense = total_numel(t for t in tensors if not t.expert)
        expert_params = total_numel(t for t in tensors if t.expert)
        shard = (dense / layout.group("dp")[0] + expert_params / max(1, layout.group("edp")[0])) * g
        grad_sync.append(collective(layout, cluster, "dp_replicate", "all_reduce", "gradient shards", shard, reductions))
    exposed: list[Collective] = []
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


def _zero3_ends(model: ModelDesc, layout: Layout, part: RankLayers) -> tuple[list[ParamTensor], bool]:
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


def _zero3_gathers(model: ModelDesc, layout: Layout, part: RankLayers, expert: bool, n: int) -> tuple[int, int, int]:
    """``(elements gathered, all-gathers, units)`` per ZeRO-3 step on one rank, as
    ``parallel/data/fsdp.py`` shards (padding included; ``expert``: the expert units over edp).

    Blocks gather for forward and again for backward, except the last block, which stays gathered;
    the embedding and the head (tied or not) are gathered once (the embedding's backward needs no
    weight, the head stays gathered); grouped or a unit each (:func:`_zero3_ends`).
    """
    tp, ep = layout.tp, layout.ep
    if expert:  # one expert unit per MoE layer, resharded after forward like any block
        tensors = [t for i in part.layers for t in layer_tensors(model, i, tp, ep) if t.expert]
        units = sum(1 for i in part.layers if any(t.expert for t in layer_tensors(model, i, tp, ep)))
        return 2 * n * shard_numel(tensors, n), 2 * units, units
    layers = [[t for t in layer_tensors(model, i, tp, ep) if not t.expert] for i in part.layers]
    ends, grouped = _zero3_ends(model, layout, part)
    twice = [t for layer in layers[:-1] for t in layer]
    once = (layers[-1] if layers else []) + ends
    end_units = (1 if grouped else int(part.embedding) + int(part.head or part.final_norm)) if ends else 0
    units = len(layers) + end_units
    gathers = 2 * max(0, len(layers) - 1) + int(bool(layers)) + end_units
    return n * (2 * shard_numel(twice, n) + shard_numel(once, n)), gathers, units


def _zero3_kept_ends(model: ModelDesc, layout: Layout, part: RankLayers) -> float:
    """Parameters outside the blocks that ZeRO-3 holds gathered from forward to backward: all of
    them when they form one grouped unit, else the head and final norm."""
    ends, grouped = _zero3_ends(model, layout, part)
    return float(total_numel(ends if grouped else (t for t in ends if not t.name.startswith("embedding"))))


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


def price_rank(
    model: ModelDesc, cluster: Cluster, training: Training, layout: Layout, part: RankLayers, per_step: int,
    flushes: int = 1,
) -> RankEstimate:
    """Memory, compute and communication of one pipeline rank ``part`` for one optimizer step of
    ``per_step`` microbatches in ``flushes`` pipeline flushes (accumulation steps; overlap rules in
    :mod:`lightning_para.plan.cost`). ``training.micro_batch`` must be resolved (an int)."""
    resident = resident_states(model, training, layout, part)
    flops, score_flops = _compute_flops(model, training, layout, part)
    tokens = training.micro_batch * training.seq_len / layout.cp
    speed = cluster.peak_flops * cluster.matmul_efficiency(tokens, model_gemms(model, tokens, layout.tp, layout.ep))
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
        accumulating = (per_step - 1) / per_step
        traffic = microbatch_traffic_bytes(model, training, layout, part, accumulating)
        compute += traffic / cluster.elementwise_bandwidth / compute_speedup(layout)
        optimizer_seconds += optimizer_traffic_bytes(model, training, layout, part) / cluster.elementwise_bandwidth
    critical = 0.0
    collectives: list[Collective] = []
    cp_seconds = 0.0
    for item, on_path in _microbatch_collectives(model, cluster, training, layout, part, per_step):
        if item.dim == "cp" and item.op == "send_recv":  # ring hops overlap blockwise attention; all-to-alls do not
            cp_seconds += item.seconds
            collectives.append(item)
            continue
        item = item.exposed(item.seconds if on_path else 0.0)
        critical += item.exposed_seconds
        collectives.append(item)
    if cp_seconds:
        # Ring attention overlaps its exchanges with the blockwise attention of the step.
        spare = max(0.0, cp_seconds - per_step * score_flops / speed)
        collectives = [c.exposed(spare * c.seconds / cp_seconds) if c.dim == "cp" else c for c in collectives]
        critical += spare
    backward_share = 0.75 if layout.activation_checkpointing == "full" else 2.0 / 3.0
    dp_items, dp_exposed = _dp_collectives(
        model, cluster, training, layout, part, flushes, backward_share * compute, (1 - backward_share) * compute,
        per_step,
    )
    return RankEstimate(
        pipeline_rank=part.rank, layers=len(part.layers), embedding=part.embedding, head=part.head,
        in_flight=part.in_flight, memory=_memory(model, training, layout, part, per_step, resident, flushes),
        resident=resident, collectives=tuple(collectives + dp_items), compute_seconds=compute,
        microbatch_seconds=compute + critical / per_step, dp_exposed_seconds=dp_exposed,
        optimizer_seconds=optimizer_seconds,
    )
