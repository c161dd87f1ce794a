"""``ckpt_path="last"`` as the newest complete checkpoint in the folder, whatever its name.

Lightning resolves ``fit(ckpt_path="last")`` in ``_CheckpointConnector._parse_ckpt_path``: it asks every
``ModelCheckpoint`` for ``_find_last_checkpoints(trainer)`` -- the files named ``last*.ckpt`` in its
folder -- and takes the one modified last. A kill between ``step=8.ckpt`` and the ``last.ckpt`` of
the same step leaves ``last.ckpt`` at step 4, and a kill during the very first ``last.ckpt`` leaves
none at all (the run restarts from step 0 although ``step=4.ckpt`` is complete). That happens
before the strategy is asked to load anything (and with no path, it is not asked at all), so the
hook is the callback: :class:`ParaModelCheckpoint` answers with this run's newest *complete* checkpoint
in its folder and among the preemption checkpoints of ``default_root_dir``, ordered by the step recorded
inside each (:func:`~lightning_para.checkpoint.resume.choose`), not by name or mtime. Under
``ParaStrategy`` the load applies the same rule to every checkpoint folder of the trainer.

With Lightning's own ``ModelCheckpoint``, :func:`warn_if_newer` (called by the load) warns when the
checkpoint being loaded is older than a complete one beside it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para.checkpoint.atomic import checkpoint_problems, recorded
from lightning_para.checkpoint.resume import local_folder, candidates, choose
from lightning_para.checkpoint.run import CheckpointRun


class ParaModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (every argument the same) whose ``"last"`` is this run's newest
    complete checkpoint in its folder or among ``default_root_dir``'s preemption checkpoints:
    ``trainer.fit(ckpt_path="last")`` never skips a newer complete checkpoint, never starts from scratch
    while one exists, and never takes another run's (it raises
    :class:`~lightning_para.checkpoint.resume.ResumeCheckpointError` naming the runs)."""

    def _find_last_checkpoints(self, trainer) -> set[str]:  # private: see docs/architecture.md
        folder = self._ModelCheckpoint__resolve_ckpt_dir(trainer)  # private: see docs/architecture.md
        if not Path(folder).is_dir():  # not created yet, or a remote filesystem: Lightning's own lookup
            return super()._find_last_checkpoints(trainer)
        run = getattr(getattr(trainer, "strategy", None), "checkpoint_run", None)
        records = candidates([Path(folder)], local_folder(getattr(trainer, "default_root_dir", None)))
        newest = choose(records, run if isinstance(run, CheckpointRun) else CheckpointRun(), "last")
        return {os.path.normpath(newest.path)} if newest is not None else set()


def newer_complete_checkpoint(path: Path) -> Optional[Path]:
    """A complete checkpoint of the same run beside ``path`` with a later step (by what each records), or ``None``."""
    mine = checkpoint_problems(path)
    if not mine.complete:
        return None
    me = recorded(mine)
    newer = [
        r for r in candidates([path.parent])
        if r.run == me.run and r.order > me.order and r.path.resolve() != path.resolve()
    ]
    return max(newer, key=lambda r: r.order).path if newer else None


def warn_if_newer(path: Path) -> None:
    """Warn (rank 0) when a ``last*.ckpt`` being loaded is older than a complete checkpoint of its run beside it."""
    if not path.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST):
        return
    newer = newer_complete_checkpoint(path)
    if newer is not None:
        step = recorded(checkpoint_problems(newer)).step
        warnings.warn(
            f"Loading {str(path)!r}, but {str(newer)!r} (global step {step}) is a complete checkpoint of the same run"
            " saved after it (a run stopped between the two saves). `ParaModelCheckpoint` in place of `ModelCheckpoint` makes"
            ' `ckpt_path="last"` the newest complete checkpoint; or pass that path as `ckpt_path`.',
            stacklevel=2,
        )


__all__ = ["ParaModelCheckpoint", "newer_complete_checkpoint", "warn_if_newer"]
