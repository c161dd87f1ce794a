"""Writing Lightning checkpoints for a parallelized model, atomically, with every rank agreeing on the outcome.

:func:`save_checkpoint` writes Lightning's checkpoint dict as a sharded DCP directory (or one consolidated file)
through :mod:`.atomic`'s protocol; a sharded save is a :class:`ShardedSave` (prepared by rank 0, written by every
rank, finished by one agreement, the marker and the swap), run to its end here or, with an
:class:`~.async_save.AsyncSaver`, staged here and finished in the background. Every step ends in an agreement over
ranks (:func:`agree`), so a failure on one rank raises the same error on all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from lightning_para.checkpoint import atomic, failures, swap
from lightning_para.checkpoint.consolidate import write_file_atomically
from lightning_para.checkpoint.format import metadata_bytes, save_sharded
from lightning_para.checkpoint.run import CheckpointRun

T = TypeVar("T")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def from_rank0(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, the same value on every rank (so all ranks take the same branch)."""
    if not dist.is_initialized():
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any, group: Any = None) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def agree(
    failure: Optional[BaseException], path: Path, partial: Optional[Path], needed_here: int, payload: Any = None,
    group: Any = None,
) -> list[Any]:
    """Collective (over ``group``, default: the world): if any rank failed, rank 0 removes ``partial`` and every
    rank raises the same error; otherwise every rank's ``payload``, in rank order.

    A sync point even when nothing failed (it replaces a barrier), so no rank goes on into the next
    step of the save (or the next collective of training) while another has failed.
    """
    folder = path.parent
    mine = failures.summarize(failure, rank(), folder, needed_here) if failure is not None else None
    gathered = gather((mine, needed_here, payload), group)
    summaries = [s for s, _, _ in gathered if s is not None]
    if not summaries:
        return [p for _, _, p in gathered]
    decided = None
    if is_rank0():
        removed = partial is not None and (partial.exists() or partial.is_symlink())
        if removed:
            swap.remove_partial(partial)
        newest = atomic.newest_complete_checkpoint(folder) if folder.is_dir() else None
        needed = failures.checkpoint_bytes(newest) or sum(n for _, n, _ in gathered)
        decided = failures.verdict(summaries, path, needed, newest, removed)
    if dist.is_initialized():
        box = [decided]
        dist.broadcast_object_list(box, src=0, group=group)
        decided = box[0]
    error = failures.as_error(*decided)
    error.rank_failure = failure  # this rank's own exception, if any (None where another rank failed)
    if isinstance(error, failures.CheckpointDiskFullError):
        # The message names the errno, the ranks and the space; DCP's chained `CheckpointException` (each
        # rank's traceback, e.g. "unexpected pos 704 vs 598") printed above it would only bury it.
        raise error from None
    raise error from failure


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class ShardedSave:
    """One sharded save (every rank): where it goes, what its marker records, the bytes this rank writes,
    rank 0's hold on the folder (released when the save ends) and rank 0's failure preparing it."""

    path: Path
    partial: Path
    info: dict[str, Any]
    needed: int
    hold: contextlib.ExitStack
    failure: Optional[BaseException] = None

    def check(self, failure: Optional[BaseException] = None) -> None:
        """Collective: rank 0 prepared the folder and no rank failed (``failure``: this rank's), else every rank
        raises the same error (the hold released)."""
        try:
            agree(self.failure or failure, self.path, self.partial, self.needed)
        except BaseException:
            self.hold.close()
            raise

    def finish(self, sums: dict[str, str], failure: Optional[BaseException], group: Any = None) -> None:
        """Collective over ``group`` once every rank wrote its shards (rank 0 also ``meta.pt``) or failed: agree,
        rank 0 marks the checkpoint complete (``sums``: this rank's checksums) and swaps it into place, agree. The
        one finish of synchronous and asynchronous saves (:mod:`.async_save`: in the background)."""
        try:
            # Every rank's shards (fsynced by DCP), DCP's `.metadata` and `meta.pt` are on disk after this agreement.
            everyone = agree(failure, self.path, self.partial, self.needed, sums, group)
            removable: Optional[Path] = self.partial
            failure = None
            if is_rank0():
                try:
                    atomic.write_marker(self.partial, self.info, {k: v for rank_sums in everyone for k, v in rank_sums.items()})
                    removable = None  # from here on `partial` may hold the previous checkpoint (exchanged): keep it
                    swap.commit(self.partial, self.path)
                except failures.SAVE_ERRORS as error:
                    failure = error
            agree(failure, self.path, removable, self.needed, group=group)  # no rank reads `path` before it is in place
        finally:
            self.hold.close()


def save_checkpoint(
    path: Path,
    checkpoint: dict[str, Any],
    *,
    sharded: bool = True,
    token: Optional[str] = None,
    run: Optional[CheckpointRun] = None,
    saver: Optional[Any] = None,
) -> None:
    """Write Lightning's ``checkpoint`` dict (collective), atomically (see :mod:`.atomic`).

    Model and optimizer states go through DCP, the rest into ``meta.pt``, all into a hidden
    sibling of ``path`` that rank 0 marks complete and swaps into place once every rank has
    written. Each rank checksums the shards it wrote; the marker records every file's CRC-32.
    ``sharded=False``: the dict already holds the full state on rank 0 (:mod:`.full_state`),
    which writes it as one ordinary file beside ``path`` and swaps it into place; the other ranks
    write nothing.
    ``token`` names the sibling (the same on every rank; drawn by rank 0 when not given).
    ``run``: the run this save belongs to (:mod:`.run`): recorded in the checkpoint and its marker; rank 0
    holds the folder for it (:mod:`.lock`) before sweeping it.
    ``saver``: an :class:`~.async_save.AsyncSaver`: a sharded save returns once the state is staged, and is
    written and swapped into place in the background (errors are raised when the saver settles it).

    A failure on any rank (a full disk, a locked folder, a write error) makes every rank raise the
    same error (:class:`~.failures.CheckpointDiskFullError`, :class:`~.lock.CheckpointDirectoryLockedError`,
    :class:`~.failures.CheckpointSaveError`) after rank 0 removed the partial save; the checkpoints
    already in the folder are untouched.
    """
    path = Path(path)
    failure: Optional[BaseException] = None
    run = run if run is not None else CheckpointRun()
    recorded = run.record(checkpoint)
    if not sharded:
        if is_rank0():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with run.holding(path):
                    run.sweep(path)  # leftovers of earlier interrupted saves
                    write_file_atomically(path, checkpoint)  # removes its hidden sibling if it fails
            except failures.SAVE_ERRORS as error:
                failure = error
        # No rank reads `path` (or saves again) before it is in place.
        agree(failure, path, None, failures.tensor_bytes(checkpoint) if is_rank0() else 0)
        return
    token = token or from_rank0(atomic.new_token)
    info = {k: checkpoint.get(k) for k in ("epoch", "global_step")}
    info["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    info.update(recorded)
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    save = ShardedSave(path, atomic.partial_path(path, token), info, failures.tensor_bytes(tensors), contextlib.ExitStack())
    if is_rank0():  # the folder, this run's hold on it, no leftovers, the sibling every rank writes into
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save.hold.enter_context(run.holding(path))  # for this save only when outside `fit`
            run.sweep(path, keep=save.partial)  # leftovers of earlier interrupted saves
            save.partial.mkdir()
        except failures.SAVE_ERRORS as error:
            save.failure = error
    if saver is not None:
        saver.start(save, tensors, metadata_bytes(checkpoint))
        return
    save.check()
    sums: dict[str, str] = {}
    try:
        sums = save_sharded(save.partial, tensors, checkpoint)
    except failures.SAVE_ERRORS as error:
        failure = error
    save.finish(sums, failure)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint (rank 0) without ever leaving a half-deleted one under its name."""
    swap.remove_checkpoint(path)


__all__ = ["ShardedSave", "agree", "from_rank0", "gather", "is_rank0", "rank", "remove_checkpoint", "save_checkpoint"]
