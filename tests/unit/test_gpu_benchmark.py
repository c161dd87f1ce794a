"""``benchmarks/gpu.py`` runs end to end on CPU with a tiny preset, so it works the first time a GPU appears."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

gpu = pytest.importorskip("benchmarks.gpu")


@pytest.fixture
def own_process_group():
    """ParaStrategy at devices=1 starts a one-rank process group in this process; leave none behind."""
    existed = dist.is_initialized()
    yield
    if dist.is_initialized() and not existed:
        dist.destroy_process_group()


def test_gpu_benchmark_runs_on_cpu_at_toy_sizes(tmp_path, own_process_group):
    """Both workloads (GPT-2 124M's shape, Llama-3-8B's block) at toy widths, under ParaStrategy and Lightning."""
    out = tmp_path / "gpu.md"
    written = gpu.main(["--tiny", "--no-compile", "--seq", "16", "--batch", "2", "--steps", "3", "--warmup", "1",
                        "--rounds", "1", "--out", str(out)])
    assert written == out
    text = out.read_text()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith(("| gpt2", "| llama3"))]
    assert [(r[0], r[2], r[4]) for r in rows] == [
        ("gpt2-124m", "bf16-mixed", "para"), ("gpt2-124m", "bf16-mixed", "lightning"),
        ("llama3-8b-block", "bf16-true", "para"), ("llama3-8b-block", "bf16-true", "lightning"),
    ]
    for row in rows:
        tokens_per_s, mfu, memory, ratio = float(row[5].replace(",", "")), row[6], row[7], float(row[8])
        assert int(row[3]) == 2 * 16 and tokens_per_s > 0 and ratio > 0
        assert mfu == "n/a" and memory == "n/a"  # no peak FLOP/s or CUDA memory on CPU
    assert [r[8] for r in rows if r[4] == "lightning"] == ["1.000", "1.000"]  # the baseline of the ratio
    assert re.search(r"Load average \(1/5/15 min\) before: ", text)


def test_gpu_benchmark_workloads_are_gpt2_small_and_llama3_8b_blocks():
    """The shapes the GPU run uses (never built here): GPT-2 124M as llm.c trains it, Llama 3 8B's block."""
    gpt2, llama = gpu.WORKLOADS["gpt2-124m"], gpu.WORKLOADS["llama3-8b-block"]
    assert (gpt2.seq, gpt2.precision, gpt2.model["n_embd"], gpt2.model["n_layer"], gpt2.model["vocab_size"]) == (
        1024, "bf16-mixed", 768, 12, 50304)
    assert 16 <= gpt2.batch <= 64 and gpt2.model["tie_weights"]
    assert (llama.model["n_embd"], llama.model["mlp_hidden"], llama.model["n_kv_head"]) == (4096, 14336, 8)
    assert 2 <= llama.model["n_layer"] <= 4


def test_gpu_benchmark_rejects_a_warmup_longer_than_the_run(tmp_path):
    with pytest.raises(ValueError, match="--warmup"):
        gpu.main(["--tiny", "--steps", "2", "--warmup", "2", "--out", str(tmp_path / "x.md")])
