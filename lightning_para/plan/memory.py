"""Bytes per rank: activations (Megatron-LM's per-layer formulas, Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4); the model states' are ZeRO's
(:func:`lightning_para.spec.zero.zero_state_bytes`).

:func:`layer_activation_bytes` derives the paper's coefficients (``sbh (34 + 5 a s / h)`` without parallelism, its
Eq. 2 and 4 under tp and SP, Eq. 6 under selective recomputation, the layer input under full recomputation) term by
term, so they also follow GQA, gated MLPs, MoE layers, models without dropout, FlashAttention and torchtitan's per-op
selective recomputation (:func:`selective_op_layer_bytes`). Each term, its source and the measurements behind it:
``docs/planner.md``, "Memory per rank" and "Memory terms".
"""

from __future__ import annotations

from typing import Optional

from lightning_para.spec.options import ACTIVATION_CHECKPOINTING
from lightning_para.plan.model import ModelDesc


def layer_activation_bytes(
    model: ModelDesc,
    seq_len: int,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    recompute: Optional[str] = None,
    flash_attention: bool = False,
    activation_bytes: int = 2,
    moe_layer: bool = False,
    sp_saves_gathered_inputs: bool = False,
    swiglu_tensors: int = 4,
    expert_parallel: bool = False,
    residual_bytes: Optional[int] = None,
) -> float:
    """Activation bytes one layer keeps for backward, for one microbatch, on one rank.

    ``residual_bytes``: bytes per element of the residual stream, the block's input and the norms' inputs
    (default ``activation_bytes``). Under autocast (``*-mixed``) it is the weights' dtype: the embedding
    gives fp32 and the residual adds stay fp32, so a checkpointed block keeps an fp32 input and a norm an
    fp32 one (measured on an H100, rank 0 of an 8- and a 128-rank ZeRO-3 job of Llama 3 8B in
    ``bf16-mixed``, ``benchmarks/gpu_fake_world.py``: 2 bytes x ``sbh`` per layer more than in ``bf16-true``).

    ``sp_saves_gathered_inputs``: under sequence parallelism the q/k/v and MLP projections keep their
    all-gathered input whole (plain DTensor sequence parallelism: ParaStrategy with
    ``sp_save_input_shard=False`` or with selective recomputation), not the sequence shard
    (Megatron-LM and ParaStrategy's default, ``False``: Korthikanti's Eq. 4 exactly).
    ``swiglu_tensors``: ``f``-wide tensors a SwiGLU MLP keeps without recomputation: 4 for the
    plain ``c_proj(silu(gate(x)) * fc(x))`` (the recipes', torchtitan's), 3 for Megatron's fused
    SwiGLU (it keeps the gate/up output and the product). Under ``"selective"`` it keeps 3 (the
    matmul outputs gate, fc and the product's recomputation inputs; silu is recomputed).

    The terms, one by one, are the module docstring's ("Term by term").
    Context parallelism divides ``s`` by ``cp`` (each query block still scores all ``s`` keys).
    """
    if recompute not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"`recompute={recompute!r}` is unknown. Choose one of {', '.join(map(repr, ACTIVATION_CHECKPOINTING))}."
        )
    s, b, h, e = seq_len / cp, micro_batch, model.hidden, activation_bytes
    residual = e if residual_bytes is None else residual_bytes
    sp_divisor = tp if sequence_parallel else 1
    if recompute == "full":
        return residual * s * b * h / sp_divisor
    # SwiGLU ``c_proj(silu(gate(x)) * fc(x))`` keeps four ``f``-wide tensors: the gate's output (for
    # silu), silu's output and fc's output (for the product), the product (for c_proj); GELU two
    # (the dry run's saved tensors of the recipe block).
    hidden_tensors = (swiglu_tensors if recompute is None else 3) if model.gated_mlp else 2
    if recompute == "selective_op":  # an MoE layer's experts priced as under "selective" (see above)
        attention_part = selective_op_layer_bytes(
            model, seq_len, micro_batch, tp=tp, sequence_parallel=sequence_parallel, cp=cp,
            flash_attention=flash_attention, activation_bytes=activation_bytes, mlp=not moe_layer, input_bytes=residual,
        )
        return attention_part + (_expert_bytes(model, s, b, e, hidden_tensors, 2, 0) / sp_divisor if moe_layer else 0.0)
    replicated, gathered = _stream_bytes(model, s, b, e, residual, recompute, sequence_parallel and sp_saves_gathered_inputs)
    attention = e * s * b * (2 * model.q_dim + 2 * model.kv_dim)
    if flash_attention:
        scores = 4.0 * model.heads * s * b
    elif recompute == "selective":
        scores = 0.0
    else:
        per_score = e + (1 + e if model.dropout else 0)
        scores = per_score * model.heads * s * seq_len * b
    if moe_layer:
        experts = _expert_bytes(model, s, b, e, hidden_tensors, 4 if expert_parallel else 3, h if e < 4 else 0)
        experts, mlp_sharded = experts / sp_divisor, 0.0
    else:
        experts, mlp_sharded = 0.0, e * s * b * hidden_tensors * model.ffn
    tp_sharded = attention + mlp_sharded + scores
    return replicated / sp_divisor + gathered + tp_sharded / tp + experts


def _stream_bytes(model: ModelDesc, s: float, b: int, e: int, residual: int, recompute: Optional[str],
                  gathered_inputs: bool) -> tuple[float, float]:
    """``(kept whole under tp, kept after SP's all-gather)``: the norms' inputs (sharded by SP) and the q/k/v and MLP
    projections' inputs. Megatron-SP saves the latter's sequence shard and gathers again in backward (Korthikanti
    Sec. 4.2.2); plain DTensor SP (``gathered_inputs``) saves them after the all-gather, whole (measured by the dry
    run's saved tensors). An eager norm that upcasts (transformers' RMSNorm) keeps an fp32 copy of its input besides
    (`norm_upcast`). Without recomputation both norm inputs are the residual stream; under "selective" the block's
    input is (the checkpoint's argument) and the second norm's input is recomputed, its place taken by an e-byte
    term."""
    h = model.hidden
    dropout_masks = 2 * s * b * h if model.dropout else 0
    norm_inputs = 2 * residual if recompute is None else residual + e
    replicated = (norm_inputs + 2 * (4 if model.norm_upcast else 0)) * s * b * h + dropout_masks
    gathered = 2 * e * s * b * h
    return (replicated, gathered) if gathered_inputs else (replicated + gathered, 0.0)


def _expert_bytes(model: ModelDesc, s: float, b: int, e: int, hidden_tensors: int, per_copy: int,
                  router_input: float) -> float:
    """An MoE layer's experts (before SP's division): per routed token copy ``per_copy`` ``e h``-byte tensors (the
    expert's input and its output, kept again by the combine) and its hidden activations; the shared experts'; the
    router's fp32 probabilities and ``router_input`` (its fp32 copy of the input: ``h``, or none)."""
    moe_ffn = model.moe_ffn or model.ffn
    copies = s * b * model.top_k * (model.capacity_factor or 1.0)
    routed = copies * e * (per_copy * model.hidden + hidden_tensors * moe_ffn)
    shared = e * s * b * hidden_tensors * model.shared_expert_ffn
    return 4.0 * s * b * (model.num_experts + router_input) + routed + shared


def selective_op_layer_bytes(
    model: ModelDesc,
    seq_len: int,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    flash_attention: bool = True,
    activation_bytes: int = 2,
    mlp: bool = True,
    input_bytes: Optional[int] = None,
) -> float:
    """Bytes one layer keeps under torchtitan's per-op selective recomputation (``"selective_op"``,
    ``parallel/activation_checkpoint.py``; torchtitan ``selective_ac_option="op"``): the outputs of
    the matmuls but every second one, of the attention kernel and of the reduce-scatters, plus
    the block's input (the checkpoint's argument). In a Llama block (separate q, k, v projections,
    ``c_proj(silu(gate(x)) * up(x))``) the matmuls run q, k, v, o, gate, up, down: q, v, gate and
    down are kept, k, o and up recomputed (GPT's MLP: q, v and fc kept; k, o, proj recomputed):

    * the block input, ``e sbh`` (``/t`` under SP: the sequence shard);
    * q, v and the attention output ``e sb (2 a d + kv d) / t``; FlashAttention's fp32 log-sum-exp
      ``4 asb / t`` (without a fused kernel the scores are recomputed, as under ``"selective"``);
    * the gate (GPT: fc) output ``e sbf / t``; a gated MLP's down projection output ``e sbh``,
      whole under tp (a row-parallel matmul's partial sum, before its reduction);
    * under SP with ``t > 1``: the two reduce-scatter outputs, ``2 e sbh / t``. A tensor-parallel
      all-reduce or SP all-gather is not kept: the recomputation runs it again.

    ``mlp=False``: the attention half only (an MoE layer's experts are priced apart). ``input_bytes``: the
    block input's bytes per element (default ``activation_bytes``; fp32 under autocast, see
    :func:`layer_activation_bytes`).
    """
    s, b, h, e = seq_len / cp, micro_batch, model.hidden, activation_bytes
    sp = tp if sequence_parallel else 1
    kept = (e if input_bytes is None else input_bytes) * s * b * h / sp  # the block input
    kept += e * s * b * (2 * model.q_dim + model.kv_dim) / tp
    if flash_attention:
        kept += 4.0 * model.heads * s * b / tp
    if mlp:
        kept += e * s * b * model.ffn / tp
        if model.gated_mlp:
            kept += e * s * b * h
    if sequence_parallel and tp > 1:
        kept += (2 if mlp else 1) * e * s * b * h / tp
    return kept


def selective_op_recompute_params(model: ModelDesc, moe_layer: bool = False) -> float:
    """Weights whose matmuls ``"selective_op"`` runs again in backward, per layer: k, o and one
    ``h x f`` MLP matrix (a gated MLP's up projection, GPT's output projection); their forward is
    ``2 x tokens x`` this many FLOPs (an MoE layer: k and o only; its experts are not counted)."""
    attention = model.hidden * model.kv_dim + model.q_dim * model.hidden
    return float(attention + (0 if moe_layer else model.hidden * model.ffn))


def embedding_activation_bytes(
    model: ModelDesc, seq_len: int, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False, cp: int = 1
) -> float:
    """The input embedding's dropout mask, ``sbh`` (Korthikanti et al. 2022, Sec. 4.3); 0 without dropout."""
    if not model.dropout:
        return 0.0
    return seq_len / cp * micro_batch * model.hidden / (tp if sequence_parallel else 1)


def head_activation_bytes(
    model: ModelDesc,
    seq_len: int,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    activation_bytes: int = 2,
    logit_bytes: int = 4,
    sp_saves_gathered_inputs: bool = False,
) -> float:
    """Final norm and output projection inputs, ``2 e sbh`` (``/t`` with SP), and the
    log-probabilities the cross-entropy keeps, ``logit_bytes sbV / t`` (Korthikanti et al. 2022,
    Sec. 4.3: fp32, 4 bytes; a ``*-true`` run without autocast keeps them in the activation dtype).
    ``sp_saves_gathered_inputs``: the output projection keeps its all-gathered input (torch's SP)."""
    s, b, e = seq_len / cp, micro_batch, activation_bytes
    sp = tp if sequence_parallel else 1
    norm_input = (e + (4 if model.norm_upcast else 0)) * s * b * model.hidden / sp  # see `ModelDesc.norm_upcast`
    projection_input = e * s * b * model.hidden / (1 if sequence_parallel and sp_saves_gathered_inputs else sp)
    return norm_input + projection_input + logit_bytes * s * b * model.vocab / tp
