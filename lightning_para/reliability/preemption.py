"""Preemption's pieces: the exit code, the exception every rank raises after the agreed SIGTERM, where its
checkpoint goes, and the callback that runs the step guard's boundary where Lightning's ``ModelCheckpoint`` saves
(the agreement itself is :mod:`lightning_para.reliability.step_guard`'s; ``docs/reliability.md``)."""

from __future__ import annotations

import os
import re
import signal
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

PREEMPTED_EXIT_CODE = 128 + int(signal.SIGTERM)  # 143: "terminated by SIGTERM" for shells, SLURM, Kubernetes


class Preempted(SIGTERMException):
    """Every rank agreed to stop after a signal (SIGTERM): raised at a step boundary, after the
    checkpoint was saved; exits the process with :data:`PREEMPTED_EXIT_CODE`."""

    def __init__(self, message: str, checkpoint: Optional[str]) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


class StepBoundary(Callback):
    """Calls ``end_step()`` (the engine's step boundary) where Lightning's ``ModelCheckpoint`` saves (the end of a
    training batch, after it: callbacks run in list order and Lightning puts checkpoint callbacks last), so a
    preemption checkpoint resumes exactly as a periodic one does."""

    def __init__(self, end_step: Callable[[], None]) -> None:
        self.end_step = end_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # An accumulation micro-step (automatic optimization, no optimizer step yet) issues no collective: the
        # loss it noted is checked by the optimizer step's own all-reduce (ZeRO: no communication on the
        # first A-1 micro-steps).
        accumulating = (
            pl_module.automatic_optimization
            and (batch_idx + 1) % trainer.accumulate_grad_batches != 0
            and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        )
        if not accumulating:
            self.end_step()


def save_hpc_checkpoint(trainer: Any) -> str:
    """Every rank: save through ``trainer.save_checkpoint`` (the strategy's atomic save) under rank 0's next
    :func:`hpc_checkpoint_path` in ``default_root_dir``; returns the path."""
    path = trainer.strategy.broadcast(hpc_checkpoint_path(str(trainer.default_root_dir)))
    trainer.save_checkpoint(path)
    return path


def hpc_checkpoint_path(folder: str) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``folder``: the name Lightning's SLURM requeue saves under and
    ``fit(ckpt_path="hpc")`` (automatic under SLURM) resumes from, the highest ``n`` first."""
    versions = [0]
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            match = re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", name)
            if match:
                versions.append(int(match.group(1)))
    return os.path.join(folder, f"hpc_ckpt_{max(versions) + 1}.ckpt")


__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "StepBoundary", "hpc_checkpoint_path", "save_hpc_checkpoint"]
