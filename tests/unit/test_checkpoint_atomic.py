"""Atomic checkpoint commits without processes: swap, fallback, verification, Lightning's "last" lookup.

The checkpoints here are small directories laid out like real ones (``.metadata``, shards,
``meta.pt``, the marker); :mod:`tests.distributed.test_reliability` and the kill campaign
(``scripts/kill_campaign.py``) exercise real saves under real processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para.checkpoint import atomic, swap
from lightning_para.checkpoint.consolidate import consolidate_checkpoint, write_file_atomically


def _write_checkpoint(path: Path, step: int, marked: bool = True) -> Path:
    """A stand-in for a finished sharded checkpoint (every file a real one has, tiny)."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(bytes(range(64)) * step)
    (path / "meta.pt").write_bytes(b"x" * 20)
    if marked:
        atomic.write_marker(path, {"global_step": step})
    return path


def _last_candidates(folder: Path) -> set[str]:
    """What Lightning's `fit(ckpt_path="last")` picks from: ModelCheckpoint's own listing."""
    callback = ModelCheckpoint(dirpath=folder)
    return {Path(p).name for p in callback._find_last_checkpoints(SimpleNamespace())}


def _saved_step(path: Path) -> int:
    return atomic.read_marker(path)["global_step"]


def test_partial_siblings_are_invisible_to_lightnings_last_lookup(tmp_path):
    _write_checkpoint(tmp_path / "last.ckpt", 5)
    partial = _write_checkpoint(atomic.partial_path(tmp_path / "last.ckpt", "abc"), 10, marked=False)
    assert partial.name == ".last.ckpt.partial-abc"
    assert _last_candidates(tmp_path) == {"last.ckpt"}
    assert atomic.newest_complete_checkpoint(tmp_path) == tmp_path / "last.ckpt"


def test_commit_exchanges_an_existing_checkpoint_and_never_leaves_the_name_empty(tmp_path):
    target = _write_checkpoint(tmp_path / "last.ckpt", 5)
    partial = _write_checkpoint(atomic.partial_path(target, "t1"), 10)
    seen = []

    def watching_exchange(a: Path, b: Path) -> None:
        swap._exchange(a, b)
        seen.append(_saved_step(b))  # the instant after the swap: the new one is in place

    swap.commit(partial, target, exchange=watching_exchange)
    assert seen == [10] and _saved_step(target) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the old copy is gone, nothing hidden left
    # A new name is one rename.
    swap.commit(_write_checkpoint(atomic.partial_path(tmp_path / "step=3.ckpt", "t2"), 3), tmp_path / "step=3.ckpt")
    assert _saved_step(tmp_path / "step=3.ckpt") == 3


def test_commit_without_atomic_exchange_keeps_a_complete_last_at_every_instant(tmp_path):
    """Where renameat2 is unsupported, the old copy becomes `last.previous.ckpt` (still `last*.ckpt`)
    before the new one takes the name: a crash between the two renames still resumes from a complete one."""
    target = _write_checkpoint(tmp_path / "last.ckpt", 5)

    def unsupported(a: Path, b: Path) -> None:
        raise OSError(22, "Invalid argument")

    crashed = []
    real_rename = os.rename

    def crash_after_first_rename(src, dst):
        real_rename(src, dst)
        if Path(dst).name == "last.previous.ckpt":
            crashed.append(sorted(_last_candidates(tmp_path)))
            raise KeyboardInterrupt  # stands in for SIGKILL between the two renames

    partial = _write_checkpoint(atomic.partial_path(target, "t1"), 10)
    os_rename, atomic.os.rename = atomic.os.rename, crash_after_first_rename
    try:
        with pytest.raises(KeyboardInterrupt):
            swap.commit(partial, target, exchange=unsupported)
    finally:
        atomic.os.rename = os_rename
    assert crashed == [["last.previous.ckpt"]]
    assert atomic.checkpoint_problems(tmp_path / "last.previous.ckpt").complete
    # The next save sweeps what the crash left once a complete `last.ckpt` exists again.
    swap.commit(_write_checkpoint(atomic.partial_path(target, "t2"), 15), target, exchange=unsupported)
    assert _saved_step(target) == 15
    removed = {p.name for p in swap.sweep_interrupted(tmp_path)}
    assert removed == {".last.ckpt.partial-t1", "last.previous.ckpt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_verification_names_what_is_missing_and_the_newest_complete_checkpoint(tmp_path):
    _write_checkpoint(tmp_path / "step=3.ckpt", 3)
    newest = _write_checkpoint(tmp_path / "step=6.ckpt", 6)
    torn = _write_checkpoint(tmp_path / "last.ckpt", 9, marked=False)
    with pytest.raises(atomic.IncompleteCheckpointError, match=r"last.ckpt' cannot be loaded: it has no completion marker.*"
                       r"newest complete checkpoint in the same folder is '.*step=6.ckpt'"):
        atomic.verify_checkpoint(torn)
    atomic.write_marker(torn, {"global_step": 9})
    (torn / "__0_0.distcp").write_bytes(b"short")
    (torn / "meta.pt").unlink()
    with pytest.raises(atomic.IncompleteCheckpointError) as info:
        atomic.verify_checkpoint(torn)
    assert "`__0_0.distcp` is truncated or changed: 5 bytes, 576 written" in str(info.value)
    assert "`meta.pt` is missing" in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"nowhere.ckpt' cannot be loaded: it does not exist.*step=6.ckpt"):
        atomic.verify_checkpoint(tmp_path / "nowhere.ckpt")
    assert atomic.verify_checkpoint(newest).marker["global_step"] == 6
    # Consolidation refuses an incomplete checkpoint the same way.
    with pytest.raises(atomic.IncompleteCheckpointError, match="`meta.pt` is missing"):
        consolidate_checkpoint(torn)


def test_remove_and_single_file_writes_are_atomic(tmp_path):
    target = _write_checkpoint(tmp_path / "epoch=0-step=3.ckpt", 3)
    swap.remove_checkpoint(target)
    assert list(tmp_path.iterdir()) == []
    single = tmp_path / "model.ckpt"
    write_file_atomically(single, {"state_dict": {"w": torch.ones(2)}})
    write_file_atomically(single, {"state_dict": {"w": torch.zeros(2)}})  # replaces, via exchange
    assert torch.equal(torch.load(single)["state_dict"]["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    assert atomic.checkpoint_problems(single).complete


def test_mark_complete_vouches_only_for_consistent_legacy_checkpoints(tmp_path):
    import torch.distributed.checkpoint as dcp

    legacy = tmp_path / "legacy.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(100.0)}}, checkpoint_id=str(legacy), no_dist=True)
    torch.save({"global_step": 1}, legacy / "meta.pt")
    with pytest.raises(atomic.IncompleteCheckpointError, match="no completion marker"):
        atomic.verify_checkpoint(legacy)
    shard = next(legacy.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:10])
    with pytest.raises(atomic.IncompleteCheckpointError, match=f"`{shard.name}` is shorter than"):
        atomic.mark_checkpoint_complete(legacy)
    shard.write_bytes(data)
    atomic.mark_checkpoint_complete(legacy)
    assert atomic.verify_checkpoint(legacy).complete
