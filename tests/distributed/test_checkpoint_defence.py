"""Checkpoints that defend themselves (issue 24) through real saves and loads on gloo groups (world 2):
a full disk during a save, ``ckpt_path="last"`` after a stop between two saves, two runs in one folder.

The flipped shard is in :mod:`tests.distributed.test_reliability` (it reuses that module's checkpoints);
:mod:`tests.unit.test_checkpoint_defence` has the process-free checks and a real full tmpfs.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_para.checkpoint.atomic import checkpoint_problems, partial_path, read_marker
from lightning_para.reliability.processes import node_fingerprint
from tests.models import RegressionNet, regression_dataset
from tests.parity import ShardedData, trainer_kwargs

DATA = functools.partial(regression_dataset, 160)
LOCK_FILENAME = ".para_lock.json"  # lightning_para.checkpoint.lock's; spelled out so this module also runs on older code
EVERY = 4


class StartStep(Callback):
    """The global step the fit started from (where the checkpoint left it)."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


class _NoSpace:
    """A file whose writes fail as they do on a full disk (the OS error, raised by DCP's real write path)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def full_disk_for(rank: int, folder_part: Optional[str]):
    """Inside a worker: the shard files ``rank`` writes into a save whose path contains ``folder_part``
    hit a full disk (DCP's ``FileSystem.create_stream`` hands out a stream whose writes raise ENOSPC)."""
    if folder_part is None:
        yield
        return
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            full = folder_part in str(path) and Path(path).name.startswith(f"__{rank}_")
            yield _NoSpace(stream) if full else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = original


def defence_job(
    ckpt_dir: str, max_steps: int, resume: Optional[str] = None, para_last: bool = True,
    full_disk: Optional[str] = None, seed: int = 0,
) -> dict[str, Any]:
    """Inside a worker: RegressionNet under ZeRO-1, a checkpoint every 4 steps and ``last.ckpt``."""
    from lightning_para import ParaStrategy

    world = dist.get_world_size()
    L.seed_everything(seed, verbose=False)
    start = StartStep()
    if para_last:
        from lightning_para.checkpoint import ParaModelCheckpoint as ModelCheckpointClass
    else:
        ModelCheckpointClass = ModelCheckpoint
    checkpoints = ModelCheckpointClass(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1, save_last=True
    )
    trainer = L.Trainer(
        devices=world, strategy=ParaStrategy(zero=1), max_steps=max_steps, callbacks=[start, checkpoints],
        use_distributed_sampler=False, **trainer_kwargs(enable_checkpointing=True, limit_val_batches=0),
    )
    with full_disk_for(1, full_disk):
        trainer.fit(RegressionNet(), datamodule=ShardedData(DATA, 16 // world), ckpt_path=resume)
    return {"start": start.step, "step": trainer.global_step}


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> Path:
    """8 steps: step=4.ckpt, step=8.ckpt and last.ckpt (step 8)."""
    folder = tmp_path_factory.mktemp("defence") / "ckpt"
    pools.get(2).run(defence_job, str(folder), 8)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    return folder


def test_last_resumes_from_the_newest_complete_checkpoint(pools, saved, tmp_path):
    pool = pools.get(2)
    # 1. Stopped between `step=8.ckpt` and the `last.ckpt` of step 8: `last.ckpt` still holds step 4.
    skipped = tmp_path / "skipped"
    shutil.copytree(saved, skipped)
    shutil.rmtree(skipped / "last.ckpt")
    shutil.copytree(saved / "step=4.ckpt", skipped / "last.ckpt")
    assert read_marker(skipped / "last.ckpt")["global_step"] == 4
    plain = pool.run(defence_job, str(skipped), 10, "last", False)[0]
    # Lightning's own lookup (files named last*.ckpt) answers the older `last.ckpt`; the strategy's load
    # replaces it by this run's newest complete checkpoint (issue 37), with Lightning's ModelCheckpoint too.
    assert plain["start"] == 8
    shutil.rmtree(skipped)
    shutil.copytree(saved, skipped)
    shutil.rmtree(skipped / "last.ckpt")
    shutil.copytree(saved / "step=4.ckpt", skipped / "last.ckpt")
    assert pool.run(defence_job, str(skipped), 10, "last")[0]["start"] == 8

    # 2. The first `last.ckpt` was killed mid-save: its hidden sibling only; `step=4.ckpt` is complete.
    first = tmp_path / "first_last_killed"
    first.mkdir()
    shutil.copytree(saved / "step=4.ckpt", first / "step=4.ckpt")
    shutil.copytree(saved / "step=4.ckpt", partial_path(first / "last.ckpt", "killed"))
    (partial_path(first / "last.ckpt", "killed") / "para_complete.json").unlink()
    assert pool.run(defence_job, str(first), 6, "last")[0]["start"] == 4  # Lightning's own: 0 (from scratch)


def test_a_full_disk_during_a_save_is_named_on_every_rank_and_cleaned_up(pools, tmp_path):
    """Rank 1's shard writes of the step-8 save fail with ENOSPC: every rank raises the same error
    (no hang), the partial save is gone and the step-4 checkpoints are intact."""
    folder = tmp_path / "full"
    with pytest.raises(Exception) as info:
        pools.get(2).run(defence_job, str(folder), 8, None, False, "step=8", keep_alive_on_error=True)
    assert sorted(info.value.errors) == [0, 1], info.value
    for traceback in info.value.errors.values():
        assert "CheckpointDiskFullError" in traceback and "the disk is full" in traceback, traceback[-3000:]
        assert f"{str(folder / 'step=8.ckpt')!r}" in traceback and "rank(s) [1]" in traceback
        assert "bytes free now; this save needs about" in traceback and "The partial save was removed" in traceback
        assert f"the newest complete one is {str(folder / 'last.ckpt')!r}" in traceback
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=4.ckpt"]  # no partial, no lock left
    for name in ("last.ckpt", "step=4.ckpt"):
        assert checkpoint_problems(folder / name).complete and read_marker(folder / name)["global_step"] == 4


def test_a_second_run_in_the_same_folder_is_refused_and_destroys_nothing(pools, tmp_path):
    """Another live run holds the folder and has a save in progress: this run's first save raises on
    every rank, naming the folder and the other run, and the other run's save is left alone."""
    folder = tmp_path / "shared"
    folder.mkdir()
    in_progress = partial_path(folder / "last.ckpt", "otherrun")
    in_progress.mkdir()
    (in_progress / "__0_0.distcp").write_bytes(b"half written")
    other = {"run": "otherrun", "host": "this-host", "pid": os.getpid(), "node": node_fingerprint(), "started_at": 0}
    (folder / LOCK_FILENAME).write_text(json.dumps(other))
    with pytest.raises(Exception) as info:
        pools.get(2).run(defence_job, str(folder), 8, None, False, keep_alive_on_error=True)
    assert sorted(info.value.errors) == [0, 1], info.value
    for traceback in info.value.errors.values():
        assert "CheckpointDirectoryLockedError" in traceback, traceback[-3000:]
        assert str(folder) in traceback and "run otherrun" in traceback and f"pid {os.getpid()}" in traceback
    assert (in_progress / "__0_0.distcp").read_bytes() == b"half written"  # not swept
    assert json.loads((folder / LOCK_FILENAME).read_text())["run"] == "otherrun"
