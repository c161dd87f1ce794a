"""A :class:`~.model.ModelDesc` from a Hugging Face ``config.json`` (Llama-style, Mistral, Qwen3, Mixtral,
DeepSeek-V2 and GPT-2-style keys)."""

from __future__ import annotations

import json
from typing import Any, Optional

from lightning_para.plan.model import ModelDesc, mla_attention_params


def from_hf_config(config: Any, name: Optional[str] = None) -> ModelDesc:
    """A :class:`ModelDesc` from a Hugging Face ``config.json`` (a path or its dict).

    Dense keys (Llama/Mistral/Qwen2): ``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
    ``head_dim``, ``tie_word_embeddings``. MoE keys: the routed experts ``num_local_experts``
    (Mixtral), ``num_experts`` (Qwen-MoE) or ``n_routed_experts`` (DeepSeek);
    ``num_experts_per_tok``; the expert width ``moe_intermediate_size`` (else
    ``intermediate_size``); shared experts ``n_shared_experts`` x ``moe_intermediate_size``
    (DeepSeek) or ``shared_expert_intermediate_size`` (Qwen2-MoE); dense first layers
    ``first_k_dense_replace``; MoE every ``decoder_sparse_step`` / ``moe_layer_freq`` layers.
    DeepSeek's MLA (``kv_lora_rank``) is counted by :func:`mla_attention_params`, with the value
    head dim as the head dim (as the ``deepseek-v3`` preset). These architectures use SwiGLU,
    RMSNorm, RoPE and no biases (the :class:`ModelDesc` defaults).

    GPT-2-style keys (GPT-2, Megatron's GPT and the many configs written like them): ``n_layer``, ``n_embd``,
    ``n_head``, ``n_inner`` (``null``: ``4 n_embd``), ``n_positions`` (or ``n_ctx``), ``vocab_size``: a GELU MLP of
    two matrices, LayerNorm, biases, learned positions and a tied head (GPT-2's; ``tie_word_embeddings``
    overrides it); ``multi_query`` (GPT-BigCode) is one key/value head."""
    import os

    if not isinstance(config, dict):
        path = os.fspath(config)
        with open(path) as f:
            config = json.load(f)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    if "n_embd" in config or "n_layer" in config:
        return _from_gpt2_config(config, name)
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(
            f"The Hugging Face config lacks {missing}: give a decoder-only config.json, Llama-style (num_hidden_layers,"
            " hidden_size, num_attention_heads, intermediate_size, vocab_size: Llama, Mistral, Qwen2/3, Mixtral,"
            " DeepSeek) or GPT-2-style (n_layer, n_embd, n_head, n_positions, vocab_size)."
        )
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    experts = int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)
    moe: dict[str, Any] = {}
    if experts:
        expert_ffn = config.get("moe_intermediate_size")
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if not shared and config.get("n_shared_experts") and expert_ffn:
            shared = int(config["n_shared_experts"]) * int(expert_ffn)
        moe = dict(
            num_experts=experts, top_k=int(config.get("num_experts_per_tok") or 0),
            moe_ffn=int(expert_ffn) if expert_ffn else None, shared_expert_ffn=shared,
            first_k_dense=int(config.get("first_k_dense_replace") or 0),
            moe_every=int(config.get("decoder_sparse_step") or config.get("moe_layer_freq") or 1),
        )
    head_dim = config.get("head_dim")
    attention: dict[str, Any] = {}
    if config.get("kv_lora_rank"):  # DeepSeek MLA
        head_dim = int(config["v_head_dim"])
        attention["attention_params"] = mla_attention_params(
            hidden, heads, config.get("q_lora_rank"), int(config["kv_lora_rank"]), int(config["qk_nope_head_dim"]),
            int(config["qk_rope_head_dim"]), head_dim,
        )
    return ModelDesc(
        layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=config.get("num_key_value_heads"), head_dim=head_dim, ffn=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        name=name or "hf-model", **moe, **attention,
    )


GPT2_REQUIRED = ("n_layer", "n_embd", "n_head", "vocab_size")


def _from_gpt2_config(config: dict[str, Any], name: Optional[str]) -> ModelDesc:
    """GPT-2-style keys (see :func:`from_hf_config`)."""
    missing = [key for key in GPT2_REQUIRED if key not in config]
    positions = config.get("n_positions", config.get("n_ctx"))
    if positions is None:
        missing.append("n_positions")
    if missing:
        raise ValueError(
            f"The GPT-2-style config lacks {missing}: give n_layer, n_embd, n_head, n_positions and vocab_size"
            " (n_inner is optional: 4 n_embd)."
        )
    hidden = int(config["n_embd"])
    return ModelDesc(
        layers=int(config["n_layer"]), hidden=hidden, heads=int(config["n_head"]),
        kv_heads=1 if config.get("multi_query") else None, ffn=int(config.get("n_inner") or 4 * hidden),
        vocab=int(config["vocab_size"]), tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        gated_mlp=False, norm="layernorm", bias=True, learned_positions=int(positions), name=name or "hf-model",
    )


__all__ = ["from_hf_config"]
