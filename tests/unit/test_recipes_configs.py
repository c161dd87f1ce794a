"""Every YAML in recipes/ parses under the CLI and resolves to the layout it states (no process starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_para.cli import ParaCLI

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# file -> (devices, (pp, dp, tp, ep), model class name, preset)
EXPECTED = {
    "gpt-cpu-demo.yaml": (4, (2, 1, 2, 1), "GPT", "tiny"),
    "gpt-muon-cpu-demo.yaml": (4, (1, 2, 2, 1), "GPT", "tiny"),  # Muon (optimizer: muon) under tp=2 x ZeRO-1 dp=2
    "gpt-long-context-cpu.yaml": (4, (1, 1, 2, 1), "GPT", "tiny"),  # and cp=2 (issue 16)
    "moe-cpu-demo.yaml": (4, (1, 4, 1, 2), "MoEGPT", "tiny"),
    "gpt-125m-8gpu.yaml": (8, (1, 8, 1, 1), "GPT", "gpt-125m"),
    "gpt-1.3b-tp2-pp2.yaml": (8, (2, 2, 2, 1), "GPT", "gpt-1.3b"),
    "moe-8gpu.yaml": (8, (1, 8, 1, 4), "MoEGPT", "gpt-350m"),
    # transformers models from a tiny random config (no preset): tp=2 x pp=2 with SP; tp=2 x ep=2 in dp=2
    "hf-llama-cpu-demo.yaml": (4, (2, 1, 2, 1), "HFCausalLM", None),
    "hf-mixtral-cpu-demo.yaml": (4, (1, 2, 2, 2), "HFCausalLM", None),
    # a LitGPT model from litgpt.Config fields (n_layer, block_size: the tiny preset's names): tp=2 x pp=2 with SP
    "litgpt-cpu-demo.yaml": (4, (2, 1, 2, 1), "LitGPTCausalLM", "litgpt"),
    # real-run recipes (issue 36): a prepared token corpus; a pretrained Llama folder read sharded
    "gpt2-124m-8gpu.yaml": (8, (1, 8, 1, 1), "GPT", "gpt-125m"),
    "gpt2-124m-mixture-8gpu.yaml": (8, (1, 8, 1, 1), "GPT", "gpt-125m"),  # two weighted sources
    "llama-finetune-8gpu.yaml": (8, (1, 4, 2, 1), "HFCausalLM", None),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tokenized corpus (512-token BPE trained here) and a tiny Llama folder, for the recipes that need them."""
    from lightning_para.cli.prepare import prepare
    from tests.token_data import stdlib_documents, text_folder, train_bpe

    root = tmp_path_factory.mktemp("recipes")
    texts = stdlib_documents(8)
    tokenizer = train_bpe(root / "tokenizer", texts)
    prepare(str(tokenizer), str(root / "corpus"), [str(text_folder(root / "text", texts))], progress=False)
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tests.hf_models import llama_config

    AutoModelForCausalLM.from_config(
        llama_config(vocab_size=512, num_hidden_layers=4, max_position_embeddings=2048)
    ).save_pretrained(root / "llama")
    mixture = json.dumps({"web": [str(root / "corpus"), 0.7], "code": [str(root / "corpus"), 0.3]})
    return {"gpt2-124m-8gpu.yaml": ["--data.init_args.path", str(root / "corpus")],
            "gpt2-124m-mixture-8gpu.yaml": ["--data.init_args.sources", mixture],
            "llama-finetune-8gpu.yaml": ["--data.init_args.path", str(root / "corpus"),
                                         "--model.init_args.pretrained", str(root / "llama")]}


def test_every_recipe_config_is_covered():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_config_resolves(name, tmp_path, monkeypatch, request):
    monkeypatch.setattr("sys.argv", ["lightning-para"])  # pytest's own argv is not the CLI's
    devices, layout, model_class, preset = EXPECTED[name]
    if preset == "litgpt":
        pytest.importorskip("litgpt")
    # GPU files are checked on CPU with a tiny model: the layout, not the weights, is under test.
    args = ["--config", str(RECIPES / name), "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path)]
    if preset not in ("tiny", "litgpt", None):
        args += ["--model.init_args.preset", "tiny"]
    if "8gpu" in name and name.startswith(("gpt2-", "llama-")):
        args += request.getfixturevalue("prepared")[name]
    cli = ParaCLI(args=args, run=False)
    strategy = cli.trainer.strategy
    dims = strategy.parallel_dims  # resolved by the strategy before any launch
    assert dims.world_size == devices
    assert (dims.pp, dims.dp, dims.tp, dims.ep) == layout
    if "cpu-demo" in name:  # the demos show at least two parallel dimensions at once
        assert sum(d > 1 for d in (dims.pp, dims.dp, dims.tp, dims.ep)) >= 2
    assert type(cli.model).__name__ == model_class
    if preset is None:  # a transformers config: its own field names
        assert cli.model.config.num_hidden_layers == 4 and not cli.model.config.tie_word_embeddings
        assert cli.datamodule.seq_len <= cli.model.config.max_position_embeddings
        assert cli.model.config.vocab_size == cli.datamodule.vocab_size
    else:
        assert cli.model.config.n_layer == 4  # the tiny preset (the GPU files were switched to it above)
        assert cli.datamodule.seq_len <= cli.model.config.block_size
    assert cli.datamodule.global_batch_size % dims.dp == 0
    if "mixture" in name:
        assert cli.datamodule.weights == {"web": 0.7, "code": 0.3}
    if name in ("llama-finetune-8gpu.yaml", "gpt2-124m-mixture-8gpu.yaml"):  # packed documents, ended by the EOS id
        assert cli.datamodule.document_mask and cli.datamodule.reset_positions and cli.datamodule.eos_id is not None
