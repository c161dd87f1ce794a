"""Issue 24: SIGTERM (as SLURM or Kubernetes send it) on one rank stops every rank at the same step.

Four separately started processes train the GPT recipe for 8 steps; after step 3 rank 0 sends itself
SIGTERM. The flag rides on the per-step all-reduce of ``reliability/step_guard.py``, launched in step 4 and
read one step late (no host sync per step), so every rank learns it in step 5, saves ``hpc_ckpt_1.ckpt``
(the atomic save path) after step 5 and exits with code 143. Before: under ``dp2 x tp2 zero=3`` every rank stalled for the watchdog timeout and blamed
"stuck" ranks; under ``pp2 x dp2`` every rank exited 0 in under 3 s; neither saved anything.
Resuming with ``ckpt_path="hpc"`` (Lightning's SLURM convention) logs the uninterrupted run's
losses for steps 6-8 bit for bit (checked under ``dp2 x tp2 zero=3``; the resume path is the same for both).
"""

from __future__ import annotations

import pytest

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker
from lightning_para.reliability.step_guard import PREEMPTED_EXIT_CODE
from tests.distributed.test_reliability import gpt_fit_job
from tests.integration.kill_helpers import launch

LAYOUTS = {"dp2tp2z3": {"dp": 2, "tp": 2, "zero": 3}, "pp2dp2": {"pp": 2, "dp": 2}}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three 4-process runs of 8 steps
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigterm_on_rank0_saves_a_checkpoint_and_every_rank_exits_143(pools, tmp_path, layout):
    run = launch(tmp_path / "stopped", "external", "--layout", layout, "--steps", "8", "--sigterm", "0:3",
                 "--watchdog-timeout", "120")
    ended = run.wait_all(600)
    output = run.output()
    assert run.exit_codes() == {r: PREEMPTED_EXIT_CODE for r in range(4)}, output[-4000:]
    # Together (the last rank within a few seconds on an idle machine: process teardown), not after a
    # watchdog timeout (120 s here) as before.
    assert max(ended.values()) - min(ended.values()) < 30.0, ended
    assert output.count("lightning-para: stopped after SIGTERM: saved the checkpoint") == 4, output[-4000:]
    assert "watchdog" not in output
    checkpoint = tmp_path / "stopped" / "hpc_ckpt_1.ckpt"
    assert checkpoint_problems(checkpoint).complete and read_marker(checkpoint)["global_step"] == 5

    if layout != "dp2tp2z3":
        return  # resuming from Lightning's "hpc" checkpoint does not depend on the layout: checked once (CI time)
    resumed = launch(tmp_path / "resumed", "external", "--layout", layout, "--steps", "8", "--resume", "hpc",
                     "--root-dir", str(tmp_path / "stopped"))
    resumed.wait_all(600)
    assert resumed.exit_codes() == {r: 0 for r in range(4)}, resumed.output()[-4000:]
    losses = resumed.losses(0)
    assert sorted(losses) == [6, 7, 8], losses
    reference = pools.get(4).run(gpt_fit_job, LAYOUTS[layout], 8)[0]["logged"]
    assert [losses[s] for s in (6, 7, 8)] == reference[5:]
