"""Asynchronous saves (``ParaStrategy(async_save=True)``): training waits only while the state is copied.

A save through an :class:`AsyncSaver` is the synchronous save of :func:`~.save.save_checkpoint`, cut in two:

1. **Staging**, the only part training waits for: DCP's ``DefaultStager`` copies every tensor of this rank's
   checkpoint into host memory (pinned, with non-blocking copies, when the state is on an accelerator) and
   ``meta.pt`` is serialised; then every rank agrees that rank 0 prepared the folder and every rank staged.
2. **In the background**, through DCP's ``async_save`` (its thread): this rank's shards are written, fsynced and
   checksummed, rank 0 writes ``meta.pt``, and the save ends as a synchronous one does
   (:meth:`~.save.ShardedSave.finish`: an agreement over ranks, the completion marker, the atomic swap into place,
   an agreement). These collectives run on a gloo group of all ranks made for saves, so they never interleave
   with training's collectives (and ``async_save`` needs a CPU backend where training runs on NCCL).

At most one save is in flight. :meth:`AsyncSaver.settle` waits for it: the checkpoint is then in place (swapped in
by the background), or its error -- the same on every rank, agreed in the background, naming the path and the
cause -- is raised. The next save, a preemption's save, the end of ``fit``, an exception, a load and teardown settle
first. A failed write is also raised at the next step boundary: :meth:`AsyncSaver.failed` (a host future's state:
no device sync) rides on the step guard's per-step agreement, and every rank settles there. Removals that
``ModelCheckpoint`` asks for meanwhile (its top-k) wait until the new checkpoint is complete, and are dropped if
its save failed. A process killed during the background write leaves the hidden partial save, swept as any
interrupted save's, and the previous checkpoints as they were.

Staging holds a host copy of every tensor storage this rank's checkpoint refers to (:attr:`AsyncSaver.staged_bytes`);
DCP's stager keeps it for the next save, until teardown (``docs/checkpointing.md``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import Tensor
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from lightning_para._dtensor import local_tensor
from lightning_para.checkpoint import failures, swap
from lightning_para.checkpoint.checksums import ChecksummingWriter
from lightning_para.checkpoint.format import write_metadata
from lightning_para.checkpoint.save import ShardedSave, is_rank0
from lightning_para.parallel.tensor.checkpoint import for_dcp


def is_async_checkpoint_io(io: Any) -> bool:
    """Lightning's ``AsyncCheckpointIO`` plugin (its wrapped plugin is unused: saves go through DCP)."""
    return isinstance(io, AsyncCheckpointIO)


class _AlreadyStaged(AsyncStager):
    """Hands ``async_save`` the state staged (and agreed on) before it is called."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict


@dataclass
class _InFlight:
    save: ShardedSave
    done: Future
    removals: list[Path] = field(default_factory=list)


def _storages(tree: Any, found: dict[int, tuple[int, str]]) -> dict[int, tuple[int, str]]:
    """Each tensor storage in ``tree`` (local shards): its bytes and device type, by address (what staging copies)."""
    if isinstance(tree, Tensor):
        storage = local_tensor(tree).untyped_storage()
        found[storage.data_ptr()] = (storage.nbytes(), storage.device.type)
    elif isinstance(tree, dict):
        for value in tree.values():
            _storages(value, found)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _storages(value, found)
    return found


def check_async_save(async_save: Any) -> bool:
    """``ValueError`` naming the argument unless it is a bool; returns it."""
    if not isinstance(async_save, bool):
        raise ValueError(
            f"`async_save={async_save!r}` must be True (sharded saves return once the state is staged in host memory"
            " and are written in the background) or False (every save waits for its write)."
        )
    return async_save


class AsyncSaver:
    """The one save in flight of a run (see the module docstring); one per strategy."""

    def __init__(self) -> None:
        self._stager: Optional[DefaultStager] = None
        self._group: Any = None  # gloo, every rank: the background's collectives
        self._in_flight: Optional[_InFlight] = None
        self.staged_bytes = 0  # this rank's staging copy in host memory, bytes

    def start(self, save: ShardedSave, tensors: dict[str, Any], meta: bytes) -> None:
        """Stage ``tensors`` (blocking), agree, then write ``save`` in the background (collective). The caller
        settled the previous save before ``save`` was prepared (rank 0's sweep of the folder must not take it)."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        failure: Optional[BaseException] = None
        staged: dict[str, Any] = {}
        try:
            staged = for_dcp(self._stage(tensors))
        except failures.SAVE_ERRORS as error:  # e.g. no host memory left for the copy
            failure = error
        save.check(failure)  # rank 0's folder is ready and every rank staged, or every rank raises
        writer = ChecksummingWriter(save.partial)
        done: Future = Future()
        upload = dcp.async_save(
            staged, checkpoint_id=str(save.partial), storage_writer=writer, process_group=self._group,
            async_stager=_AlreadyStaged(),
        )
        self._in_flight = _InFlight(save, done)
        upload.add_done_callback(lambda written: self._finish(written, save, writer, meta, done))

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        storages = _storages(tensors, {})
        if self._stager is None:
            accelerator = any(device != "cpu" for _, device in storages.values())
            # Pinned host memory and non-blocking copies where the state is on an accelerator (CUDA pins).
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=accelerator, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=accelerator,
            ))
        staged_bytes = sum(n for n, _ in storages.values())
        if staged_bytes > self.staged_bytes:
            size = f"{staged_bytes / 2**30:.2f} GiB" if staged_bytes >= 2**30 else f"{staged_bytes / 2**20:.1f} MiB"
            rank_zero_info(
                f"lightning-para: async_save stages {size} of checkpoint tensors per rank in host memory (a copy of"
                " this rank's state, kept for the next save until teardown)."
            )
        self.staged_bytes = max(self.staged_bytes, staged_bytes)
        return self._stager.stage(tensors)

    def _finish(self, written: Future, save: ShardedSave, writer: ChecksummingWriter, meta: bytes, done: Future) -> None:
        """In DCP's background thread once this rank's shards are written (or failed)."""
        try:
            failure = written.exception()
            if failure is None and is_rank0():
                try:
                    write_metadata(save.partial, meta)
                except failures.SAVE_ERRORS as error:
                    failure = error
            save.finish(writer.checksums if failure is None else {}, failure, group=self._group)
        except BaseException as error:  # noqa: BLE001 - raised where the save is settled, on every rank
            done.set_exception(error)
        else:
            done.set_result(None)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def failed(self) -> bool:
        """This rank's background write ended in an error (no wait, no device sync)."""
        in_flight = self._in_flight
        return in_flight is not None and in_flight.done.done() and in_flight.done.exception() is not None

    def remove_after(self, path: Path) -> bool:
        """Defer removing ``path`` until the save in flight is complete (``False``: none is in flight)."""
        if self._in_flight is None:
            return False
        self._in_flight.removals.append(Path(path))
        return True

    def settle(self) -> None:
        """Wait for the save in flight; raise its error (every rank the same one), else run the removals it
        deferred (rank 0)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        in_flight.done.result()
        if is_rank0():
            for path in in_flight.removals:
                swap.remove_checkpoint(path)

    def close(self) -> None:
        """Teardown: free the staging copy and the save group (settle first)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            self._group = None


__all__ = ["AsyncSaver", "check_async_save", "is_async_checkpoint_io"]
