"""Per-machine calibration of the planner's CPU step time (issue 23, item 3)."""

from __future__ import annotations

import pytest
import torch

from lightning_para import calibrate as cal
from lightning_para.instrument.operators import TrafficCounter
from lightning_para.calibrate.machine import CPU_PROCESS, local_cluster
from lightning_para.plan.gemm import Gemm


def test_calibration_is_cached_per_thread_budget_and_used_by_local_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PARA_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    assert cal.cached_calibration(threads) is None
    before = local_cluster(2, 2, torch.device("cpu"))
    assert before.peak_flops == CPU_PROCESS["peak_flops"]  # nominal without a calibration
    first = cal.calibrate(threads, measure_comm=False, measure_dtensor=False)  # gloo, DTensor: slow tests
    assert first.matmul_flops > 1e6 and first.key == cal.machine_key(threads)
    assert (tmp_path / "calibration.json").exists()
    again = cal.calibrate(threads, measure_comm=False, measure_dtensor=False)
    assert again == first  # served from the cache, not measured again
    assert cal.cached_calibration(threads + 1) is None  # keyed by the thread budget
    # Measured with the machine's cores all busy, as in a run: cores // threads processes at once.
    from lightning_para.threads import available_cores

    assert first.processes == max(1, available_cores() // threads)
    assert 1e6 < first.elementwise_bandwidth < 1e13 and first.matmul_efficiency is None  # no workload given
    cluster = local_cluster(2, 2, torch.device("cpu"))
    share = min(1.0, available_cores() / (2 * threads))
    assert cluster.peak_flops == pytest.approx(first.matmul_flops * share) and cluster.efficiency == 1.0
    assert cluster.elementwise_bandwidth == pytest.approx(first.elementwise_bandwidth * share)
    # This machine's GEMM curve: timed at GEMM_CURVE_SHAPES, fitted, and given to the planner.
    assert cluster.gemm == first.gemm_model() and len(first.gemm_curve) == len(cal.GEMM_CURVE_SHAPES)
    # The fit itself is tested on known curves (tests/unit/test_gemm_model.py); live timings on a shared host are
    # only checked for sanity here: a timing is never a pass/fail test.
    assert all(s > 0 for *_, s in first.gemm_curve) and cluster.gemm.seconds(Gemm(*cal.GEMM_CURVE_SHAPES[0])) > 0


def test_matmul_efficiency_is_interpolated_in_log_tokens_and_held_at_the_ends():
    from lightning_para.plan import Cluster

    cluster = Cluster(nodes=1, gpus_per_node=1, memory_bytes=1e9, peak_flops=1e10, intra_node_bw=1e9,
                      inter_node_bw=1e9, efficiency_by_tokens=((256.0, 0.3), (1024.0, 0.5)))
    assert cluster.matmul_efficiency(100) == 0.3 and cluster.matmul_efficiency(4096) == 0.5
    assert cluster.matmul_efficiency(512) == pytest.approx(0.4)  # halfway in log2: 8 -> 9 -> 10
    gpu = Cluster.of("h100", nodes=1)
    assert gpu.matmul_efficiency(512) == gpu.efficiency  # presets: one figure
    with pytest.raises(ValueError, match="efficiency_by_tokens"):
        Cluster(nodes=1, gpus_per_node=1, memory_bytes=1e9, peak_flops=1e10, intra_node_bw=1e9, inter_node_bw=1e9,
                efficiency_by_tokens=((256.0, 1.5),))


def test_elementwise_bandwidth_counts_bytes_read_and_written():
    x = torch.randn(1000, requires_grad=True)
    with TrafficCounter() as counter:
        y = x * 2.0  # reads 4,000 bytes, writes 4,000 (the scalar is not a tensor)
        y.view(10, 100).transpose(0, 1)  # views move nothing
        torch.mm(torch.randn(4, 4), torch.randn(4, 4))  # matmuls are priced by their FLOPs
    assert (counter.ops, counter.bytes) == (3, 8000 + 2 * 64)  # the two randn outputs
    bandwidth = cal.measure_elementwise_bandwidth(1, tokens=256, width=64, repeats=3)
    assert bandwidth > 1e6 and bandwidth != float("inf")  # a sanity floor, not a timing assertion (a loaded host's clock)


@pytest.mark.slow
def test_gloo_sweep_fits_alpha_beta():
    bandwidth, latency = cal.measure_gloo(sizes=(4096, 1 << 20), repeats=3)
    assert 1e6 < bandwidth < 1e12 and 0 <= latency < 0.1


def test_alpha_beta_fit_recovers_a_clean_line_and_survives_noise_that_inverts_it():
    sizes = (4096, 65536, 1 << 20)
    alpha, beta = 2e-5, 3e9
    bandwidth, latency = cal.fit_alpha_beta(sizes, [2 * alpha + n / beta for n in sizes])
    assert bandwidth == pytest.approx(beta, rel=1e-9) and latency == pytest.approx(alpha, rel=1e-9)
    # CI once timed a 4 KiB all-reduce slower than a 1 MiB one under load: the slope went negative and the
    # fit claimed 1e15 bytes/s. Now the largest message's rate is used, a lower bound on bandwidth.
    bandwidth, latency = cal.fit_alpha_beta((4096, 1 << 20), [9e-4, 5e-4])
    assert bandwidth == pytest.approx((1 << 20) / 5e-4) and latency == pytest.approx(2.5e-4)
    with pytest.raises(ValueError, match="at least 2"):
        cal.fit_alpha_beta((4096,), [1e-4])


@pytest.mark.slow
def test_lightning_para_calibrate_caches_the_recipe_dtensor_cost_and_the_step_overhead(tmp_path, monkeypatch):
    from lightning_para.cli import main

    monkeypatch.setenv("LIGHTNING_PARA_CACHE", str(tmp_path))
    assert main(["calibrate", "1", "--no-comm"]) == 0
    found = cal.cached_calibration(1)
    assert found is not None and found.threads == 1
    assert found.op_seconds < found.dtensor_op_seconds < 0.1  # DTensor's dispatch costs more than a plain op
    # the optimizer step's DTensor operators are timed apart: cheap elementwise updates, below a block's
    assert 0 < found.dtensor_optimizer_op_seconds < found.dtensor_op_seconds
    assert 0 < found.step_overhead_seconds < 1.0
    # the recipe's blocks against square matmuls, at 256 and 1,024 tokens
    assert [t for t, _ in found.matmul_efficiency] == [256.0, 1024.0]
    assert all(0.05 <= e <= 1.0 for _, e in found.matmul_efficiency)
    figures = found.cluster_figures()
    # This machine's GEMM curve is timed too; the recipe's efficiency is kept as its fraction of the curve at the
    # recipe's own matmuls (forward and backward, as dispatched), which the planner multiplies by a model's curve.
    assert len(found.gemm_curve) == len(cal.GEMM_CURVE_SHAPES) and all(s > 0 for *_, s in found.gemm_curve)
    assert sorted(found.matmul_shapes) == ["1024.0", "256.0"]
    assert figures["gemm"] == found.gemm_model()
    for (tokens, within), (_, measured) in zip(figures["efficiency_by_tokens"], found.matmul_efficiency):
        on_curve = figures["gemm"].efficiency_of([Gemm(*s) for s in found.matmul_shapes[str(tokens)]], training=False)
        assert within == pytest.approx(min(1.0, measured / on_curve))
    assert figures["dtensor_op_seconds"] == found.dtensor_op_seconds
    assert figures["dtensor_optimizer_op_seconds"] == found.dtensor_optimizer_op_seconds
    assert figures["step_overhead_seconds"] == found.step_overhead_seconds
    assert main(["calibrate", "0"]) == 2  # a thread budget below 1 is refused


def _exits_without_a_result(out) -> None:  # a measurement process that dies (module level: spawn pickles it)
    raise SystemExit(3)


def test_a_measurement_process_that_dies_is_an_error_not_a_hang():
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Calibrating the test probe failed: its process exited with \[3\]"):
        cal.run_measurement(_exits_without_a_result, [()], timeout=120.0, what="the test probe")
    assert time.monotonic() - start < 60  # not the timeout: the dead process is noticed
