"""Per-machine calibration of the planner's CPU step time (issue 23, item 3)."""

from __future__ import annotations

import pytest
import torch

from lightning_para.plan import calibrate as cal
from lightning_para.plan.run import CPU_PROCESS, local_cluster


def test_calibration_is_cached_per_thread_budget_and_used_by_local_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PARA_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    assert cal.cached_calibration(threads) is None
    before = local_cluster(2, 2, torch.device("cpu"))
    assert before.peak_flops == CPU_PROCESS["peak_flops"]  # nominal without a calibration
    first = cal.calibrate(threads, measure_comm=False)  # real matmul measurement; gloo in the slow test
    assert first.matmul_flops > 1e6 and first.key == cal.machine_key(threads)
    assert (tmp_path / "calibration.json").exists()
    again = cal.calibrate(threads, measure_comm=False)
    assert again == first  # served from the cache, not measured again
    assert cal.cached_calibration(threads + 1) is None  # keyed by the thread budget
    cluster = local_cluster(2, 2, torch.device("cpu"))
    assert cluster.peak_flops == first.matmul_flops and cluster.efficiency == 1.0


@pytest.mark.slow
def test_gloo_sweep_fits_alpha_beta():
    bandwidth, latency = cal.measure_gloo(sizes=(4096, 1 << 20), repeats=3)
    assert 1e6 < bandwidth < 1e12 and 0 <= latency < 0.1
