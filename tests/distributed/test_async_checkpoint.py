"""Asynchronous saves (``async_save=True``) through real gloo groups, under the Trainer and Fabric: dp=2 ZeRO-1,
``tests/integration/async_train.py``, saves every 2 of 8 steps.

* Resuming from a checkpoint written in the background continues with the uninterrupted run's losses bit for bit,
  and its shards hold the same bytes as a synchronous save's of the same step. The planted bug (the background
  writes the live tensors instead of a staged copy, while training goes on) fails that comparison of shards.
* A background write onto a full file system (a real 2 MiB tmpfs: root mounts it; skipped elsewhere) fails the run
  at the next step boundary on every rank, naming the path and the cause; the previous checkpoint is intact.

SIGTERM and SIGKILL during a background write are in ``tests/integration/test_async_kill.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker, verify_checkpoint
from tests.integration.async_train import train

FRONT_ENDS = ("trainer", "fabric")


def options(front_end: str, folder: Path, **extra) -> dict:
    return {"front_end": front_end, "root": str(folder), "ckpt": str(folder / "ckpt"), "steps": 8, "every": 2,
            "save_top_k": -1, **extra}


def resume_from_step4(pool, front_end: str, folder: Path) -> list[dict[int, float]]:
    resumed = pool.run(train, options(front_end, folder / "resumed", every=0, resume=str(folder / "ckpt" / "step=4.ckpt")))
    return [r["losses"] for r in resumed]


def shards(folder: Path, step: int) -> dict[str, str]:
    """The CRC-32 of every shard file of the checkpoint of ``step`` (``meta.pt`` records the save time: not compared)."""
    checksums = read_marker(folder / "ckpt" / f"step={step}.ckpt")["checksums"]
    return {k: v for k, v in checksums.items() if k.endswith(".distcp")}


def after_step4(results: list[dict]) -> list[dict[int, float]]:
    return [{step: loss for step, loss in r["losses"].items() if step > 4} for r in results]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_resume_from_an_async_checkpoint_is_bit_identical(pools, tmp_path, front_end):
    pool = pools.get(2)
    # Every write waits 0.3 s before its shards are written: training goes on meanwhile (a step takes less).
    written = pool.run(train, options(front_end, tmp_path / "async", slow_write=0.3))
    synchronous = pool.run(train, options(front_end, tmp_path / "sync", async_save=False))
    assert all(r["error"] is None for r in written + synchronous), written + synchronous
    assert [r["losses"] for r in written] == [r["losses"] for r in synchronous]
    for step in (2, 4, 6, 8):  # the same bytes as a synchronous save of the same step
        assert shards(tmp_path / "async", step) == shards(tmp_path / "sync", step) != {}
    assert resume_from_step4(pool, front_end, tmp_path / "async") == after_step4(written)  # bit for bit

    # The planted bug: no staging, so the write (1.5 s later) takes the tensors a later step updated.
    planted = pool.run(train, options(front_end, tmp_path / "planted", every=4, slow_write=1.5, planted_no_staging=True))
    assert [r["losses"] for r in planted] == [r["losses"] for r in written]  # training itself is unchanged
    assert shards(tmp_path / "planted", 4) != shards(tmp_path / "sync", 4)


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB tmpfs (one checkpoint of these models fits, two do not); skipped where it cannot be mounted."""
    disk = tmp_path / "small"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a small tmpfs needs root here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_background_write_onto_a_full_disk_fails_the_run_at_the_next_step(pools, tmp_path, small_disk, front_end):
    results = pools.get(2).run(train, options(front_end, tmp_path, ckpt=str(small_disk), save_top_k=1))
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # every rank raised the same error, at the same step
    kind, message, last_step = errors.pop()
    assert kind == "CheckpointDiskFullError", message
    assert f"{small_disk / 'step=4.ckpt'}' failed: the disk is full" in message, message
    # The step-4 save failed in the background while step 5 ran; every rank learned it one step later at the latest.
    assert last_step in (5, 6), last_step
    verify_checkpoint(small_disk / "step=2.ckpt")  # complete, its data matches its checksums
    assert sorted(p.name for p in small_disk.iterdir() if not p.name.startswith(".para_lock")) == ["step=2.ckpt"]
    assert not checkpoint_problems(small_disk / "step=4.ckpt").complete
