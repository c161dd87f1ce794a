"""Issue 37: every resume takes this run's own newest complete state, under real scheduler conditions.

Four separately started ranks per launch, real SIGTERM (rank 0 sends it itself, as SLURM or Kubernetes
would) and a real SIGKILL during a save (``reliability_train.py --kill``), the run told apart by
``SLURM_JOB_ID`` as a requeued SLURM job keeps it:

* runs A (job 101) and B (job 202, another seed) share ``default_root_dir``; both are preempted and save
  ``hpc_ckpt_1`` (A, step 5) and ``hpc_ckpt_2`` (B, step 6) beside each other. Lightning's ``"hpc"`` lookup
  answers B's;
* A resumes with ``ckpt_path="last"``: Lightning answers ``last.ckpt`` (step 3), older than A's preemption
  checkpoint (step 5), and B's step 6 is newer still: A resumes its own step 5;
* A is preempted again and SIGKILLed (a scheduler's kill timeout) during that preemption save: the hidden
  partial it leaves must not break the next start;
* A resumes with ``ckpt_path="hpc"``: its own newest complete checkpoint (step 6, from ``ModelCheckpoint``);
* a third job with no checkpoint of its own is refused, naming the runs and how to choose.

Each resumed run logs the uninterrupted run's losses bit for bit. A pipeline run with
``save_distributed_checkpoint=False`` (started as ``srun`` starts a SLURM job's tasks) saves its preemption
checkpoint sharded, and the requeued job resumes from it with ``ckpt_path=None``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker
from lightning_para.reliability.step_guard import PREEMPTED_EXIT_CODE
from tests.distributed.test_reliability import gpt_fit_job
from tests.integration.kill_helpers import launch

LAYOUT = ("dp2tp2", {"dp": 2, "tp": 2})
A, B = {"SLURM_JOB_ID": "101"}, {"SLURM_JOB_ID": "202"}


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and ".partial-" in p.name)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # five 4-process launches and the reference run
def test_two_runs_sharing_a_folder_preempted_and_killed_each_resume_their_own_newest_state(pools, tmp_path):
    layout, kwargs = LAYOUT
    root, ckpt = tmp_path / "shared", tmp_path / "a_ckpt"
    common = ("--layout", layout, "--steps", "8", "--root-dir", str(root), "--watchdog-timeout", "20")

    a1 = launch(tmp_path / "a1", "external", *common, "--save-every", "3", "--ckpt-dir", str(ckpt),
                "--sigterm", "0:3", env=A)
    a1.wait_all(600)
    assert a1.exit_codes() == {r: PREEMPTED_EXIT_CODE for r in range(4)}, a1.output()[-4000:]
    b = launch(tmp_path / "b", "external", *common, "--seed", "1", "--sigterm", "0:4", env=B)
    b.wait_all(600)
    assert b.exit_codes() == {r: PREEMPTED_EXIT_CODE for r in range(4)}, b.output()[-4000:]
    assert {n: (read_marker(root / n)["run"], read_marker(root / n)["global_step"])
            for n in ("hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt")} == {
        "hpc_ckpt_1.ckpt": ("slurm-101", 5), "hpc_ckpt_2.ckpt": ("slurm-202", 6)}
    assert read_marker(ckpt / "last.ckpt")["global_step"] == 3

    # "last": A's preemption checkpoint (step 5), not last.ckpt (step 3) nor B's newer one. SIGTERM again after
    # step 5, read a step late at step 6 (saved first: step=6, last); the preemption save after step 6 (the third
    # save) is cut by a SIGKILL.
    a2 = launch(tmp_path / "a2", "external", *common, "--save-every", "3", "--ckpt-dir", str(ckpt),
                "--resume", "last", "--sigterm", "0:5", "--kill", "dcp-and-meta-written:0:3", env=A)
    a2.wait_all(600)
    output = a2.output()
    assert a2.exit_codes()[0] == -9, output[-4000:]
    assert f"resuming {str(root / 'hpc_ckpt_1.ckpt')!r}" in output, output[-4000:]
    leftovers = _hidden(root)
    assert len(leftovers) == 1 and "slurm-101" in leftovers[0] and "hpc_ckpt_" not in leftovers[0], leftovers

    # "hpc": Lightning's lookup answers B's hpc_ckpt_2; A resumes its own newest complete state, step 6.
    a3 = launch(tmp_path / "a3", "external", *common, "--save-every", "3", "--ckpt-dir", str(ckpt),
                "--resume", "hpc", env=A)
    a3.wait_all(600)
    assert a3.exit_codes() == {r: 0 for r in range(4)}, a3.output()[-4000:]
    assert _hidden(root) == []  # A's own leftover swept at its start
    assert (root / "hpc_ckpt_2.ckpt").is_dir()  # B's checkpoint untouched

    # A third job (303) asking for "hpc" there has no checkpoint of its own: refused on every rank, naming the
    # runs and how to choose, before anything is loaded.
    c = launch(tmp_path / "c", "external", *common, "--resume", "hpc", env={"SLURM_JOB_ID": "303"})
    c.wait_all(300)
    output = c.output()
    assert all(code not in (0, None) for code in c.exit_codes().values()), output[-4000:]
    assert output.count("ResumeCheckpointError: `ckpt_path=\"hpc\"` found no checkpoint of this run (slurm-303)") == 4
    assert "run slurm-101" in output and "run slurm-202" in output and "ParaStrategy(run_id=" in output

    reference = pools.get(4).run(gpt_fit_job, kwargs, 8)[0]["logged"]
    resumed_last = a2.losses(0, so_far=True)
    assert sorted(resumed_last) == [6], resumed_last
    assert [resumed_last[6]] == reference[5:6]
    resumed_hpc = a3.losses(0)
    assert sorted(resumed_hpc) == [7, 8], resumed_hpc
    assert [resumed_hpc[7], resumed_hpc[8]] == reference[6:8]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_pipeline_run_saving_single_files_is_preempted_into_a_sharded_checkpoint_and_resumes(pools, tmp_path):
    # Started as srun starts a SLURM job's tasks: the requeued job resumes with `ckpt_path=None`.
    common = ("--layout", "pp2dp2", "--steps", "6", "--single-file", "--watchdog-timeout", "20",
              "--root-dir", str(tmp_path / "stopped"))
    stopped = launch(tmp_path / "stopped", "external", *common, "--sigterm", "0:2", slurm="77")
    stopped.wait_all(600)
    assert stopped.exit_codes() == {r: PREEMPTED_EXIT_CODE for r in range(4)}, stopped.output()[-4000:]
    checkpoint = tmp_path / "stopped" / "hpc_ckpt_1.ckpt"
    assert checkpoint.is_dir() and checkpoint_problems(checkpoint).complete  # sharded, whatever the flag says
    resumed = launch(tmp_path / "resumed", "external", *common, slurm="77")  # no --resume: None under SLURM
    resumed.wait_all(600)
    output = resumed.output()
    assert resumed.exit_codes() == {r: 0 for r in range(4)}, output[-4000:]
    assert f"Restoring states from the checkpoint path at {checkpoint}" in output, output[-4000:]
    losses = resumed.losses(0)
    assert sorted(losses) == [5, 6], losses
    reference = pools.get(4).run(gpt_fit_job, {"pp": 2, "dp": 2}, 6)[0]["logged"]
    assert [losses[5], losses[6]] == reference[4:6]
