"""The real-run recipes on CPU (issue 36), through the CLI in real gloo groups: ``gpt2-124m-8gpu`` trains
from a corpus prepared with a BPE tokenizer trained here, under tp=2; ``llama-finetune-8gpu`` loads a
Llama folder sharded under tp=2 x ZeRO-3, trains, and its checkpoint exports to a sharded folder that
``from_pretrained`` opens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_recipes_cli import LoggedLosses
from tests.token_data import stdlib_documents, text_folder, train_bpe

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.log_every_n_steps", "1", "--profiling.comm_every_n_steps", "0",
         "--profiling.memory_every_n_steps", "0", "--profiling.timeline_every_n_steps", "0"]
CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.strategy.compile", "false"]


def cli_fit_job(args: list[str]) -> dict:
    """In every worker: the CLI (the workers already form the process group, as torchrun would)."""
    import torch.distributed as dist

    from lightning_para.cli import run_cli

    cli = run_cli([*args, "--trainer.callbacks+=tests.integration.test_recipes_cli.LoggedLosses"])
    logged = next(cb for cb in cli.trainer.callbacks if isinstance(cb, LoggedLosses))
    return {"rank": dist.get_rank(), "logged_loss": logged.loss}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lightning_para.cli.prepare import prepare

    root = tmp_path_factory.mktemp("real_runs")
    texts = stdlib_documents(40)
    tokenizer = train_bpe(root / "tokenizer", texts, vocab_size=512)
    prepare(str(tokenizer), str(root / "corpus"), [str(text_folder(root / "text", texts))], workers=2, progress=False)
    return root


def test_gpt2_recipe_trains_from_token_shards_under_tp2(pools, corpus, tmp_path):
    args = ["fit", "--config", str(REPO / "recipes" / "gpt2-124m-8gpu.yaml"), *CPU, *QUIET,
            "--trainer.devices", "2", "--trainer.strategy.tp", "2", "--trainer.strategy.zero", "0",
            "--trainer.max_steps", "40", "--trainer.accumulate_grad_batches", "1", "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", str(tmp_path),
            # the recipe's model at the tiny preset's shape, the 512-token corpus, CPU-sized batches
            "--model.init_args.preset", "tiny", "--model.init_args.vocab_size", "512", "--model.init_args.block_size", "64",
            "--model.init_args.lr", "0.006", "--model.init_args.warmup_steps", "10",
            "--data.init_args.path", str(corpus / "corpus"), "--data.init_args.seq_len", "64",
            "--data.init_args.global_batch_size", "32", "--data.init_args.num_workers", "0",
            "--data.init_args.val_fraction", "0"]
    results = pools.get(2).run(cli_fit_job, args)
    losses = results[0]["logged_loss"]
    assert len(losses) == 40
    first, last = losses[0], sum(losses[-5:]) / 5  # the first step's loss; the last five steps' mean
    assert last <= 0.85 * first, (first, last, losses)  # the loss falls by at least 15% in 40 steps


def test_gpt2_recipe_rejects_a_model_vocabulary_smaller_than_the_tokenizer(corpus, tmp_path):
    from lightning_para.cli import ConfigurationError, run_cli

    args = ["fit", "--config", str(REPO / "recipes" / "gpt2-124m-8gpu.yaml"), *CPU, *QUIET, "--trainer.devices", "1",
            "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), "--model.init_args.preset", "tiny",
            "--model.init_args.vocab_size", "300", "--model.init_args.block_size", "64",
            "--data.init_args.path", str(corpus / "corpus"), "--data.init_args.seq_len", "64",
            "--data.init_args.global_batch_size", "8", "--data.init_args.num_workers", "0"]
    with pytest.raises((ConfigurationError, ValueError), match=r"tokenizer has 512 tokens but the model's `vocab_size=300`"):
        run_cli(args)


def test_llama_finetune_recipe_loads_sharded_trains_and_exports(pools, corpus, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lightning_para.integrations.transformers import export
    from tests.hf_models import llama_config

    folder = tmp_path / "llama"
    AutoModelForCausalLM.from_config(llama_config(vocab_size=512, max_position_embeddings=128,
                                                  initializer_range=0.02)).save_pretrained(folder)
    args = ["fit", "--config", str(REPO / "recipes" / "llama-finetune-8gpu.yaml"), *CPU, *QUIET,
            "--trainer.devices", "4", "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", str(tmp_path), "--model.init_args.pretrained", str(folder),
            "--model.init_args.lr", "0.001", "--model.init_args.warmup_steps", "0",
            "--data.init_args.path", str(corpus / "corpus"), "--data.init_args.seq_len", "64",
            "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "0"]
    results = pools.get(4).run(cli_fit_job, args)
    losses = results[0]["logged_loss"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    (checkpoint,) = (next((tmp_path / "lightning_logs").glob("version_*")) / "checkpoints").glob("*step=6*")
    out = export(checkpoint, tmp_path / "exported", max_shard_size=200_000, workers=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert set(model.state_dict()) == set(index["weight_map"])
