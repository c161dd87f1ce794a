"""One pipeline rank's memory at its peak (:func:`peak_memory`, the
:class:`~lightning_para.memory.PredictedMemory` the planner predicts), each term mirroring what
ParaStrategy's code holds on that rank. The measurements behind the terms are in ``docs/planner.md`` ("Memory terms")."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

from lightning_para.spec.tiles import score_tile_rows
from lightning_para.spec.zero import zero_state_bytes
from lightning_para.plan.cluster import Training
from lightning_para.plan.layout import Layout
from lightning_para.plan.memory import embedding_activation_bytes, head_activation_bytes, layer_activation_bytes
from lightning_para.spec.memory import PredictedMemory
from lightning_para.spec.schedules import compute_order
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import RankLayers, held_activations_peak, lazy_gradient_peak
from lightning_para.plan.rank_states import (
    bucket_bytes,
    rank_params,
    zero3_kept_ends,
)


def activation_kwargs(training: Training, layout: Layout) -> tuple[dict, dict]:
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
        sp_saves_gathered_inputs=torch_code, **activation_kwargs(training, layout)[0],
    )
    if torch_code and training.bytes.autocast:
        # Under autocast the cross-entropy holds, after the forward, a 16-bit logits-sized tensor besides its fp32
        # log-probabilities (none in bf16-true; docs/planner.md, "Memory terms").
        held += e * training.seq_len / layout.cp * training.micro_batch * model.vocab / layout.tp
    return held


def peak_memory(
    model: ModelDesc, training: Training, layout: Layout, part: RankLayers, per_step: int, resident: PredictedMemory,
    flushes: int = 1,
) -> PredictedMemory:
    """The peak (see :class:`PredictedMemory`); ``resident``: :func:`resident_states` of the same rank."""
    dense, expert, largest = rank_params(model, layout, part)
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
    # projection's copy is (docs/planner.md, "Memory terms").
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
        gathered = (dense + expert) if full_grads else 2 * largest + zero3_kept_ends(model, layout, part)
        buffers = gathered * precision.weight + (0 if full_grads else largest * training.grad_bytes) + autocast_copies
    else:
        buffers = autocast_copies
    kwargs, layer_kwargs = activation_kwargs(training, layout)
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
    logit_elements = s / layout.cp * b * model.vocab / layout.tp
    # Likewise the last chunk's output, the logits, under torch's pipeline schedule: the loss runs on it right after
    # the forward, and the stage keeps it until its backward. (Without a pipeline the training step drops it once
    # the loss has its log-probabilities: the transient `loss_logits`.)
    stage_logits = e * logit_elements if torch_code and layout.pp > 1 else 0.0
    if part.last_stage:
        held += stage_logits
    if part.embedding:
        held += embedding_activation_bytes(model, s, b, **kwargs)
    if part.last_stage:
        held += head_bytes(model, training, layout)
    activations, recomputed = part.in_flight * held, 0.0
    # The order this rank runs its forwards and backwards in (one flush; None for the zero-bubble schedules).
    walk = compute_order(layout.schedule, layout.pp, per_step, layout.virtual_stages, part.rank) \
        if layout.pp > 1 and flushes == 1 else None
    # Several chunks per rank (interleaved): they hold different bytes (the embedding's or the head's chunk), and
    # the schedule's order decides how many microbatches of each are held at once: walk it (spreading them evenly
    # over the chunks overestimates: docs/planner.md, "Memory terms").
    chunk_held: Optional[list[float]] = None
    if len(part.chunks) > 1:
        by_layer = dict(zip(part.layers, per_layer))
        chunk_held = [
            sum(by_layer[i] for i in chunk.layers) + chunk.sends_forward * stage_output
            + (embedding_activation_bytes(model, s, b, **kwargs) if chunk.embedding else 0.0)
            + (head_bytes(model, training, layout) + stage_logits if chunk.last_stage else 0.0)
            for chunk in part.chunks
        ]
        if walk is not None:
            activations = held_activations_peak(walk, chunk_held)
    # What torch's stage keeps of a microbatch until that microbatch's backward is done (its output: the activation
    # it sent, or the logits): constant through the backward, not freed layer by layer as the gradient walks below
    # take the rest of the held bytes to be.
    kept = part.sends_forward * stage_output + (stage_logits if part.last_stage else 0.0)
    walk_held, walk_chunk_held = held - kept, None
    walk_activations = part.in_flight * walk_held
    if chunk_held is not None:
        walk_chunk_held = [
            h - chunk.sends_forward * stage_output - (stage_logits if chunk.last_stage else 0.0)
            for h, chunk in zip(chunk_held, part.chunks)
        ]
        if walk is not None:
            walk_activations = held_activations_peak(walk, walk_chunk_held)
    # torch's pipeline stage allocates a receive buffer per microbatch of the flush when it sets up, held through
    # the whole step (added after the gradient walks below, which it does not move): one for the input of each
    # chunk fed by another rank, one for the output gradient of each chunk that feeds another rank, both of the
    # stage output's size and dtype.
    receive_buffers = (part.sends_forward + part.sends_backward) * (per_step // flushes) * stage_output \
        if torch_code and layout.pp > 1 else 0.0
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
    if torch_code and part.last_stage:
        # The training step holds the logits (activation dtype) while the cross-entropy makes its log-probabilities
        # (counted in `head_bytes`): the forward's peak on the last stage (docs/planner.md, "Memory terms").
        # A loss that casts 16-bit logits to fp32 first (`ModelDesc.loss_upcast`) holds that copy too while it runs.
        loss_logits = (e + (4 if model.loss_upcast and e < 4 else 0)) * logit_elements - stage_logits
        if layout.tp > 1 and layout.loss_parallel:
            # The vocab-parallel log-softmax (torch's `loss_parallel`, run op by op inside DTensor's handler) makes
            # fp32 copies of the local logits: the input cast to fp32 (when it is 16-bit), the max-shifted input and
            # its exp (then the result), before the 16-bit log-probabilities: 14 bytes per local logit at the loss's
            # peak in bf16-true (docs/planner.md, "Memory terms"); a fused single-device kernel makes none of them.
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
    # The loss's backward (see PredictedMemory.loss_backward): with one microbatch per step it finds the last step's
    # gradients freed by `zero_grad`, so of the states only the weights and optimizer state as the rank keeps them
    # between steps (`resident`: FSDP2's fp32 shards, where the paper's peak counts 16-bit weights and gradients);
    # a later microbatch finds this step's accumulated gradients.
    # Counted on meta tensors (the eager ops' own outputs): torch's cross-entropy backward makes two logits-sized
    # gradients (of the log-probabilities, then of the logits), the vocab-parallel one (tp > 1) one, in the loss's
    # dtype (fp32 after an upcast; under autocast the activation dtype's size).
    loss_grads = 1 if layout.tp > 1 and layout.loss_parallel else 2
    loss_backward = loss_grads * (4 if model.loss_upcast else e) * logit_elements if torch_code and part.last_stage else 0.0
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
            peak = lazy_gradient_peak(order, layers_per_chunk(part, v), walk_chunk_held or walk_held / v, chunk_grads,
                                      freed_after_backward=True)
            reducing = max(0.0, peak - walk_activations)
        else:
            reducing = chunk_grads
        n = shards["dense"]
        capacity = layout.bucket_size_mb * 2**20 if layout.bucket_size_mb is not None else bucket_bytes(n, training.grad_bytes)
        reducing += min(capacity, chunk_grads)
    elif order is not None:
        v = layout.virtual_stages
        peak = lazy_gradient_peak(order, layers_per_chunk(part, v), walk_chunk_held or walk_held / v, states[1] / v)
        not_yet = max(0.0, walk_activations + states[1] - peak)
    activations += receive_buffers
    breakdown = PredictedMemory(states[0], states[1], states[2], activations, buffers, recomputed, loss_logits,
                                master_grads, ring_scores, loss_backward, freed, optimizer_step_total, not_yet, reducing)
    return replace(breakdown, activations=activations + breakdown.transient)


def layers_per_chunk(part: RankLayers, virtual_stages: int) -> Union[int, list[int]]:
    """Layers in each of the rank's chunks (what `lazy_gradient_peak` spreads a chunk's backward over)."""
    if len(part.chunks) > 1:
        return [max(1, len(chunk.layers)) for chunk in part.chunks]
    return max(1, round(len(part.layers) / virtual_stages))


__all__ = ["activation_kwargs", "head_bytes", "layers_per_chunk", "peak_memory"]
