"""Issue 37, without processes: what ``ckpt_path="hpc"``/``"last"`` resume (this run's newest complete
checkpoint, by the step recorded inside it), which runs a folder's checkpoints belong to, hidden leftovers
that Lightning's ``hpc_ckpt_<n>`` lookup must never see, the sweep of a shared folder, the lock's thread.

The scenarios with real processes and signals are in ``tests/integration/test_resume_this_run.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para.checkpoint import atomic, lock, resume
from lightning_para.checkpoint.consolidate import write_file_atomically
from lightning_para.checkpoint.last import ParaModelCheckpoint
from lightning_para.checkpoint.run import RUN_KEY, CheckpointRun, scheduler_run_id


def _sharded(path: Path, step: int, run: str | None, marked: bool = True) -> Path:
    """A stand-in for a finished sharded checkpoint written by ``run`` at ``step`` (tiny real files)."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(bytes(range(64)) * (step + 1))
    (path / "meta.pt").write_bytes(b"x" * 20)
    if marked:
        atomic.write_marker(path, {"global_step": step, **({"run": run} if run else {})})
    return path


def _single(path: Path, step: int, run: str | None) -> Path:
    checkpoint = {"global_step": step, "state_dict": {"w": torch.ones(4)}}
    if run:
        checkpoint[RUN_KEY] = {"run": run, "saved_at": time.time()}
    write_file_atomically(path, checkpoint)
    return path


def _trainer(root: Path, *callbacks: ModelCheckpoint, run: CheckpointRun | None = None) -> SimpleNamespace:
    return SimpleNamespace(default_root_dir=str(root), checkpoint_callbacks=list(callbacks),
                           strategy=SimpleNamespace(checkpoint_run=run))


def test_the_run_id_comes_from_the_user_then_the_scheduler():
    assert scheduler_run_id({}) is None
    assert scheduler_run_id({"SLURM_JOB_ID": "4242"}) == "slurm-4242"
    assert scheduler_run_id({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-7_3"
    assert scheduler_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default: no id
    assert scheduler_run_id({"TORCHELASTIC_RUN_ID": "sweep-a"}) == "torchrun-sweep-a"
    assert scheduler_run_id({"LIGHTNING_PARA_RUN_ID": "mine", "SLURM_JOB_ID": "1"}) == "mine"
    assert CheckpointRun("explicit").id == "explicit"


def test_two_runs_sharing_default_root_dir_each_resume_their_own(tmp_path):
    # Run A (SLURM job 101) saved hpc_ckpt_1 at step 4; run B (job 202) hpc_ckpt_2 at step 6 beside it.
    _sharded(tmp_path / "hpc_ckpt_1.ckpt", 4, "slurm-101")
    _sharded(tmp_path / "hpc_ckpt_2.ckpt", 6, "slurm-202")
    trainer = _trainer(tmp_path)
    assert resume.lightning_hpc_path(tmp_path).name == "hpc_ckpt_2.ckpt"  # Lightning's rule: B's
    assert resume.lookup_request(tmp_path / "hpc_ckpt_2.ckpt", trainer) == "hpc"
    records = resume.candidates(*resume.checkpoint_folders(trainer))
    assert resume.choose(records, CheckpointRun("slurm-101")).path.name == "hpc_ckpt_1.ckpt"
    assert resume.choose(records, CheckpointRun("slurm-202")).path.name == "hpc_ckpt_2.ckpt"
    # A third job has none of its own: refused, naming this run, the others and how to choose.
    with pytest.raises(resume.ResumeCheckpointError) as info:
        resume.choose(records, CheckpointRun("slurm-303"))
    message = str(info.value)
    for expected in ("slurm-303", "run slurm-101", "run slurm-202", "ParaStrategy(run_id=", "LIGHTNING_PARA_RUN_ID"):
        assert expected in message, message
    # No id across restarts (no scheduler): two runs' checkpoints are ambiguous.
    os.environ.pop("LIGHTNING_PARA_RUN_ID", None)
    unknown = CheckpointRun()
    if unknown.fixed is None:
        with pytest.raises(resume.ResumeCheckpointError, match="ambiguous.*2 runs"):
            resume.choose(records, unknown)


def test_the_newest_is_the_step_recorded_inside_never_mtime_or_name(tmp_path):
    folder = tmp_path / "ckpt"
    for step in (4, 6, 8):
        _sharded(folder / f"step={step}.ckpt", step, "r1")
    # A consolidated copy of step 2, written after step 8, with the newest mtime and no marker.
    copy = _single(folder / "zz-consolidated.ckpt", 2, "r1")
    future = time.time() + 1000
    os.utime(copy, (future, future))
    records = resume.candidates([folder])
    assert {r.path.name: r.step for r in records}["zz-consolidated.ckpt"] == 2  # read from inside the file
    assert resume.choose(records, CheckpointRun("r1")).path.name == "step=8.ckpt"
    callback = ParaModelCheckpoint(dirpath=folder)
    assert {Path(p).name for p in callback._find_last_checkpoints(_trainer(tmp_path, callback))} == {"step=8.ckpt"}


def test_last_takes_a_newer_preemption_checkpoint_of_this_run(tmp_path):
    folder = tmp_path / "ckpt"
    _sharded(folder / "last.ckpt", 4, "r1")
    _sharded(tmp_path / "hpc_ckpt_1.ckpt", 5, "r1")
    plain = ModelCheckpoint(dirpath=folder)
    trainer = _trainer(tmp_path, plain)
    assert resume.lookup_request(folder / "last.ckpt", trainer) == "last"
    assert resume.lookup_request(folder / "other.ckpt", trainer) is None  # a path named explicitly
    assert resume.choose(resume.candidates(*resume.checkpoint_folders(trainer)), CheckpointRun("r1")).step == 5
    para = ParaModelCheckpoint(dirpath=folder)
    assert {Path(p).name for p in para._find_last_checkpoints(_trainer(tmp_path, para))} == {"hpc_ckpt_1.ckpt"}


def test_checkpoints_recording_no_run_count_only_where_none_records_one(tmp_path):
    legacy = [atomic.recorded(atomic.checkpoint_problems(_sharded(tmp_path / f"s{s}.ckpt", s, None))) for s in (2, 3)]
    assert resume.choose(legacy, CheckpointRun("slurm-1")).step == 3  # written before runs were recorded
    mine = atomic.recorded(atomic.checkpoint_problems(_sharded(tmp_path / "s1.ckpt", 1, "slurm-1")))
    assert resume.choose([*legacy, mine], CheckpointRun("slurm-1")).step == 1


def test_hidden_leftovers_never_reach_lightnings_hpc_lookup_and_are_swept(tmp_path):
    run = CheckpointRun("slurm-101")
    token = run.new_token()
    # A SIGKILL during the first preemption save leaves this (the name no longer contains `hpc_ckpt_`).
    partial = _sharded(atomic.partial_path(tmp_path / "hpc_ckpt_1.ckpt", token), 4, None, marked=False)
    assert "hpc_ckpt_" not in partial.name and "ckpt_" not in partial.name
    assert resume.lightning_hpc_path(tmp_path) is None  # Lightning: no hpc checkpoint, start from scratch
    # What lightning-para wrote before (digits in the token): Lightning read `hpc_ckpt_11783671.ckpt`.
    legacy = _sharded(tmp_path / ".hpc_ckpt_1.ckpt.partial-1783671", 4, None, marked=False)
    assert resume.lightning_hpc_path(tmp_path).name == "hpc_ckpt_11783671.ckpt"
    other = _sharded(atomic.partial_path(tmp_path / "hpc_ckpt_2.ckpt", CheckpointRun("slurm-202").new_token()),
                     6, None, marked=False)
    removed = CheckpointRun("slurm-101").start([], tmp_path)  # default_root_dir is shared: not locked
    assert sorted(removed) == sorted([partial, legacy])  # its own and the old-style one; not run B's save
    assert other.is_dir() and not (tmp_path / lock.LOCK_FILENAME).exists()
    assert resume.lightning_hpc_path(tmp_path) is None


def test_a_corrupted_marker_is_named_corrupted_not_interrupted(tmp_path):
    path = _sharded(tmp_path / "step=4.ckpt", 4, "r1")
    (path / atomic.MARKER_FILENAME).write_text('{"files": {"meta.pt": 2')
    with pytest.raises(atomic.IncompleteCheckpointError) as info:
        atomic.verify_checkpoint(path)
    assert "is corrupted" in str(info.value) and "interrupted" not in str(info.value)


def _lock_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "para-ckpt-lock" and t.is_alive()]


def test_the_lock_is_held_from_the_start_and_no_thread_outlives_the_run(tmp_path):
    folder = tmp_path / "ckpt"
    run = CheckpointRun("r1")
    others = set(_lock_threads())  # other tests' locks in this process, if any
    run.start([folder], tmp_path)
    ours = set(_lock_threads()) - others
    assert (folder / lock.LOCK_FILENAME).is_file() and len(ours) == 1
    assert lock._read(folder / lock.LOCK_FILENAME)["run"] == "r1"
    # A second run (another live process: the parent here) is refused at its start, not at its first save.
    other = tmp_path / "other"
    other.mkdir()
    (other / lock.LOCK_FILENAME).write_text(json.dumps({**lock._read(folder / lock.LOCK_FILENAME), "pid": os.getppid()}))
    with pytest.raises(lock.CheckpointDirectoryLockedError, match="in use by another run r1"):
        CheckpointRun("r2").start([other], tmp_path)
    run.end()
    assert not any(t.is_alive() for t in ours) and not (folder / lock.LOCK_FILENAME).exists()
    # A save after the run ended holds the folder for that save only, with no thread.
    with run.holding(folder / "after.ckpt"):
        assert (folder / lock.LOCK_FILENAME).is_file() and not set(_lock_threads()) - others
    assert not (folder / lock.LOCK_FILENAME).exists()


def test_a_resume_that_adopts_its_run_renames_the_held_lock(tmp_path):
    folder = tmp_path / "ckpt"
    run = CheckpointRun()
    if run.fixed is not None:
        pytest.skip("a scheduler id is set in this environment")
    run.start([folder], tmp_path)
    run.adopt("run-earlier")
    assert run.id == "run-earlier" and lock._read(folder / lock.LOCK_FILENAME)["run"] == "run-earlier"
    run.end()


def test_a_full_disk_is_reported_without_dcps_raw_traceback_above_it(tmp_path):
    import errno
    import traceback

    from lightning_para.checkpoint import failures, save

    raw = RuntimeError("unexpected pos 704 vs 598")  # what torch.save's zip writer says, the errno lost
    raw.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(failures.CheckpointDiskFullError) as info:
        save.agree(raw, tmp_path / "step=8.ckpt", None, 10)
    printed = "".join(traceback.format_exception(info.value))
    assert "the disk is full" in printed and "unexpected pos" not in printed, printed
    assert info.value.rank_failure is raw  # still there for whoever wants it


def test_an_old_style_leftover_named_by_lightning_is_explained_once_and_swept(tmp_path):
    _sharded(tmp_path / ".hpc_ckpt_1.ckpt.partial-1783671", 4, None, marked=False)  # before names carried the run
    trainer = _trainer(tmp_path)
    named = resume.lightning_hpc_path(tmp_path)
    assert named.name == "hpc_ckpt_11783671.ckpt" and resume.lookup_request(named, trainer) == "hpc"
    run = CheckpointRun("slurm-101")
    resume.begin_run(run, trainer)  # the start sweeps it
    with pytest.raises(resume.ResumeCheckpointError, match="does not exist .* removed when this run started"):
        resume.resume_path(named, trainer, run)
    run.end()
    assert resume.lightning_hpc_path(tmp_path) is None  # the next start finds nothing: from scratch
