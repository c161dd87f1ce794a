"""Checkpoints that defend themselves (issue 24), without processes: checksums, the "newest complete"
suggestion, ``ckpt_path="last"``, the folder lock, a real full disk, ``watchdog_timeout`` vs ``timeout``.

:mod:`tests.distributed.test_checkpoint_defence` runs the same defences through real saves and loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para.checkpoint import atomic, failures, lock
from lightning_para.checkpoint.last import ParaModelCheckpoint
from tests.unit.test_checkpoint_atomic import _write_checkpoint


def _flip_middle(file: Path, count: int = 8) -> None:
    """The fault campaign's corruption: ``count`` bytes inverted in the middle, the size unchanged."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    file.write_bytes(bytes(data))


def test_a_flipped_shard_is_named_by_its_checksum_and_the_previous_checkpoint_suggested(tmp_path):
    previous = _write_checkpoint(tmp_path / "step=3.ckpt", 3)
    corrupt = _write_checkpoint(tmp_path / "step=6.ckpt", 6)
    assert atomic.read_marker(corrupt)["checksum"] == "crc32"
    _flip_middle(corrupt / "__0_0.distcp")
    assert atomic.checkpoint_problems(corrupt).complete  # sizes alone cannot see it
    with pytest.raises(atomic.CorruptCheckpointError) as info:
        atomic.verify_checkpoint(corrupt)
    message = str(info.value)
    assert "`__0_0.distcp` does not match its crc32 checksum written at save" in message
    assert f"newest complete checkpoint in the same folder is {str(previous)!r}" in message
    assert atomic.verify_checkpoint(corrupt, verify_data=False).complete  # the stat-only check, on request


def test_single_files_are_verified_by_their_zip_records(tmp_path):
    from lightning_para.checkpoint.consolidate import write_file_atomically

    single = tmp_path / "model.ckpt"
    write_file_atomically(single, {"state_dict": {"w": torch.randn(4096)}})
    assert atomic.verify_checkpoint(single).complete
    _flip_middle(single)
    with pytest.raises(atomic.CorruptCheckpointError, match="does not match the CRC-32 written at save"):
        atomic.verify_checkpoint(single)


def test_the_newest_complete_suggestion_takes_only_complete_verified_checkpoints(tmp_path):
    good = _write_checkpoint(tmp_path / "step=3.ckpt", 3)
    time.sleep(0.01)
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint at all")  # non-empty, newest by mtime
    _write_checkpoint(tmp_path / "torn.ckpt", 9, marked=False)
    _flip_middle(_write_checkpoint(tmp_path / "step=6.ckpt", 6) / "__0_0.distcp")
    assert not atomic.checkpoint_problems(tmp_path / "junk.ckpt").complete
    assert atomic.newest_complete_checkpoint(tmp_path, verify_data=True) == good
    with pytest.raises(atomic.IncompleteCheckpointError, match=r"newest complete checkpoint .* is '.*step=3.ckpt'"):
        atomic.verify_checkpoint(tmp_path / "torn.ckpt")


def _resolved(callback: ModelCheckpoint) -> set[str]:
    return {Path(p).name for p in callback._find_last_checkpoints(SimpleNamespace())}


def test_last_resolves_to_the_newest_complete_checkpoint_whatever_its_name(tmp_path):
    # 1. A run stopped between `step=8.ckpt` and the `last.ckpt` of the same step: last.ckpt is step 4's.
    folder = tmp_path / "skipped"
    folder.mkdir()
    _write_checkpoint(folder / "step=4.ckpt", 4)
    _write_checkpoint(folder / "last.ckpt", 4)
    _write_checkpoint(folder / "step=8.ckpt", 8)
    future = time.time() + 3600
    os.utime(folder / "last.ckpt", (future, future))  # mtime is not what decides
    assert _resolved(ModelCheckpoint(dirpath=folder)) == {"last.ckpt"}  # Lightning's own: step 4
    assert _resolved(ParaModelCheckpoint(dirpath=folder)) == {"step=8.ckpt"}
    # 2. The first `last.ckpt` was killed mid-save: only its hidden sibling exists, step=4.ckpt is complete.
    folder = tmp_path / "first_last_killed"
    folder.mkdir()
    _write_checkpoint(folder / "step=4.ckpt", 4)
    _write_checkpoint(atomic.partial_path(folder / "last.ckpt", "killed"), 4, marked=False)
    assert _resolved(ModelCheckpoint(dirpath=folder)) == set()  # Lightning's own: start from step 0
    assert _resolved(ParaModelCheckpoint(dirpath=folder)) == {"step=4.ckpt"}
    assert _resolved(ParaModelCheckpoint(dirpath=tmp_path / "not_yet")) == set()


def test_a_second_run_cannot_take_a_live_runs_folder_but_takes_a_dead_ones(tmp_path):
    lock_file = tmp_path / lock.LOCK_FILENAME
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # Another process on this host holds the folder (what its DirectoryLock wrote), refreshed just now.
        first = lock.DirectoryLock("run-one")
        first.acquire(tmp_path)
        first.acquire(tmp_path)  # its own: a refresh
        first.held.clear()  # from here on it stands for the other process's lock
        lock_file.write_text(lock_file.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {alive.pid}'))
        second = lock.DirectoryLock("run-two")
        with pytest.raises(lock.CheckpointDirectoryLockedError) as info:
            second.acquire(tmp_path)
        message = str(info.value)
        assert str(tmp_path) in message and "run run-one" in message and f"pid {alive.pid}" in message
        assert "give this run its own `ModelCheckpoint(dirpath=...)`" in message
    finally:
        alive.kill()
        alive.wait()
    # Its process is gone (crashed): the lock is stale and taken over.
    second.acquire(tmp_path)
    assert '"run": "run-two"' in lock_file.read_text()
    # A later run in this same process (an earlier Trainer's lock) takes it over too.
    third = lock.DirectoryLock("run-three")
    third.acquire(tmp_path)
    second.release()  # no longer its own: left alone
    assert '"run": "run-three"' in lock_file.read_text()
    third.release()
    assert not lock_file.exists()

    # Another host's lock that was not refreshed for longer than STALE_S.
    lock_file.write_text('{"run": "elsewhere", "host": "node7", "pid": 1, "node": "node7/other"}')
    with pytest.raises(lock.CheckpointDirectoryLockedError, match="host node7"):
        third.acquire(tmp_path)
    old = time.time() - lock.STALE_S - 1
    os.utime(lock_file, (old, old))
    third.acquire(tmp_path)
    third.release()


def test_the_disk_full_verdict_walks_dcps_exception_chain(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as error:
        dcp_error = CheckpointException("write", {1: _wrap_exception(error)})
    summary = failures.summarize(dcp_error, 0, tmp_path, needed=10)
    assert summary.kind == "disk_full" and "Errno 28" in summary.text and summary.ranks == (1,)
    # The errno lost (pickled across ranks): the zip writer's short write with less space free than needed.
    lost = CheckpointException("write", {1: _wrap_exception(RuntimeError("unexpected pos 704 vs 598"))})
    assert failures.summarize(lost, 0, tmp_path, needed=1 << 62).kind == "disk_full"
    assert failures.summarize(lost, 0, tmp_path, needed=1).kind == "other"
    kind, message = failures.verdict([summary], tmp_path / "step=4.ckpt", 1234, None, True)
    error = failures.as_error(kind, message)
    assert isinstance(error, failures.CheckpointDiskFullError) and error.errno == 28
    assert "the disk is full" in message and "rank(s) [1]" in message and "needs about 1234 bytes" in message and "partial save was removed" in message


FULL_DISK_SCRIPT = textwrap.dedent("""
    import shutil, sys, torch
    from pathlib import Path
    from lightning_para.checkpoint import atomic, save
    from lightning_para.checkpoint.failures import CheckpointDiskFullError
    folder = Path(sys.argv[1])
    def checkpoint(step):
        return {"state_dict": {"w": torch.randn(150_000)}, "optimizer_states": [], "global_step": step}
    save.save_checkpoint(folder / "step=1.ckpt", checkpoint(1))  # 0.6 MB of 1 MiB
    try:
        save.save_checkpoint(folder / "step=2.ckpt", checkpoint(2))
    except CheckpointDiskFullError as error:
        print("ERROR:", error)
    print("LEFT:", sorted(p.name for p in folder.iterdir()))
    print("FREE:", shutil.disk_usage(folder).free)
    print("KEPT:", atomic.verify_checkpoint(folder / "step=1.ckpt").marker["global_step"])
""")


@pytest.mark.slow
def test_a_real_full_disk_is_named_and_the_partial_save_removed(tmp_path):
    """A 1 MiB tmpfs in a user namespace (skipped where the kernel does not allow one): the real
    ENOSPC through DCP's writer (whose own text is torch.save's `unexpected pos ...`)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no unprivileged user and mount namespaces here")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    shell = f"mount -t tmpfs -o size=1m tmpfs {mount} && {sys.executable} {script} {mount}"
    out = subprocess.run(["unshare", "-rm", "sh", "-c", shell], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert "the disk is full" in lines["ERROR"] and "step=2.ckpt" in lines["ERROR"], out.stdout
    assert "needs about" in lines["ERROR"] and "step=1.ckpt" in lines["ERROR"]
    assert lines["LEFT"] == "['step=1.ckpt']"  # no partial save left behind
    assert int(lines["FREE"]) > 300_000  # its space given back
    assert lines["KEPT"] == "1"


def test_watchdog_timeout_must_be_below_the_collective_timeout():
    from lightning_para import ParaStrategy

    with pytest.raises(ValueError, match=r"`watchdog_timeout=60.0` s must be below `timeout=.*` \(30 s"):
        ParaStrategy(watchdog_timeout=60.0, timeout=timedelta(seconds=30))
    with pytest.raises(ValueError, match="watchdog_timeout=30"):
        ParaStrategy(watchdog_timeout=30, timeout=timedelta(seconds=30))
    ParaStrategy(watchdog_timeout=10.0, timeout=timedelta(seconds=30))
    ParaStrategy(watchdog_timeout=None, timeout=timedelta(seconds=1))
