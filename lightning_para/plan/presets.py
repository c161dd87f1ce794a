"""Published models by name (``lightning-para plan --model llama3-8b``): their :class:`~.model.ModelDesc`,
each with the paper its shape comes from."""

from __future__ import annotations

from typing import Any

from lightning_para.plan.model import ModelDesc, mla_attention_params


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelDesc:
    # GPT-3 (Brown et al. 2020, Table 2.1): GPT-2 vocabulary, 2048 learned positions, tied
    # embeddings, LayerNorm with biases, GeLU MLP of width 4h.
    return ModelDesc(
        layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=50257, tied_embeddings=True,
        gated_mlp=False, norm="layernorm", bias=True, learned_positions=2048, name=name,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelDesc:
    # Llama 3 (Grattafiori et al. 2024, Table 3): GQA with 8 kv heads, SwiGLU, RMSNorm,
    # 128,256-token vocabulary, untied embeddings.
    return ModelDesc(layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=128256, name=name)


PRESETS: dict[str, ModelDesc] = {
    "gpt-125m": _gpt3("gpt-125m", 12, 768, 12),
    # GPT-3 XL lists 24 heads of 128 (which does not multiply to 2048); we use 16 heads of 128,
    # as Megatron-LM and this project's recipe do. The parameter count does not depend on it.
    "gpt-1.3b": _gpt3("gpt-1.3b", 24, 2048, 16),
    # The ZeRO paper's illustration (Rajbhandari et al. 2020, Fig. 1) states only psi = 7.5B, not
    # a shape; this GPT shape (32 layers of width 4352, 34 heads of 128) has 7.502B parameters.
    "zero-7.5b": _gpt3("zero-7.5b", 32, 4352, 34),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    # Mixtral 8x7B (Jiang et al. 2024): 8 SwiGLU experts of width 14336 in every layer, top-2.
    "mixtral-8x7b": ModelDesc(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, num_experts=8, top_k=2,
        name="mixtral-8x7b",
    ),
    # DeepSeek-V3 (DeepSeek-AI 2024, Sec. 4.2): 61 layers, the first 3 dense (FFN 18432), then
    # 256 routed experts (width 2048, top-8) and 1 shared expert; 671B parameters, 37B active
    # (the multi-token-prediction module is not counted, as in the report's 671B).
    # MLA approximation: its parameter count is exact (`mla_attention_params`), but activation,
    # FLOP and communication formulas treat it as multi-head attention with 128 heads of
    # dimension 128 (the value head dim): the 64-dim decoupled RoPE part of the 192-dim query/key
    # heads and the compressed KV latent are not modelled.
    "deepseek-v3": ModelDesc(
        layers=61, hidden=7168, heads=128, head_dim=128, ffn=18432, vocab=129280, num_experts=256, top_k=8,
        moe_ffn=2048, shared_expert_ffn=2048, first_k_dense=3,
        attention_params=mla_attention_params(7168, 128, 1536, 512, 128, 64, 128), name="deepseek-v3",
    ),
}


def preset(name: str, **changes: Any) -> ModelDesc:
    """A published model by name (see :data:`PRESETS`), with some fields optionally replaced."""
    if name not in PRESETS:
        raise ValueError(f"`name={name!r}` is not a known model. Choose one of {', '.join(map(repr, PRESETS))}.")
    return PRESETS[name].with_changes(**changes) if changes else PRESETS[name]


__all__ = ["PRESETS", "preset"]
