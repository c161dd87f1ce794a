"""A failed save, agreed over ranks: which error every rank raises, and whether the disk was full.

DCP gathers each rank's write errors into one ``CheckpointException`` (raised on every rank), but its
text for a full disk is that of ``torch.save``'s zip writer (``unexpected pos 704 vs 598``), with the
``OSError`` nested in its per-rank failures or lost. :func:`summarize` walks the chain (causes,
contexts and DCP's per-rank failures) for ``ENOSPC``/``EDQUOT``; where the errno was lost, a write
error with less space free than the save needs counts as a full disk too. :func:`verdict` (rank 0,
over every rank's summary) words one error; :func:`as_error` raises the same class on every rank.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from lightning_para._dtensor import local_tensor
from lightning_para.checkpoint.atomic import read_marker
from lightning_para.checkpoint.lock import CheckpointDirectoryLockedError

SAVE_ERRORS = (Exception, CheckpointException)  # DCP's exception is a BaseException
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
# What torch.save's zip writer says when a write fell short (its errno is not kept).
_SHORT_WRITE_TEXTS = ("unexpected pos", "file write failed", "failed writing")


class CheckpointDiskFullError(OSError):
    """A save ran out of disk space: the partial save was removed, the earlier checkpoints are kept."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (every rank raises it); the partial save was removed."""


@dataclass(frozen=True)
class FailureSummary:
    """One rank's failed step of a save, as rank 0 needs it (picklable)."""

    rank: int
    kind: str  # "disk_full", "locked" or "other"
    ranks: tuple[int, ...]  # where it happened: DCP's exception names the failed ranks on every rank
    text: str  # the error's type and first line
    free_bytes: Optional[int]  # on the checkpoint's filesystem, when it failed


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank errors a DCP ``CheckpointException`` carries."""
    stack: list[Optional[BaseException]] = [error]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            stack += [wrapped[0] for wrapped in current.failures.values() if isinstance(wrapped, tuple) and wrapped]


def free_bytes(folder: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


def summarize(error: BaseException, rank: int, folder: Path, needed: int) -> FailureSummary:
    """This rank's view of its failure; ``needed``: bytes the whole save was expected to write."""
    free = free_bytes(folder)
    chain = list(error_chain(error))
    ranks = tuple(sorted(error.failures)) if isinstance(error, CheckpointException) else (rank,)
    if isinstance(error, CheckpointDirectoryLockedError):
        return FailureSummary(rank, "locked", ranks, str(error), free)
    full = any(isinstance(e, OSError) and e.errno in _FULL_ERRNOS for e in chain)
    full = full or any(t in str(e) for e in chain for t in _FULL_TEXTS)
    short_write = any(t in str(e) for e in chain for t in _SHORT_WRITE_TEXTS) or any(isinstance(e, OSError) for e in chain)
    if not full and short_write and free is not None and free < needed:
        full = True  # the errno was lost on the way, but the save did not fit
    primary = next((e for e in chain if isinstance(e, OSError)), None)
    primary = primary or next((e for e in chain if not isinstance(e, CheckpointException)), error)
    return FailureSummary(rank, "disk_full" if full else "other", ranks, _first_line(primary), free)


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors this rank holds in ``tree`` (local shards): what it writes, at most."""
    if isinstance(tree, Tensor):
        local = local_tensor(tree)
        return local.numel() * local.element_size()
    if isinstance(tree, Mapping):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def checkpoint_bytes(path: Optional[Path]) -> Optional[int]:
    marker = read_marker(path) if path is not None and path.is_dir() else None
    if marker is not None:
        return sum(marker["files"].values())
    return path.stat().st_size if path is not None and path.is_file() else None


def verdict(failures: list[FailureSummary], path: Path, needed: int, newest: Optional[Path], removed: bool) -> tuple[str, str]:
    """The error every rank raises, as ``(kind, message)`` (rank 0, after removing the partial save)."""
    folder = path.parent
    kept = (
        f" The earlier checkpoints in {str(folder)!r} are kept; the newest complete one is {str(newest)!r}."
        if newest is not None else f" No earlier complete checkpoint is in {str(folder)!r}."
    )
    cleaned = " The partial save was removed." if removed else ""
    locked = [f for f in failures if f.kind == "locked"]
    if locked:
        return "locked", locked[0].text
    ranks = sorted({r for f in failures for r in f.ranks})
    full = [f for f in failures if f.kind == "disk_full"]
    if full:
        free = free_bytes(folder)
        return "disk_full", (
            f"Saving the checkpoint {str(path)!r} failed: the disk is full (no space left on device; rank(s)"
            f" {ranks}: {full[0].text}). The filesystem of {str(folder)!r} has {free} bytes free now; this save"
            f" needs about {needed} bytes.{cleaned}{kept} Free space there, or save to a larger disk"
            " (`ModelCheckpoint(dirpath=...)`), then resume from the newest complete checkpoint."
        )
    return "other", (
        f"Saving the checkpoint {str(path)!r} failed on rank(s) {ranks}: "
        + "; ".join(f"rank {f.rank}: {f.text}" for f in failures) + f".{cleaned}{kept}"
    )


def as_error(kind: str, message: str) -> BaseException:
    if kind == "disk_full":
        return CheckpointDiskFullError(message)
    if kind == "locked":
        return CheckpointDirectoryLockedError(message)
    return CheckpointSaveError(message)


__all__ = [
    "SAVE_ERRORS", "CheckpointDiskFullError", "CheckpointSaveError", "FailureSummary", "as_error", "checkpoint_bytes",
    "error_chain", "summarize", "tensor_bytes", "verdict",
]
