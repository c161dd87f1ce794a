"""The planner on config.json files of families it has no preset for: GPT-2 style, Mistral, Qwen3, Mixtral,
DeepSeek-V2 (MLA + shared experts). Each parameter count is checked against the count its authors publish."""

from __future__ import annotations

import json

import pytest

from lightning_para.plan.hf_config import from_hf_config
from lightning_para.plan.presets import preset

# The published configs (Hugging Face hub, trimmed to the keys the planner reads, plus a few it ignores).
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "n_positions": 1024,
        "n_ctx": 1024, "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
MISTRAL_7B = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
              "sliding_window": 4096}
QWEN3_8B = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False}
MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "vocab_size": 102400, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}


def test_a_gpt2_config_is_gelu_layernorm_learned_positions_and_tied():
    model = from_hf_config(GPT2, "gpt2")
    assert (model.gated_mlp, model.norm, model.bias, model.learned_positions, model.tied_embeddings) == \
        (False, "layernorm", True, 1024, True)
    assert model.ffn == 4 * 768
    assert model.total_params() == 124_439_808  # GPT-2 small, as transformers counts GPT2LMHeadModel
    big_code = from_hf_config({**GPT2, "multi_query": True, "n_inner": 3000, "tie_word_embeddings": False})
    assert big_code.kv_heads == 1 and big_code.ffn == 3000 and not big_code.tied_embeddings
    with pytest.raises(ValueError, match=r"GPT-2-style config lacks \['n_positions'\]"):
        from_hf_config({k: v for k, v in GPT2.items() if k not in ("n_positions", "n_ctx")})


@pytest.mark.parametrize("config, published, rel", [
    (MISTRAL_7B, 7.24e9, 0.005),  # Mistral 7B v0.1: 7.24B
    (QWEN3_8B, 8.19e9, 0.005),  # Qwen3-8B: 8.2B
    (MIXTRAL, preset("mixtral-8x7b").total_params(), 0.0),  # 46.7B
    (DEEPSEEK_V2_LITE, 15.7e9, 0.005),  # DeepSeek-V2-Lite: 15.7B total
])
def test_other_families_read_to_their_published_counts(config, published, rel):
    assert from_hf_config(config).total_params() == pytest.approx(published, rel=rel)


def test_lightning_para_plan_takes_a_gpt2_config(tmp_path, capsys):
    from lightning_para.cli import main

    path = tmp_path / "gpt2" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(GPT2))
    assert main(["plan", "--model", str(path), "--gpus", "8", "--gpu", "h100", "--seq-len", "1024",
                 "--global-batch", "64", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt2: 124M params") or out.startswith("gpt2: 124.4M params"), out[:200]


# Tiny configs of families whose layers differ from Llama's (or read under other names), built with transformers'
# own config classes: the planner's count must equal transformers' model of the same config, counted on meta.
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704,
             vocab_size=1000)
FAMILIES = [
    ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL, 0.0),
    ("PhiConfig", "PhiForCausalLM", SMALL, 1e-4),  # one LayerNorm per layer (parallel attention and MLP)
    ("Starcoder2Config", "Starcoder2ForCausalLM", SMALL, 0.0),
    ("NemotronConfig", "NemotronForCausalLM", SMALL, 1e-3),  # its LayerNorms have biases, its linears none
    ("OPTConfig", "OPTForCausalLM", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, ffn_dim=704,
                                         vocab_size=1000, word_embed_proj_dim=256), 0.0),
    ("StableLmConfig", "StableLmForCausalLM", SMALL, 1e-3),  # LayerNorm biases, unbiased linears
    ("FalconConfig", "FalconForCausalLM", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                               vocab_size=1000), 1e-3),
    ("FalconConfig", "FalconForCausalLM", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                               vocab_size=1000, new_decoder_architecture=True, num_kv_heads=2), 1e-3),
    ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=256, n_layer=2, n_head=4, vocab_size=1000, rotary_dim=32), 2e-3),
    ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=256, n_layer=2, n_head=4, vocab_size=1000,
                                                       multi_query=True), 0.0),
    ("Qwen2Config", "Qwen2ForCausalLM", SMALL, 1e-3),  # q/k/v biases only
    ("GemmaConfig", "GemmaForCausalLM", {**SMALL, "head_dim": 64}, 0.0),
    ("MixtralConfig", "MixtralForCausalLM", {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2}, 0.0),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**SMALL, "num_hidden_layers": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "head_dim": 64, "mlp_only_layers": [0, 2]}, 1e-3),
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**SMALL, "num_hidden_layers": 5, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "first_k_dense_replace": 1, "moe_layer_freq": 2,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
     0.0),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**SMALL, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 64,
        "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}, 0.0),
]


@pytest.mark.parametrize("config_class, model_class, kwargs, rel", FAMILIES,
                         ids=[f"{f[1]}-{i}" for i, f in enumerate(FAMILIES)])
def test_family_counts_equal_transformers_model(config_class, model_class, kwargs, rel):
    transformers = pytest.importorskip("transformers")
    import torch
    import warnings

    config = getattr(transformers, config_class)(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a family the planner knows is priced without a warning
        planned = from_hf_config(config.to_dict()).total_params()
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    assert planned == pytest.approx(sum(p.numel() for p in model.parameters()), rel=rel, abs=0)


def test_unknown_model_type_is_priced_as_llama_layers_with_a_warning():
    config = {**SMALL, "model_type": "my_new_lm"}
    with pytest.warns(UserWarning, match="model_type 'my_new_lm' is not one the planner knows"):
        model = from_hf_config(config)
    assert (model.gated_mlp, model.norm, model.bias) == (True, "rmsnorm", False)


def test_moe_config_without_experts_per_token_names_the_key():
    with pytest.raises(ValueError, match="no `num_experts_per_tok`"):
        from_hf_config({**MIXTRAL, "num_experts_per_tok": None})
