"""``async_save`` in one process (no process group): the option, Lightning's ``AsyncCheckpointIO``, a save written
in the background, settled, its deferred removals, and a failed background write raised at the step guard's next
check. Real ranks, SIGTERM, SIGKILL and a real full disk: ``tests/distributed/test_async_checkpoint.py`` and
``tests/integration/test_async_kill.py``.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from lightning_para.checkpoint import AsyncSaver, CheckpointDiskFullError, CheckpointSaveError, save
from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker, verify_checkpoint
from lightning_para.checkpoint.checksums import ChecksummingWriter
from lightning_para.reliability.step_guard import StepGuard


def checkpoint(step: int) -> dict:
    torch.manual_seed(step)
    return {"state_dict": {"w": torch.randn(1000), "b": torch.randn(10)}, "optimizer_states": [], "global_step": step}


def test_the_option_and_lightnings_async_checkpoint_io():
    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_para import ParaStrategy
    from lightning_para.fabric import ParaStrategy as FabricParaStrategy

    with pytest.raises(ValueError, match=r"`async_save='yes'` must be True"):
        ParaStrategy(async_save="yes")
    assert ParaStrategy().core.checkpoints.saver is None
    strategy = ParaStrategy(async_save=True, check_finite=False, on_sigterm=None)
    assert isinstance(strategy.core.checkpoints.saver, AsyncSaver)
    assert strategy.core.run_guard.guard.active  # the step guard's agreement carries a failed background write
    # Lightning's plugin means the same (its wrapped CheckpointIO is unused: saves go through DCP).
    assert isinstance(ParaStrategy(checkpoint_io=AsyncCheckpointIO()).core.checkpoints.saver, AsyncSaver)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ParaStrategy(), plugins=[AsyncCheckpointIO()], logger=False)
    assert isinstance(trainer.strategy.core.checkpoints.saver, AsyncSaver)
    with pytest.raises(NotImplementedError, match="async_save=True"):
        FabricParaStrategy(checkpoint_io=AsyncCheckpointIO())


def test_a_background_save_is_the_synchronous_one_and_removals_wait_for_it(tmp_path):
    save.save_checkpoint(tmp_path / "sync.ckpt", checkpoint(3))
    saver = AsyncSaver()
    old = tmp_path / "step=1.ckpt"
    save.save_checkpoint(old, checkpoint(1))
    save.save_checkpoint(tmp_path / "step=3.ckpt", checkpoint(3), saver=saver)
    assert saver.remove_after(old)  # ModelCheckpoint's top-k: only once step 3 is complete
    saver.settle()
    assert not old.exists() and not saver.in_flight
    written, synchronous = (read_marker(tmp_path / name)["checksums"] for name in ("step=3.ckpt", "sync.ckpt"))
    assert {k: v for k, v in written.items() if k.endswith(".distcp")} == {k: v for k, v in synchronous.items() if k.endswith(".distcp")}
    verify_checkpoint(tmp_path / "step=3.ckpt")
    assert not saver.remove_after(tmp_path / "sync.ckpt")  # nothing in flight: the caller removes it now
    saver.close()


@pytest.mark.parametrize("code, error, cause", [
    (errno.ENOSPC, CheckpointDiskFullError, "failed: the disk is full"),  # a real full tmpfs: tests/distributed/
    (errno.EACCES, CheckpointSaveError, r"failed on rank\(s\) \[0\]: .*Permission denied"),
], ids=["full-disk", "permission"])
def test_a_failed_background_write_is_raised_at_the_next_step_check(tmp_path, monkeypatch, code, error, cause):
    saver, guard = AsyncSaver(), StepGuard(on_sigterm=None)
    guard.background = saver
    save.save_checkpoint(tmp_path / "step=2.ckpt", checkpoint(2))

    def fail(self, plan, planner):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ChecksummingWriter, "write_data", fail)
    save.save_checkpoint(tmp_path / "step=4.ckpt", checkpoint(4), saver=saver)  # returns once staged
    assert saver.remove_after(tmp_path / "step=2.ckpt")
    deadline = time.monotonic() + 60
    while not saver.failed() and time.monotonic() < deadline:
        time.sleep(0.01)
    guard.check(5)  # carries the failure; every rank reads it at the next check
    with pytest.raises(error, match=rf"step=4.ckpt' {cause}"):
        guard.check(6)
    assert checkpoint_problems(tmp_path / "step=2.ckpt").complete  # kept: its removal waited for a complete step 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]  # the partial save removed
