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


def test_gpu_benchmark_runs_on_cpu_with_a_tiny_preset(tmp_path, own_process_group):
    out = tmp_path / "gpu.md"
    written = gpu.main([
        "--preset", "tiny", "--vocab", "256", "--seq", "32", "--batch", "2", "--steps", "3", "--warmup", "1",
        "--rounds", "1", "--configs", "bf16-mixed:none", "bf16-true:full", "--out", str(out),
    ])
    assert written == out
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| bf16")]
    # Two configurations, each under ParaStrategy and under Lightning's default strategy.
    assert [tuple(cell.strip() for cell in row.split("|")[1:4]) for row in rows] == [
        ("bf16-mixed", "none", "para"), ("bf16-mixed", "none", "lightning"),
        ("bf16-true", "full", "para"), ("bf16-true", "full", "lightning"),
    ]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        tokens_per_s, mfu, memory, ratio = float(cells[3].replace(",", "")), cells[4], cells[5], float(cells[6])
        assert tokens_per_s > 0 and ratio > 0
        assert mfu == "n/a" and memory == "n/a"  # no peak FLOP/s or CUDA memory on CPU
    assert re.search(r"Load average \(1/5/15 min\) before: ", text)


def test_gpu_benchmark_rejects_unknown_configs(tmp_path):
    with pytest.raises(ValueError, match="--configs"):
        gpu.main(["--preset", "tiny", "--configs", "fp8:none", "--out", str(tmp_path / "x.md")])
