"""The model arguments of ``lightning-para plan`` and ``dryrun`` (``lightning_para.cli.model_args``):
a Hugging Face config.json, explicit shapes, a preset with shapes replaced, and the errors."""

from __future__ import annotations

import json

import pytest

from lightning_para.cli import main
from lightning_para.cli.dryrun import _parser as dryrun_parser
from lightning_para.cli.dryrun import _setup as dryrun_setup
from lightning_para.cli.model_args import resolve_model, shape_overrides
from lightning_para.plan import Cluster, Training, preset
from lightning_para.plan.search import search

LLAMA3_8B_SHAPE = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA3_8B_ARGV = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
                  "--vocab", "128256"]
RUN_ARGV = ["--gpus", "8", "--gpu", "h100", "--seq-len", "8192", "--global-batch", "64", "--top", "3", "--rejected", "0"]

# The published config.json files' keys (values of meta-llama/Meta-Llama-3-8B, mistralai/Mixtral-8x7B-v0.1
# and deepseek-ai/DeepSeek-V3), trimmed to what the planner reads plus a few it ignores.
LLAMA3_8B_JSON = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                  "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0}
MIXTRAL_JSON = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
DEEPSEEK_V3_JSON = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
                    "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def _write(tmp_path, name, config):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("config, name", [(LLAMA3_8B_JSON, "llama3-8b"), (MIXTRAL_JSON, "mixtral-8x7b"),
                                          (DEEPSEEK_V3_JSON, "deepseek-v3")])
def test_config_json_matches_the_preset(tmp_path, config, name):
    model = resolve_model(_write(tmp_path, name + "-hf", config), {})
    reference = preset(name)
    assert model.name == name + "-hf"
    assert model.total_params() == reference.total_params()
    assert model.active_params() == reference.active_params()
    assert model.expert_params() == reference.expert_params()
    assert model.flops_per_token(4096) == reference.flops_per_token(4096)


def test_explicit_shapes_equal_the_preset_give_the_same_plan(capsys):
    model = resolve_model(None, dict(LLAMA3_8B_SHAPE))
    reference = preset("llama3-8b")
    assert model.total_params() == reference.total_params() == 8_030_261_248
    cluster, training = Cluster.of("h100", nodes=1, gpus_per_node=8), Training(seq_len=8192, global_batch=64)
    mine, theirs = search(model, cluster, training), search(reference, cluster, training)
    assert mine.fits and [(e.layout, e.step_seconds, e.memory.total) for e in mine.fits] == \
        [(e.layout, e.step_seconds, e.memory.total) for e in theirs.fits]
    # ... and through the command line: the same table but for the model's name (the search above covered every
    # layout; here the ZeRO-1 ones of tp 1 and 2, six, at a seventh of its cost)
    assert main(["plan", *LLAMA3_8B_ARGV, *RUN_ARGV, "--tp", "1,2", "--zero", "1"]) == 0
    custom = capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", *RUN_ARGV, "--tp", "1,2", "--zero", "1"]) == 0
    published = capsys.readouterr().out
    assert custom.startswith("custom: 8.03B params, L=32 h=4096 heads=32/8 ffn=14336 vocab=128256")
    assert custom.replace("custom", "llama3-8b") == published


def test_shapes_replace_fields_of_a_preset_or_config_json(tmp_path):
    half = resolve_model("llama3-8b", {"layers": 16})
    reference = preset("llama3-8b")
    per_layer = reference.layer_params(0)
    assert half.layers == 16 and half.total_params() == reference.total_params() - 16 * per_layer
    assert half.name == "llama3-8b[layers=16]"
    # hidden re-derives the head dim (4096 / 32 -> 2048 / 32); kv heads stay 8
    narrow = resolve_model("llama3-8b", {"hidden": 2048})
    assert (narrow.head_dim, narrow.kv_heads) == (64, 8)
    # a dense model made MoE, and an MoE config made dense
    moe = resolve_model(_write(tmp_path, "l", LLAMA3_8B_JSON), {"experts": 8, "experts_per_token": 2})
    assert moe.total_params() == preset("mixtral-8x7b").total_params() + 2 * 4096 * (128256 - 32000)
    dense = resolve_model(_write(tmp_path, "d", DEEPSEEK_V3_JSON), {"experts": 0})
    assert not dense.is_moe and dense.first_k_dense == 0 and dense.shared_expert_ffn == 0


@pytest.mark.parametrize(
    "model, shapes, message",
    [
        (None, {"layers": 4, "hidden": 64}, "missing: --heads --ffn --vocab"),
        (None, {**LLAMA3_8B_SHAPE, "hidden": 4000, "heads": 48}, "`--hidden 4000` is not divisible by `--heads 48`"),
        ("llama3-8b", {"hidden": 4001}, "`--hidden 4001` is not divisible by `heads=32` (from `--model llama3-8b`)"),
        ("llama3-8b", {"kv_heads": 5}, "`--kv-heads 5` must divide `heads=32` (from `--model llama3-8b`)"),
        ("llama3-8b", {"heads": 4}, "`kv_heads=8` (from `--model llama3-8b`) must divide `--heads 4`"),
        (None, {**LLAMA3_8B_SHAPE, "kv_heads": 3}, "`--kv-heads 3` must divide `--heads 32`"),
        ("llama3-8b", {"layers": 0}, "`--layers 0` must be an integer >= 1"),
        ("llama3-8b", {"experts_per_token": 2}, "`--experts-per-token 2` needs routed experts"),
        ("llama3-8b", {"expert_ffn": 1024}, "`--expert-ffn 1024` needs routed experts"),
        ("llama3-8b", {"experts": 8}, "`--experts 8` needs `--experts-per-token K`"),
        ("mixtral-8x7b", {"experts_per_token": 9}, "`--experts-per-token 9` must be at most `num_experts=8`"),
        ("no/such/config.json", {}, "`--model no/such/config.json`: cannot read it"),
    ],
)
def test_bad_shapes_raise_naming_the_argument(model, shapes, message):
    with pytest.raises(ValueError) as info:
        resolve_model(model, shapes)
    assert message in str(info.value), str(info.value)


def test_plan_cli_shape_errors_exit_2(capsys):
    assert main(["plan", "--model", "llama3-8b", "--kv-heads", "5", *RUN_ARGV]) == 2
    assert "`--kv-heads 5` must divide" in capsys.readouterr().err
    assert main(["plan", "--config", "gpt-cpu-demo", "--layers", "2"]) == 2
    assert "`--layers` describes a model shape" in capsys.readouterr().err
    assert main(["plan", *RUN_ARGV]) == 2
    assert "Give `--model`" in capsys.readouterr().err


def test_dryrun_reads_the_same_model_arguments(tmp_path, capsys):
    args = dryrun_parser().parse_args([*LLAMA3_8B_ARGV, "--layers", "4", "--gpus", "8", "--layout", "tp=2"])
    assert shape_overrides(args)["layers"] == 4
    model = dryrun_setup(args).model
    assert model.layers == 4 and model.total_params() == preset("llama3-8b", layers=4).total_params()
    path = _write(tmp_path, "llama", LLAMA3_8B_JSON)
    model = dryrun_setup(dryrun_parser().parse_args(["--model", path, "--layers", "2", "--gpus", "2"])).model
    assert model.name == "llama[layers=2]" and model.total_params() == preset("llama3-8b", layers=2).total_params()
    # MoE models run since issue 23 (balanced routing); GPT-3's LayerNorm, tied, biased shape is still refused.
    assert main(["dryrun", "--model", "gpt-125m", "--gpus", "8"]) == 2
    assert "the dry run builds Llama-style models" in capsys.readouterr().err
