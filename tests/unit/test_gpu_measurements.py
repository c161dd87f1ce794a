"""The planner against steps measured on a GPU (issue 23): ``benchmarks/gpu_step_model.py``'s records.

Each JSON in ``benchmarks/results/gpu_step_model_h*.json`` is one run of the GPT recipe at Llama 3 8B's
widths on a lent H100 or H200 (``benchmarks/results/gpu_step_model_h100.md``): its step time, its allocated peak,
and the GEMM efficiency and element-wise bandwidth measured in the same process. The planner, given those two
figures, must reproduce the step and the peak; a change to the cost or memory model that moves it away from
real hardware fails here (the records are measurements, not the planner's own output).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.gpu_fake_world import predict as predict_rank
from benchmarks.gpu_step_model import predict

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RECORDS = sorted(RESULTS.glob("gpu_step_model_h*.json"))


def test_the_records_are_there():
    assert len(RECORDS) >= 7, RECORDS


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.stem.removeprefix("gpu_step_model_"))
def test_planner_reproduces_the_measured_gpu_step_and_peak(record: Path):
    run = json.loads(record.read_text())
    args = argparse.Namespace(**{k: run["args"][k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                                                                "seq", "batch", "recompute", "precision")})
    planned = predict(args, run["elementwise"]["bandwidth"], run["matmul"]["efficiency"], run["args"].get("gpu", "h100"))
    planned = planned["measured_efficiency_and_bandwidth"]
    measured = run["recipe"]
    step_error = planned["step_seconds"] / measured["step_seconds"] - 1
    memory_error = planned["memory_gib"] / measured["max_allocated_gib"] - 1
    # Measured: -12% to -6% on the step; -0.5% to +0.7% on the peak since autocast's memory is priced as measured
    # (fp32 residual stream, weight copies only outside recomputed blocks, the cross-entropy's 16-bit logits);
    # -6% to 0% before, under every bf16-mixed record.
    assert -0.15 <= step_error <= 0.05, (step_error, planned, measured["step_seconds"])
    assert -0.03 <= memory_error <= 0.03, (memory_error, planned, measured["max_allocated_gib"])


def test_the_script_runs_its_measurements_and_counts_anywhere(tmp_path):
    """``gpu_step_model.py --tiny --skip-recipe`` on CPU: the GEMM, bandwidth and traffic-count code paths."""
    from benchmarks.gpu_step_model import main

    out = tmp_path / "tiny.json"
    assert main(["--tiny", "--skip-recipe", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["matmul"]["flops_per_s"] > 0 and run["elementwise"]["bandwidth"] > 0
    counted = run["traffic_coefficients"]["128:4:2:384 bf16-mixed"]
    assert counted["accumulate_per_grad_byte"] == pytest.approx(3.0)
    assert counted["layer_per_param_byte"] == pytest.approx(3.0, rel=0.05)  # autocast's two casts


def test_loss_logits_and_master_gradients_are_priced_where_they_are_held():
    from dataclasses import replace

    from lightning_para.plan import Cluster, Layout, Training, estimate
    from lightning_para.plan.model import ModelDesc

    model = ModelDesc(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, name="x")
    cluster = Cluster.of("h100", nodes=1, gpus_per_node=1)
    mixed = Training(seq_len=8192, global_batch=2, micro_batch=2, precision="bf16-mixed")
    memory = estimate(model, cluster, mixed, Layout()).memory
    assert memory.loss_logits == 2 * 8192 * 2 * 128256  # bf16 logits, held while the loss runs
    assert memory.master_grads == 0  # no separate master under autocast
    true = replace(mixed, precision="bf16-true")
    memory = estimate(model, cluster, true, Layout()).memory
    assert memory.master_grads == pytest.approx(4 * model.total_params())  # the master's fp32 gradient, ZeRO-0
    assert memory.model_states == pytest.approx(16 * model.total_params(), rel=1e-3)  # the ZeRO paper's stays
    megatron = replace(true, activation_profile="megatron")
    memory = estimate(model, cluster, megatron, Layout()).memory
    assert memory.loss_logits == 0 and memory.master_grads == 0  # Megatron-LM's stack: not ParaStrategy's


FAKE_WORLD_RECORDS = sorted(RESULTS.glob("gpu_fake_world_h*.json"))


@pytest.mark.parametrize("record", FAKE_WORLD_RECORDS, ids=lambda p: p.stem.removeprefix("gpu_fake_world_"))
def test_planner_reproduces_the_allocated_peak_of_a_rank_on_a_gpu(record: Path):
    """Rank 0 of an 8- or 128-rank job of the recipe at Llama 3 8B's widths (ZeRO-3; on the H200 also ZeRO-1, ZeRO-2
    and ZeRO-1 with tp=2), run with real CUDA kernels under the fake process group (``benchmarks/gpu_fake_world.py``;
    ``benchmarks/results/gpu_fake_world.md``). Measured: -0.2% to +5.5%. Before the autocast terms (fp32 residual
    stream and gathers, the weight copies kept only outside recomputed blocks, the cross-entropy's 16-bit logits)
    the bf16-mixed runs were -13% to -19%; before the vocab-parallel log-softmax's fp32 copies, the tp=2 run -37%."""
    run = json.loads(record.read_text())
    measured = run["steps"][-1]["max_allocated_gib"]
    planned = predict_rank(run["world"], run["layers"], run["precision"], run["recompute"], run["seq"], run["batch"],
                           loss_upcast=run.get("loss_upcast", False), zero=run.get("zero", 3), tp=run.get("tp", 1))
    error = planned.memory.total / 2**30 / measured - 1
    assert -0.03 <= error <= 0.07, (error, measured)


def test_the_fake_world_records_are_there():
    assert len(FAKE_WORLD_RECORDS) >= 15, FAKE_WORLD_RECORDS
