"""A :class:`~.model.ModelDesc` from a Hugging Face ``config.json`` (Llama-style, Mistral, Qwen3, Mixtral,
DeepSeek-V2 and GPT-2-style keys; GPT-NeoX, Phi, StarCoder2, Nemotron, OPT, StableLM and Falcon layers)."""

from __future__ import annotations

import json
import warnings
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
    ``first_k_dense_replace``; MoE every ``decoder_sparse_step`` layers, except ``mlp_only_layers`` (Qwen-MoE); as
    transformers builds these models, DeepSeek's ``moe_layer_freq`` is not read.
    DeepSeek's MLA (``kv_lora_rank``) is counted by :func:`mla_attention_params`, with the value
    head dim as the head dim (as the ``deepseek-v3`` preset). These architectures use SwiGLU,
    RMSNorm, RoPE and no biases (the :class:`ModelDesc` defaults). Families written with the same keys whose layers
    differ are read by their ``model_type`` (:data:`OTHER_LAYERS`: GPT-NeoX, Phi, StarCoder2, Nemotron, OPT with
    ``ffn_dim``, StableLM, Falcon); a ``model_type`` in neither list is priced as Llama's layers, with a warning.

    GPT-2-style keys (GPT-2, Megatron's GPT and the many configs written like them): ``n_layer``, ``n_embd``,
    ``n_head``, ``n_inner`` (``null``: ``4 n_embd``), ``n_positions`` (or ``n_ctx``), ``vocab_size``: a GELU MLP of
    two matrices, LayerNorm, biases, learned positions and a tied head (GPT-2's; ``tie_word_embeddings``
    overrides it); ``multi_query`` (GPT-BigCode) is one key/value head; GPT-J and CodeGen (``rotary_dim``) have rotary
    positions and an untied head."""
    import os

    if not isinstance(config, dict):
        path = os.fspath(config)
        with open(path) as f:
            config = json.load(f)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    if "n_embd" in config or "n_layer" in config:
        return _from_gpt2_config(config, name)
    config = _llama_style_keys(config)
    layer = _layer_traits(config)
    tied_by_default = layer.pop("tied", False)
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
        if not config.get("num_experts_per_tok"):
            raise ValueError(
                f"The Hugging Face config has {experts} routed experts but no `num_experts_per_tok`: give how many"
                " experts each token is routed to."
            )
        expert_ffn = config.get("moe_intermediate_size")
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if not shared and config.get("n_shared_experts") and expert_ffn:
            shared = int(config["n_shared_experts"]) * int(expert_ffn)
        moe = dict(
            num_experts=experts, top_k=int(config["num_experts_per_tok"]),
            moe_ffn=int(expert_ffn) if expert_ffn else None, shared_expert_ffn=shared,
            first_k_dense=int(config.get("first_k_dense_replace") or 0),
            moe_every=int(config.get("decoder_sparse_step") or 1),
            moe_layers=_moe_layers(config),
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
        vocab=int(config["vocab_size"]), tied_embeddings=bool(config.get("tie_word_embeddings", tied_by_default)),
        name=name or "hf-model", **moe, **attention, **layer,
    )


# Families written with Llama-style keys whose layers are Llama's: a gated MLP of three matrices (SwiGLU; GeGLU for
# Gemma), RMSNorm, no biases -- the ModelDesc defaults.
LLAMA_LAYERS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma",
    "gemma2", "gemma3_text", "phi3", "phimoe", "olmo", "olmo2", "olmoe", "granite", "granitemoe", "cohere", "cohere2",
    "internlm2", "glm", "glm4", "minicpm", "exaone", "smollm3", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense",
})
# Families written with Llama-style keys whose layers differ (their modeling code in transformers): an MLP of two
# matrices with GELU or squared ReLU between, LayerNorm, biases (or the config's switch for them, with its default in
# the family's code); StableLM's LayerNorm; OPT's learned positions (``max_position_embeddings`` + 2 rows); a tied head
# where the family's config defaults to one.
OTHER_LAYERS: dict[str, dict[str, Any]] = {
    "gpt_neox": dict(gated_mlp=False, norm="layernorm", bias=True),
    "phi": dict(gated_mlp=False, norm="layernorm", bias=True),
    "starcoder2": dict(gated_mlp=False, norm="layernorm", bias=("use_bias", True), tied=True),
    "nemotron": dict(gated_mlp=False, norm="layernorm", bias=("mlp_bias", False)),
    "opt": dict(gated_mlp=False, norm="layernorm", bias=("enable_bias", True), tied=True, positions_offset=2),
    "stablelm": dict(norm="layernorm"),
    "falcon": dict(gated_mlp=False, norm="layernorm", bias=("bias", False), tied=True),
}


def _moe_layers(config: dict[str, Any]) -> Optional[tuple[int, ...]]:
    """The MoE layers by index where ``ModelDesc``'s rule cannot say them: Qwen-MoE keeps ``mlp_only_layers`` dense
    (``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``, transformers' rule); ``None`` otherwise.
    DeepSeek's ``moe_layer_freq`` is not read: transformers' DeepSeek-V2/V3 code puts experts in every layer from
    ``first_k_dense_replace`` on, whatever it says."""
    dense = set(config.get("mlp_only_layers") or ())
    if not dense:
        return None
    every = int(config.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % every == 0)


def _llama_style_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the Llama-style names of what OPT and Falcon call otherwise: OPT's ``ffn_dim``; Falcon's
    ``ffn_hidden_size`` (``None``: ``4 hidden_size``) and key/value heads (``num_kv_heads`` under its new decoder
    architecture, one with ``multi_query``, else one per head); GPT-NeoX has one key/value head per head."""
    config = dict(config)
    if config.get("model_type") == "gpt_neox":  # multi-head attention only: its code reads no key/value head count
        config.pop("num_key_value_heads", None)
    if "intermediate_size" not in config and config.get("ffn_dim"):
        config["intermediate_size"] = config["ffn_dim"]
    if config.get("model_type") == "falcon" and "hidden_size" in config:
        config.setdefault("intermediate_size", config.get("ffn_hidden_size") or 4 * int(config["hidden_size"]))
        if config.get("new_decoder_architecture"):
            config.setdefault("num_key_value_heads", config.get("num_kv_heads"))
        elif config.get("multi_query", True):
            config.setdefault("num_key_value_heads", 1)
    return config


def _layer_traits(config: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelDesc` fields of the config's layers that its keys do not say (see :data:`OTHER_LAYERS`); a
    ``model_type`` the planner does not know is priced as Llama's layers, with a warning that says so."""
    model_type = config.get("model_type")
    if model_type is None or model_type in LLAMA_LAYERS:
        return {}
    if model_type not in OTHER_LAYERS:
        warnings.warn(
            f"model_type {model_type!r} is not one the planner knows: its layers are priced as Llama's (a gated MLP"
            " of three matrices, RMSNorm, no biases). If its MLP has two matrices or its layers have biases, the"
            " parameter count, memory and time are off by that much.",
            stacklevel=3,
        )
        return {}
    traits = dict(OTHER_LAYERS[model_type])
    if isinstance(traits.get("bias"), tuple):  # the config's own switch, and its default in the family's code
        key, default = traits["bias"]
        traits["bias"] = bool(config.get(key, default))
    offset = traits.pop("positions_offset", None)
    if offset is not None:
        traits["learned_positions"] = int(config["max_position_embeddings"]) + offset
    return traits


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
    # GPT-J and CodeGen: GPT-2's keys, rotary positions (`rotary_dim`) instead of learned ones, an untied head.
    rotary = bool(config.get("rotary_dim")) or config.get("model_type") in ("gptj", "codegen")
    return ModelDesc(
        layers=int(config["n_layer"]), hidden=hidden, heads=int(config["n_head"]),
        kv_heads=1 if config.get("multi_query") else None, ffn=int(config.get("n_inner") or 4 * hidden),
        vocab=int(config["vocab_size"]), tied_embeddings=bool(config.get("tie_word_embeddings", not rotary)),
        gated_mlp=False, norm="layernorm", bias=True, learned_positions=0 if rotary else int(positions),
        name=name or "hf-model",
    )


__all__ = ["LLAMA_LAYERS", "OTHER_LAYERS", "from_hf_config"]
