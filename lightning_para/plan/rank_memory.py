"""One pipeline rank's memory at its peak (:func:`peak_memory`, the :class:`~lightning_para.spec.memory.PredictedMemory`
the planner predicts), each term mirroring what ParaStrategy's code holds on that rank, read off one resolved
:class:`~lightning_para.plan.shape.RankShape`. The measurements behind the terms are in ``docs/planner.md`` ("Memory
terms")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from lightning_para.plan.cluster import Training
from lightning_para.plan.layout import Layout
from lightning_para.plan.memory import embedding_activation_bytes, head_activation_bytes, layer_activation_bytes
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import RankLayers, held_activations_peak, lazy_gradient_peak
from lightning_para.plan.shape import RankShape, activation_kwargs, bucket_bytes, zero3_kept_ends
from lightning_para.plan.tensors import muon_steps, total_numel
from lightning_para.spec.memory import PredictedMemory
from lightning_para.spec.schedules import compute_order
from lightning_para.spec.tiles import score_tile_rows
from lightning_para.spec.zero import zero_state_bytes


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


@dataclass(frozen=True)
class Held:
    """What one microbatch leaves held on a rank until its backward: each layer's saved bytes (``per_layer``), the
    stage's output torch's pipeline keeps (``stage_output`` per boundary sent, ``stage_logits`` on the last stage),
    the total and, with several chunks, each chunk's; ``kept`` of it stays until the microbatch's backward is done."""

    per_layer: tuple[float, ...]
    stage_output: float
    stage_logits: float
    logit_elements: float
    total: float
    chunks: Optional[tuple[float, ...]]
    kept: float


def _held(shape: RankShape) -> Held:
    model, training, layout, part = shape.model, shape.training, shape.layout, shape.part
    kwargs, layer_kwargs = shape.activation_kwargs
    if training.bytes.autocast:  # the residual stream is in the weights' dtype (`layer_activation_bytes`)
        layer_kwargs = {**layer_kwargs, "residual_bytes": training.bytes.weight}
    s, b, e = training.seq_len, training.micro_batch, training.bytes.activation
    per_layer = tuple(layer_activation_bytes(
        model, s, b, recompute=layout.activation_checkpointing, flash_attention=training.flash_attention,
        activation_bytes=e, moe_layer=model.is_moe_layer(i), **layer_kwargs) for i in part.layers)
    # torch.distributed.pipelining keeps each chunk's output until its backward (the stage's `fwd_cache`); no
    # layer of the chunk saves it (the dry run's held bytes). Megatron-LM frees the sent output's data
    # (`deallocate_pipeline_outputs`), so its profile does not count it.
    sp = layout.tp if layout.sequence_parallel else 1
    stage_output = e * s / layout.cp * b * model.hidden / sp if shape.torch_code else 0.0
    logit_elements = s / layout.cp * b * model.vocab / layout.tp
    # Likewise the last chunk's output, the logits, under torch's pipeline schedule: the loss runs on it right after
    # the forward, and the stage keeps it until its backward. (Without a pipeline the training step drops it once
    # the loss has its log-probabilities: the transient `loss_logits`.)
    stage_logits = e * logit_elements if shape.torch_code and layout.pp > 1 else 0.0
    embedding = embedding_activation_bytes(model, s, b, **kwargs)
    head = head_bytes(model, training, layout)

    def chunk_bytes(layers: tuple[int, ...], sends: float, first: bool, last: bool) -> float:
        by_layer = dict(zip(part.layers, per_layer))
        return sum(by_layer[i] for i in layers) + sends * stage_output + (embedding if first else 0.0) \
            + (head + stage_logits if last else 0.0)

    total = sum(per_layer) + part.sends_forward * stage_output + (stage_logits if part.last_stage else 0.0) \
        + (embedding if part.embedding else 0.0) + (head if part.last_stage else 0.0)
    chunks = tuple(chunk_bytes(c.layers, c.sends_forward, c.embedding, c.last_stage) for c in part.chunks) \
        if len(part.chunks) > 1 else None
    kept = part.sends_forward * stage_output + (stage_logits if part.last_stage else 0.0)
    return Held(per_layer, stage_output, stage_logits, logit_elements, total, chunks, kept)


def _in_flight(shape: RankShape, held: Held, walk: Optional[tuple]) -> tuple[float, float, Optional[list[float]]]:
    """``(activations, walked, walked per chunk)``: what the in-flight microbatches hold at the forwards' peak, and
    the same less what torch's stage keeps of each until its backward is done (constant through the backward, not
    freed layer by layer as the gradient walks take the rest of the held bytes to be)."""
    part = shape.part
    activations = part.in_flight * held.total
    walked, walked_chunks = part.in_flight * (held.total - held.kept), None
    if held.chunks is not None:
        # Several chunks per rank (interleaved) hold different bytes (the embedding's or the head's chunk), and the
        # schedule's order decides how many microbatches of each are held at once: walk it (spreading them evenly
        # over the chunks overestimates: docs/planner.md, "Memory terms").
        walked_chunks = [h - c.sends_forward * held.stage_output - (held.stage_logits if c.last_stage else 0.0)
                         for h, c in zip(held.chunks, part.chunks)]
        if walk is not None:
            activations = held_activations_peak(walk, held.chunks)
            walked = held_activations_peak(walk, walked_chunks)
    return activations, walked, walked_chunks


def _recomputed(shape: RankShape, held: Held) -> float:
    """What recomputing one layer in backward brings back: its full activations once more ("full"), or what its
    policy dropped until that layer's backward is done ("selective_op")."""
    model, training, layout, part = shape.model, shape.training, shape.layout, shape.part
    if layout.activation_checkpointing not in ("full", "selective_op") or not part.layers:
        return 0.0
    layer_kwargs = shape.activation_kwargs[1]
    if training.bytes.autocast:
        layer_kwargs = {**layer_kwargs, "residual_bytes": training.bytes.weight}
    whole = [layer_activation_bytes(
        model, training.seq_len, training.micro_batch, flash_attention=training.flash_attention,
        activation_bytes=training.bytes.activation, moe_layer=model.is_moe_layer(i), **layer_kwargs,
    ) for i in part.layers]
    if layout.activation_checkpointing == "full":
        return max(whole)
    return max(w - kept for w, kept in zip(whole, held.per_layer))


def _loss_terms(shape: RankShape, held: Held) -> tuple[float, float]:
    """``(loss_logits, loss_backward)``: see :class:`PredictedMemory`."""
    model, training, layout = shape.model, shape.training, shape.layout
    if not (shape.torch_code and shape.part.last_stage):
        return 0.0, 0.0
    e = training.bytes.activation
    # The training step holds the logits (activation dtype) while the cross-entropy makes its log-probabilities
    # (counted in `head_bytes`): the forward's peak on the last stage (docs/planner.md, "Memory terms").
    # A loss that casts 16-bit logits to fp32 first (`ModelDesc.loss_upcast`) holds that copy too while it runs.
    loss_logits = (e + (4 if model.loss_upcast and e < 4 else 0)) * held.logit_elements - held.stage_logits
    vocab_parallel = layout.tp > 1 and layout.loss_parallel
    if vocab_parallel:
        # The vocab-parallel log-softmax (torch's `loss_parallel`, run op by op inside DTensor's handler) makes
        # fp32 copies of the local logits: the input cast to fp32 (when it is 16-bit), the max-shifted input and
        # its exp (then the result), before the 16-bit log-probabilities: 14 bytes per local logit at the loss's
        # peak in bf16-true (docs/planner.md, "Memory terms"); a fused single-device kernel makes none of them.
        sixteen_bit_input = e < 4 and not model.loss_upcast and not training.bytes.autocast
        loss_logits += (12 if sixteen_bit_input else 8) * held.logit_elements
    # Counted on meta tensors (the eager ops' own outputs): torch's cross-entropy backward makes two logits-sized
    # gradients (of the log-probabilities, then of the logits), the vocab-parallel one (tp > 1) one, in the loss's
    # dtype (fp32 after an upcast; under autocast the activation dtype's size).
    loss_backward = (1 if vocab_parallel else 2) * (4 if model.loss_upcast else e) * held.logit_elements
    return loss_logits, loss_backward


def _states(shape: RankShape) -> tuple[list[float], bool]:
    """The ZeRO paper's model states ``[weights, gradients, optimizer]`` and whether gradients stay whole until
    reduced: across a pipeline flush (every pipeline engine accumulates its microbatches locally, but ZeRO-2's
    "reduce_each_microbatch"), and across accumulation steps with "no_sync"."""
    training, layout = shape.training, shape.layout
    full_grads = layout.zero >= 2 and ((layout.pp > 1 and not layout.reduces_each_microbatch)
                                       or (layout.zero_accumulation == "no_sync" and shape.per_step > 1))
    states = [0.0, 0.0, 0.0]
    for expert, params, n in zip((False, True), (shape.dense, shape.expert), shape.shards):
        state = training.optimizer_state_bytes
        if training.optimizer == "muon":  # AdamW's second moment for what Muon does not step
            group = [t for t in shape.tensors if t.expert == expert]
            state += 4 * total_numel([t for t in group if not muon_steps(t)]) / max(1, total_numel(group))
        parts = zero_state_bytes(
            params, zero=layout.zero, shards=n, weight_bytes=training.bytes.weight, grad_bytes=training.grad_bytes,
            optimizer_bytes=training.bytes.master + state, full_grads=full_grads,
        )
        states = [a + b for a, b in zip(states, parts, strict=True)]
    return states, full_grads


def _buffers(shape: RankShape, full_grads: bool) -> float:
    """ZeRO-3's gathered weights, autocast's 16-bit weight copies and Muon's routing index."""
    training, layout, precision = shape.training, shape.layout, shape.training.bytes
    # Muon's owners keep an int64 index per element of the matrices they own where pieces arrive out of row-major
    # order (`optim/routing.py`: tp's row-parallel and strided shards), priced as all of them; a rank owns about
    # its share of the matrices it holds.
    muon = [t for t in shape.tensors if not t.expert and muon_steps(t)] if training.optimizer == "muon" else []
    index = 8.0 * total_numel(muon) / (shape.shards[0] if layout.zero >= 1 else 1) if layout.tp > 1 else 0.0
    # Autocast's 16-bit copy of a weight, which its matmul saves for backward. Inside a block that recomputes
    # (any `activation_checkpointing`) the copy is not kept: backward casts again. Then only the output
    # projection's copy is (docs/planner.md, "Memory terms").
    if not precision.autocast:
        autocast_copies = 0.0
    elif layout.activation_checkpointing and shape.part.layers:
        autocast_copies = 2.0 * shape.model.vocab * shape.model.hidden / layout.tp if shape.part.last_stage else 0.0
    else:
        autocast_copies = 2.0 * (shape.dense + shape.expert)
    if layout.zero != 3:
        return autocast_copies + index
    # Gathered weights, in the parameters' dtype (fp32 under autocast: FSDP2 gathers what it holds): all of them
    # while "no_sync" keeps them, else the current and the prefetched layer and the units kept gathered for backward
    # (the head, or the grouped embedding, norm and head), plus one layer's unsharded gradients before its
    # reduce-scatter.
    gathered = (shape.dense + shape.expert) if full_grads else 2 * shape.largest + zero3_kept_ends(shape)
    return gathered * precision.weight + (0 if full_grads else shape.largest * training.grad_bytes) + autocast_copies \
        + index


def _step_terms(shape: RankShape, resident: PredictedMemory, states: list[float]) -> tuple[float, float, float]:
    """``(master_grads, loss_backward_freed, optimizer_step_total)``: see :class:`PredictedMemory`."""
    training, layout = shape.training, shape.layout
    master_grads = 0.0
    if shape.torch_code and layout.pp > 1 and not training.persistent_grad_buffer:
        # ParaStrategy's pipeline runner sets the last step's gradients aside while the schedule runs (Lightning's
        # `zero_grad` comes after the training step): all of them, as the rank keeps them between steps, are held
        # beside this step's (ZeRO-1/2: shards; ZeRO-0: whole, plus a separate master's fp32 ones).
        master_grads = resident.grads
    elif shape.torch_code and training.bytes.master > 0 and layout.zero < 3:
        master_grads = max(0.0, resident.grads - states[1])  # beyond what the ZeRO paper's peak already holds
    # The loss's backward with one microbatch per step finds the last step's gradients freed by `zero_grad`, so of
    # the states only the weights and optimizer state as the rank keeps them between steps (`resident`: FSDP2's
    # fp32 shards, where the paper's peak counts 16-bit weights and gradients); a later microbatch finds this
    # step's accumulated gradients.
    freed = max(0.0, sum(states) + master_grads - resident.params - resident.optimizer) if shape.per_step == 1 else 0.0
    dense, expert = shape.dense, shape.expert
    stepped = (dense / shape.shards[0] + expert / shape.shards[1]) if layout.zero >= 1 else dense + expert
    step_temporaries = 4.0 * stepped if training.optimizer == "adam" else 0.0
    if layout.zero in (1, 2) and max(shape.shards) > 1:
        step_temporaries = max(step_temporaries, training.bytes.weight * (dense + expert))  # the updated weights' gather
    return master_grads, freed, resident.params + resident.grads + resident.optimizer + step_temporaries


def _lazy_gradients(shape: RankShape, held: Held, walk: Optional[tuple], walked: float,
                    walked_chunks: Optional[list[float]], grads: float) -> tuple[float, float]:
    """``(grads_not_yet_allocated, reducing)``: see :class:`PredictedMemory`."""
    layout, part, v = shape.layout, shape.part, shape.layout.virtual_stages
    lazy = layout.pp > 1 and not shape.training.persistent_grad_buffer
    order = walk if lazy and part.layers else None
    per_chunk = walked_chunks or (held.total - held.kept) / v  # one microbatch's walked bytes per chunk
    if layout.reduces_each_microbatch:
        # One chunk's whole gradients exist during each of its backwards, until reduce-scattered
        # (`parallel/data/zero.py`); the last bucket may still be on the wire while the next forward runs.
        chunk_grads = shape.training.grad_bytes * (shape.dense + shape.expert) / v
        reducing = chunk_grads
        if order is not None:
            peak = lazy_gradient_peak(order, layers_per_chunk(part, v), per_chunk, chunk_grads, freed_after_backward=True)
            reducing = max(0.0, peak - walked)
        capacity = layout.bucket_size_mb * 2**20 if layout.bucket_size_mb is not None \
            else bucket_bytes(shape.shards[0], shape.training.grad_bytes)
        return 0.0, reducing + min(capacity, chunk_grads)
    if order is None:
        return 0.0, 0.0
    peak = lazy_gradient_peak(order, layers_per_chunk(part, v), per_chunk, grads / v)
    return max(0.0, walked + grads - peak), 0.0


def peak_memory(shape: RankShape, resident: PredictedMemory) -> PredictedMemory:
    """The peak (see :class:`PredictedMemory`); ``resident``: :func:`~lightning_para.plan.shape.resident_states` of
    the same rank."""
    layout, part = shape.layout, shape.part
    states, full_grads = _states(shape)
    held = _held(shape)
    # The order this rank runs its forwards and backwards in (one flush; None for the zero-bubble schedules).
    walk = compute_order(layout.schedule, layout.pp, shape.per_step, layout.virtual_stages, part.rank) \
        if layout.pp > 1 and shape.flushes == 1 else None
    activations, walked, walked_chunks = _in_flight(shape, held, walk)
    loss_logits, loss_backward = _loss_terms(shape, held)
    master_grads, freed, optimizer_step_total = _step_terms(shape, resident, states)
    not_yet, reducing = _lazy_gradients(shape, held, walk, walked, walked_chunks, states[1])
    # torch's pipeline stage allocates a receive buffer per microbatch of the flush when it sets up, held through
    # the whole step (beside the gradient walks, which it does not move): one for the input of each chunk fed by
    # another rank, one for the output gradient of each chunk that feeds another rank, of the stage output's size.
    if shape.torch_code and layout.pp > 1:
        activations += (part.sends_forward + part.sends_backward) * (shape.per_step // shape.flushes) * held.stage_output
    breakdown = PredictedMemory(
        states[0], states[1], states[2], activations, _buffers(shape, full_grads), _recomputed(shape, held),
        loss_logits, master_grads, _ring_scores(shape), loss_backward, freed, optimizer_step_total, not_yet, reducing,
    )
    return replace(breakdown, activations=activations + breakdown.transient)


def _ring_scores(shape: RankShape) -> float:
    """Ring attention's two fp32 ``[b, heads/t, rows, c]`` tiles (P and dP) of a chunk pair, ``c = s / cp / 2`` with
    head-tail chunks, rows as the ring itself chooses them."""
    layout, b = shape.layout, shape.training.micro_batch
    if not (shape.torch_code and layout.cp > 1 and layout.cp_method == "ring" and shape.part.layers):
        return 0.0
    chunk = int(shape.training.seq_len // layout.cp // (2 if layout.cp_load_balance else 1))
    heads = max(1, shape.model.heads // layout.tp)
    return 2 * 4.0 * b * heads * score_tile_rows(b, heads, chunk) * chunk


def layers_per_chunk(part: RankLayers, virtual_stages: int) -> Union[int, list[int]]:
    """Layers in each of the rank's chunks (what `lazy_gradient_peak` spreads a chunk's backward over)."""
    if len(part.chunks) > 1:
        return [max(1, len(chunk.layers)) for chunk in part.chunks]
    return max(1, round(len(part.layers) / virtual_stages))


__all__ = ["head_bytes", "layers_per_chunk", "peak_memory"]
