"""Which checkpoint a resume loads: this run's newest complete one, or an error naming why not.

Lightning turns ``fit(ckpt_path="hpc")`` (and ``ckpt_path=None`` under SLURM) into the highest
``hpc_ckpt_<n>.ckpt`` of ``default_root_dir``, reading every digit of every name that contains
``hpc_ckpt_``, and ``ckpt_path="last"`` into the newest ``last*.ckpt`` by mtime
(``_CheckpointConnector._parse_ckpt_path``), before the strategy is involved. Both can pick another
run's checkpoint (two runs sharing ``default_root_dir``), an older one (``last.ckpt`` beside a newer
preemption checkpoint) or a name that does not exist (a hidden leftover's digits).

So the strategy's load recognises a path that came out of those lookups (:func:`lookup_request`) and
replaces it by :func:`choose`'s answer over every checkpoint folder of the trainer: the newest complete
checkpoint of this run (:mod:`.run`), by the global step recorded inside it, never by mtime or name.
A path the user names explicitly (:func:`named_path`; ``last.ckpt`` too, which Lightning's ``"last"``
would also answer) is loaded as it is, whichever run wrote it. Refused, with a :class:`ResumeCheckpointError`
naming the runs and how to choose:

* the folders hold checkpoints, but none of this run (they were written by other runs);
* this run has no id that survives restarts, and the folders hold checkpoints of several runs.

Checkpoints that record no run (written by plain Lightning, or by lightning-para before runs were
recorded) count as this run's only where no checkpoint in the folders records a run.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_para.checkpoint import atomic
from lightning_para.checkpoint.lock import CheckpointDirectoryLockedError
from lightning_para.checkpoint.run import RUN_ID_ENV, CheckpointRun

HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


class ResumeCheckpointError(ValueError):
    """``ckpt_path="hpc"``/``"last"`` found no checkpoint of this run to resume, or cannot tell which run is this one."""


def local_folder(folder: Any) -> Optional[Path]:
    if folder is None or "://" in str(folder):  # a remote filesystem: Lightning's own lookups stand
        return None
    return Path(folder)


def lightning_hpc_path(folder: Any) -> Optional[Path]:
    """What Lightning's ``"hpc"`` lookup answers for ``folder`` (its rule, reproduced: the largest number
    made of the digits after ``hpc_ckpt_`` in any name that contains it), ``None`` if nothing."""
    folder = local_folder(folder)
    if folder is None or not folder.is_dir():
        return None
    versions = []
    for name in os.listdir(folder):
        if "hpc_ckpt_" in name:
            digits = re.sub("[^0-9]", "", name.split("hpc_ckpt_")[-1])
            if digits:
                versions.append(int(digits))
    return folder / f"hpc_ckpt_{max(versions)}.ckpt" if versions else None


def _same(a: Any, b: Any) -> bool:
    return os.path.normpath(os.path.abspath(str(a))) == os.path.normpath(os.path.abspath(str(b)))


def _checkpoint_callbacks(trainer: Any) -> list[ModelCheckpoint]:
    return [cb for cb in getattr(trainer, "checkpoint_callbacks", []) or [] if isinstance(cb, ModelCheckpoint)]


def lookup_request(path: Any, trainer: Any, run: Optional[CheckpointRun] = None) -> Optional[str]:
    """``"hpc"`` or ``"last"`` if ``path`` is what Lightning's lookup of that name answers for ``trainer``
    (now, or when ``run`` started, before its sweep), so the user asked for the newest checkpoint, not for
    this file; else ``None``."""
    for hpc in (lightning_hpc_path(getattr(trainer, "default_root_dir", None)), run and run.hpc_lookup_at_start):
        if hpc is not None and _same(path, hpc):
            return "hpc"
    for callback in _checkpoint_callbacks(trainer):
        if callback.dirpath is not None and local_folder(callback.dirpath) is not None:
            try:  # private: see docs/architecture.md (Lightning's own "last" candidates of this callback)
                lasts = callback._find_last_checkpoints(trainer)
            except ResumeCheckpointError:
                continue  # ParaModelCheckpoint refuses "last" here, so Lightning's "last" did not name this path
            if any(_same(path, last) for last in lasts):
                return "last"
    return None


def named_path(trainer: Any) -> bool:
    """Whether the user named a path as ``ckpt_path`` of the ``Trainer`` method running now (read from that call's
    frame: Lightning has turned ``"last"``/``"hpc"`` into a path before the strategy sees it)."""
    entries = {getattr(type(trainer), name).__code__ for name in ("fit", "validate", "test", "predict")
               if hasattr(getattr(type(trainer), name, None), "__code__")}
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code in entries and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path") not in (None, "last", "hpc")
        frame = frame.f_back
    return False


def checkpoint_folders(trainer: Any) -> tuple[list[Path], Optional[Path]]:
    """Every ``ModelCheckpoint`` folder of ``trainer`` (local ones) and ``default_root_dir`` (where
    preemption checkpoints ``hpc_ckpt_<n>.ckpt`` go)."""
    folders = []
    for callback in _checkpoint_callbacks(trainer):
        folder = local_folder(callback.dirpath)
        if folder is not None and not any(_same(folder, f) for f in folders):
            folders.append(folder)
    return folders, local_folder(getattr(trainer, "default_root_dir", None))


def candidates(folders: Iterable[Path], hpc_folder: Optional[Path] = None) -> list[atomic.Recorded]:
    """The complete checkpoints (``*.ckpt``, not hidden) in ``folders``, and the ``hpc_ckpt_<n>.ckpt`` in
    ``hpc_folder``, with what each records (run, step, save time)."""
    paths: dict[str, Path] = {}
    for folder in folders:
        if folder.is_dir():
            for entry in folder.iterdir():
                if not entry.name.startswith(".") and entry.suffix == ".ckpt":
                    paths.setdefault(os.path.realpath(entry), entry)
    if hpc_folder is not None and hpc_folder.is_dir():
        for entry in hpc_folder.iterdir():
            if HPC_NAME.fullmatch(entry.name):
                paths.setdefault(os.path.realpath(entry), entry)
    found = []
    for path in sorted(paths.values()):
        status = atomic.checkpoint_problems(path)
        if status.complete:
            found.append(atomic.recorded(status))
    return found


def _listing(records: Iterable[atomic.Recorded]) -> str:
    by_run: dict[str, list[atomic.Recorded]] = {}
    for r in records:
        by_run.setdefault(r.run or "(no run recorded)", []).append(r)
    parts = []
    for run, rs in sorted(by_run.items()):
        newest = max(rs, key=lambda r: r.order)
        parts.append(f"run {run}: {len(rs)} checkpoint(s), the newest {str(newest.path)!r} at global step {newest.step}")
    return "; ".join(parts)


def _how_to_choose(runs: list[str]) -> str:
    example = runs[0] if runs else "<id>"
    return (
        f" To continue one of them, give this run its id: `ParaStrategy(run_id={example!r})` (or the environment"
        f" variable {RUN_ID_ENV}={example}); or pass the checkpoint's path as `ckpt_path`, which loads it as named."
    )


def choose(records: list[atomic.Recorded], run: CheckpointRun, request: str = "hpc") -> Optional[atomic.Recorded]:
    """This run's newest complete checkpoint among ``records``; ``None`` if there is none at all; raises
    :class:`ResumeCheckpointError` where the checkpoints belong to other runs, or to several runs and this
    run's id is unknown (see the module docstring)."""
    recording = [r for r in records if r.run]
    runs = sorted({r.run for r in recording if r.run})
    if run.fixed is not None:
        mine = [r for r in records if r.run == run.fixed]
        if not mine and recording:
            raise ResumeCheckpointError(
                f'`ckpt_path="{request}"` found no checkpoint of this run ({run.fixed}): the checkpoint folders hold'
                f" only other runs' ({_listing(records)}). Loading one would continue another run's training."
                + _how_to_choose(runs) + " To start this run from scratch, give it its own `default_root_dir`"
                " (under SLURM, `ckpt_path=None` is `\"hpc\"` when that folder holds an `hpc_ckpt_<n>.ckpt`)."
            )
        mine = mine or records
    else:
        if len(runs) > 1:
            raise ResumeCheckpointError(
                f'`ckpt_path="{request}"` is ambiguous: this run has no id that survives a restart (no'
                f" `ParaStrategy(run_id=...)`, {RUN_ID_ENV} or scheduler job id such as SLURM_JOB_ID), and the"
                f" checkpoint folders hold checkpoints of {len(runs)} runs ({_listing(records)})." + _how_to_choose(runs)
            )
        mine = recording or records
    return max(mine, key=lambda r: r.order) if mine else None


def _resolve_on_rank0(requested: str, trainer: Any, run: CheckpointRun) -> tuple[str, Optional[str], Optional[str]]:
    """(the path to load, its run, an error message)."""
    try:
        request = None if named_path(trainer) else lookup_request(requested, trainer, run)
    except ResumeCheckpointError as error:  # ParaModelCheckpoint's own "last" refused
        return requested, None, str(error)
    if request is None:  # named explicitly: loaded as named (the load verifies it)
        status = atomic.checkpoint_problems(requested)
        return requested, atomic.recorded(status).run if status.complete else None, None
    folders, hpc_folder = checkpoint_folders(trainer)
    try:
        chosen = choose(candidates(folders, hpc_folder), run, request)
    except ResumeCheckpointError as error:
        return requested, None, str(error)
    if chosen is None and not Path(requested).exists():  # the digits of an old-style leftover, swept at the start
        where = ", ".join(repr(str(f)) for f in [*folders, *([hpc_folder] if hpc_folder else [])])
        return requested, None, (
            f'`ckpt_path="{request}"` led Lightning to {requested!r}, which does not exist (its lookup read the digits'
            " of a hidden leftover of an interrupted save, removed when this run started), and there is no complete"
            f" checkpoint in {where}. Start again: without a checkpoint Lightning's lookup now finds none (under SLURM"
            " the requeued job starts from scratch)."
        )
    if chosen is None:  # nothing complete: the load names what is wrong with Lightning's choice
        return requested, None, None
    return str(chosen.path), chosen.run, None


def resume_path(requested: Any, trainer: Any, run: CheckpointRun) -> Path:
    """Collective: the checkpoint a load of ``requested`` really loads, decided on rank 0 (module docstring);
    every rank adopts its run (where this run's id is not fixed) or raises the same error."""
    decided = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            decided = _resolve_on_rank0(str(requested), trainer, run)
        except Exception as error:  # noqa: BLE001 - every rank must leave the broadcast below with the same verdict
            decided = (str(requested), None, f"Choosing the checkpoint for {str(requested)!r} failed on rank 0:"
                       f" {type(error).__name__}: {error}")
    if dist.is_initialized():
        box = [decided]
        dist.broadcast_object_list(box, src=0)
        decided = box[0]
    path, chosen_run, error = decided
    if error is not None:
        raise ResumeCheckpointError(error)
    run.adopt(chosen_run)
    if not _same(path, requested):
        rank_zero_info(
            f"lightning-para: resuming {path!r}, this run's newest complete checkpoint (run {run.id}), in place of"
            f" {str(requested)!r}, which Lightning's lookup named."
        )
    elif chosen_run and chosen_run != run.id:
        rank_zero_warn(f"lightning-para: loading {path!r} as named; run {chosen_run} wrote it, this run is {run.id}.")
    return Path(path)


def begin_run(run: CheckpointRun, trainer: Any) -> None:
    """Collective, when ``fit`` starts: rank 0 holds every checkpoint folder of ``trainer`` and sweeps the
    leftovers of interrupted saves (:meth:`CheckpointRun.start`); every rank raises the same
    :class:`~.lock.CheckpointDirectoryLockedError` if another live run holds one."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        folders, hpc_folder = checkpoint_folders(trainer)
        try:
            run.hpc_lookup_at_start = lightning_hpc_path(hpc_folder)
            run.start(folders, hpc_folder)
        except CheckpointDirectoryLockedError as locked:
            error = ("locked", str(locked))
        except OSError as failed:  # e.g. a folder that cannot be created: every rank raises, none waits
            error = ("os", f"Preparing the checkpoint folders {[str(f) for f in folders]} failed on rank 0: {failed}")
    else:
        run.active = True
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        run.end()
        kind, message = error
        raise CheckpointDirectoryLockedError(message) if kind == "locked" else OSError(message)


__all__ = [
    "HPC_NAME", "ResumeCheckpointError", "begin_run", "candidates", "checkpoint_folders", "choose",
    "lightning_hpc_path", "lookup_request", "named_path", "resume_path",
]
