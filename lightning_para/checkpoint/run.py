"""Which run a checkpoint belongs to, and this run's hold on its checkpoint folders.

**What "this run" is.** One training run survives restarts (a preemption, a requeue, a crash
followed by ``fit(ckpt_path=...)``), so its id must not be a process's. In this order:

1. ``ParaStrategy(run_id=...)``, or the environment variable :data:`RUN_ID_ENV`;
2. the scheduler's id of the job, which a requeue keeps: SLURM (``SLURM_ARRAY_JOB_ID`` and
   ``SLURM_ARRAY_TASK_ID`` for an array task, else ``SLURM_JOB_ID``), ``torchrun``'s
   ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; not its default ``"none"``), PBS (``PBS_JOBID``) and LSF
   (``LSB_JOBID``, ``LSB_JOBINDEX``);
3. otherwise the run of the checkpoint a resume loads (a resume continues that run), or, for a run
   that starts from scratch, a new random id.

Every save records the id: in the checkpoint itself (:data:`RUN_KEY`, so ``meta.pt``, single files and
consolidated copies carry it) and in the completion marker of a sharded directory (read without
loading anything). :mod:`.resume` reads it back.

**The hold.** :class:`CheckpointRun` takes the folder lock (:mod:`.lock`) of every ``ModelCheckpoint``
folder when ``fit`` starts, sweeps their leftovers of interrupted saves, and gives them back (and stops
the lock's refresh thread) in the strategy's teardown. A save made outside ``fit`` (a
``trainer.save_checkpoint`` after it) holds its folder for that save only, with no thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

from lightning_para.checkpoint import atomic, swap
from lightning_para.checkpoint.lock import DirectoryLock

RUN_ID_ENV = "LIGHTNING_PARA_RUN_ID"
RUN_KEY = atomic.RUN_KEY  # in Lightning's checkpoint dict: {"run": id, "saved_at": time}


def scheduler_run_id(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The id of this run given by the user's environment or the scheduler (see the module docstring),
    ``None`` when there is none."""
    env = os.environ if environ is None else environ
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID") and env["TORCHELASTIC_RUN_ID"] != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if env.get("PBS_JOBID"):
        return f"pbs-{env['PBS_JOBID']}"
    if env.get("LSB_JOBID"):
        index = env.get("LSB_JOBINDEX", "0")
        return f"lsf-{env['LSB_JOBID']}" + (f"_{index}" if index not in ("", "0") else "")
    return None


def name_tag(run_id: str) -> str:
    """The run id as it appears in hidden file names (no path separators, no ``ckpt_``)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", run_id)[:40]


class CheckpointRun:
    """This run's identity and its hold on its checkpoint folders (one per strategy).

    ``run_id``: the explicit id (``ParaStrategy(run_id=...)``); without one, the environment's or the
    scheduler's (:func:`scheduler_run_id`), else a random id until a resume adopts its checkpoint's run.
    """

    def __init__(self, run_id: Optional[str] = None) -> None:
        self.fixed: Optional[str] = run_id or scheduler_run_id()  # known across restarts
        self._id = self.fixed or f"run-{atomic.new_token()}"
        self.lock = DirectoryLock(self._id)
        self.active = False  # inside a fit: folders stay held (and refreshed) until `end`
        self._shared: Optional[Path] = None  # default_root_dir, where other runs may save too
        # What Lightning's "hpc" lookup named when the run started, before the sweep (:mod:`.resume`).
        self.hpc_lookup_at_start: Optional[Path] = None

    @property
    def id(self) -> str:
        return self._id

    def adopt(self, run_id: Optional[str]) -> None:
        """A resume continues the run of its checkpoint (only where no id was given or found)."""
        if run_id and self.fixed is None and run_id != self._id:
            self._id = run_id
            self.lock.rename(run_id)  # rank 0's lock files now name the run it continues
            if self.active and self._shared is not None:
                self.sweep_shared(self._shared)  # that run's own leftovers in default_root_dir

    def new_token(self) -> str:
        """Names one save's hidden siblings; it starts with the run, so a sweep can tell its own leftovers."""
        return f"{name_tag(self._id)}-{atomic.new_token()}"

    def record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Write this run into Lightning's checkpoint dict; return the marker's fields for it."""
        checkpoint[RUN_KEY] = {"run": self._id, "saved_at": time.time()}
        return {"run": self._id}

    # ------------------------------------------------------------------ the hold (rank 0)
    def start(self, folders: Iterable[Path], hpc_folder: Optional[Path]) -> list[Path]:
        """The run starts: hold every checkpoint folder, sweep their leftovers; in ``hpc_folder``
        (``default_root_dir``, which runs may share) sweep only this run's own leftovers and those no
        current version writes. Returns what was removed. Raises
        :class:`~.lock.CheckpointDirectoryLockedError` if another live run holds one."""
        self.active = True
        removed: list[Path] = []
        held = set()
        for folder in folders:
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            self.lock.acquire(folder)
            held.add(folder.resolve())
            removed += swap.sweep_interrupted(folder)
        if hpc_folder is not None and Path(hpc_folder).resolve() not in held:
            self._shared = Path(hpc_folder)
            removed += self.sweep_shared(self._shared)
        return removed

    def sweep_shared(self, folder: Path, keep: Optional[Path] = None) -> list[Path]:
        """Leftovers in a folder other runs may share: this run's own, and old-style hidden names that
        Lightning's ``hpc_ckpt_<n>`` lookup would misread (written by lightning-para before names
        carried the run)."""
        mine = [f"{tag}{name_tag(self._id)}-" for tag in atomic.HIDDEN_TAGS]
        return swap.sweep_interrupted(
            folder, keep=keep, only=lambda name: any(m in name for m in mine) or "ckpt_" in name
        )

    def shares(self, path: Path) -> bool:
        """A preemption checkpoint (``hpc_ckpt_<n>.ckpt``) in a folder this run does not hold: runs started
        from one directory all save theirs into ``default_root_dir``, so it is neither locked nor swept
        beyond this run's own leftovers."""
        return re.fullmatch(r"hpc_ckpt_\d+\.ckpt", path.name) is not None and path.parent.resolve() not in self.lock.held

    def sweep(self, path: Path, keep: Optional[Path] = None) -> list[Path]:
        """Rank 0, before a save to ``path``: the leftovers of interrupted saves in its folder."""
        if self.shares(path):
            return self.sweep_shared(path.parent, keep=keep)
        return swap.sweep_interrupted(path.parent, keep=keep)

    @contextlib.contextmanager
    def holding(self, path: Path) -> Iterator[None]:
        """Rank 0, around one save to ``path``: its folder held for the run while it is active; otherwise
        (a save after ``fit``) for this save only, with no refresh thread; not at all where it
        :meth:`shares` the folder."""
        folder = path.parent
        if self.shares(path):
            yield
            return
        if self.active:
            self.lock.acquire(folder, refresh=True)
            yield
            return
        self.lock.acquire(folder, refresh=False)
        try:
            yield
        finally:
            self.lock.release()

    def end(self) -> None:
        """The run ends (teardown): stop the refresh thread and give every folder back."""
        self.active = False
        self._shared = None
        self.lock.release()


__all__ = ["RUN_ID_ENV", "RUN_KEY", "CheckpointRun", "name_tag", "scheduler_run_id"]
