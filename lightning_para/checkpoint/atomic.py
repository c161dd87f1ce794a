"""Atomic, verifiable checkpoints: write beside, mark complete, swap into place.

A checkpoint is never written where it will be read. Every save goes through these steps:

1. Every rank writes into a hidden sibling ``.<name>.partial-<token>`` (its name starts with a
   dot and does not end in ``.ckpt``, so Lightning's ``ckpt_path="last"`` listing, which takes
   ``last*.ckpt`` in the ``ModelCheckpoint`` folder, never sees it). DCP's writer fsyncs each
   shard; rank 0 writes and fsyncs ``meta.pt``.
2. A barrier: every rank's shards, DCP's ``.metadata`` and ``meta.pt`` are on disk.
3. Rank 0 writes the completion marker ``para_complete.json`` (itself atomically: temp file,
   fsync, rename). It lists every file with its size, so a truncated or missing file is found
   on load without reading any shard, and its CRC-32 (each rank checksummed the shards it wrote,
   :mod:`.checksums`), so a corrupted one is found when the load verifies the data.
4. Rank 0 swaps the sibling into place. A new name is one ``rename``. An existing one (the
   ``last.ckpt`` that ``ModelCheckpoint`` rewrites) is *exchanged* with the new one in one
   ``renameat2(RENAME_EXCHANGE)`` call (Linux >= 3.15 on ext4/xfs/btrfs/tmpfs/overlayfs), so at
   every instant the name holds a complete checkpoint. Where exchange is unsupported, the old
   one is first renamed to ``<stem>.previous<suffix>`` -- still a complete checkpoint, still
   matched by ``last*.ckpt`` -- and the new one renamed into place. Then the old copy is deleted.

A checkpoint directory without its marker is never loaded: :func:`verify_checkpoint` names
what is missing or corrupt and suggests the newest complete checkpoint in the same folder.
Single-file checkpoints (``save_distributed_checkpoint=False``) are written to a hidden
sibling file, fsynced and swapped in the same way; a file that exists and is a whole
``torch.save`` archive is complete (its records carry their own CRC-32s).

This module holds the protocol's names, the marker and the verification; step 4 (the swap, removals and the
sweep of what interrupted saves left) is :mod:`.swap`; checksums, save failures and the directory lock are their
own modules.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_para.checkpoint import checksums as crc

MARKER_FILENAME = "para_complete.json"
MARKER_FORMAT = 1
PARTIAL_TAG = ".partial-"  # `.<name>.partial-<token>`: a save in progress (or interrupted)
REPLACED_TAG = ".replaced-"  # `.<name>.replaced-<token>`: the previous copy, deleted after a swap
DELETING_TAG = ".deleting-"  # `.<name>.deleting-<token>`: a checkpoint being removed
PREVIOUS_INFIX = ".previous"  # `<stem>.previous<suffix>`: the old copy during a non-atomic swap (fallback only)
HIDDEN_TAGS = (PARTIAL_TAG, REPLACED_TAG, DELETING_TAG)
RUN_KEY = "lightning_para_run"  # in Lightning's checkpoint dict: {"run": id, "saved_at": time} (:mod:`.run`)


class IncompleteCheckpointError(ValueError):
    """A checkpoint path that must not be loaded: no completion marker, or missing/truncated files."""


class CorruptCheckpointError(IncompleteCheckpointError):
    """A complete checkpoint whose data no longer matches the checksums written at save."""


def new_token() -> str:
    """A short random token naming one save's temporary siblings (rank 0 draws it, every rank uses it)."""
    return uuid.uuid4().hex[:12]


def hidden_name(name: str, tag: str, token: str) -> str:
    """``.<name><tag><token>`` with ``ckpt_`` spelled ``ckpt-``: Lightning's ``hpc_ckpt_<n>`` lookups
    (``ckpt_path="hpc"``, its SLURM requeue save) take every name containing ``hpc_ckpt_`` (or ``ckpt_``)
    and read all its digits as the number, so ``.hpc_ckpt_1.ckpt.partial-1783671`` became
    ``hpc_ckpt_11783671.ckpt``."""
    return f".{name.replace('ckpt_', 'ckpt-')}{tag}{token}"


def partial_path(path: Union[str, Path], token: str) -> Path:
    """The hidden sibling a save writes into before it is swapped into ``path``."""
    path = Path(path)
    return path.with_name(hidden_name(path.name, PARTIAL_TAG, token))


def hidden_sibling(path: Path, tag: str, token: str) -> Path:
    return path.with_name(hidden_name(path.name, tag, token))


# ---------------------------------------------------------------------- durability
def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the marker
def _manifest(directory: Path) -> dict[str, int]:
    files = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file() and f.name != MARKER_FILENAME and not f.name.startswith(MARKER_FILENAME):
            files[f.relative_to(directory).as_posix()] = f.stat().st_size
    return files


def write_marker(
    directory: Union[str, Path], info: Optional[dict[str, Any]] = None, checksums: Optional[dict[str, str]] = None
) -> dict[str, Any]:
    """Write ``para_complete.json`` into a fully written checkpoint directory (rank 0, after the barrier).

    It records the format, the time, ``info`` (e.g. ``global_step``), every file with its size and
    its CRC-32: ``checksums`` are the ones the ranks computed for their own shards; rank 0 hashes
    the files they do not cover (``.metadata``, ``meta.pt``).
    """
    directory = Path(directory)
    files = _manifest(directory)
    given = dict(checksums or {})
    sums = {name: given[name] if name in given else crc.file_checksum(directory / name) for name in files}
    marker = {
        "format": MARKER_FORMAT, "saved_at": time.time(), **(info or {}), "files": files,
        "checksum": crc.ALGORITHM, "checksums": sums,
    }
    tmp = directory / f"{MARKER_FILENAME}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MARKER_FILENAME)
    fsync_dir(directory)
    return marker


def read_marker(directory: Union[str, Path]) -> Optional[dict[str, Any]]:
    """The marker of a checkpoint directory, ``None`` if it has none or it cannot be parsed."""
    try:
        with open(Path(directory) / MARKER_FILENAME) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


# ---------------------------------------------------------------------- verification
@dataclass
class CheckpointStatus:
    """What :func:`checkpoint_problems` found: ``problems`` is empty for a loadable checkpoint."""

    path: Path
    problems: list[str] = field(default_factory=list)
    marker: Optional[dict[str, Any]] = None

    @property
    def complete(self) -> bool:
        return not self.problems


def checkpoint_problems(path: Union[str, Path], required: Iterable[str] = (".metadata", "meta.pt")) -> CheckpointStatus:
    """Check a checkpoint without reading its shards (``stat`` only).

    A directory must hold a marker, every file the marker lists at its recorded size, and the
    ``required`` files. A file must be non-empty (a file that exists was renamed into place complete).
    """
    path = Path(path)
    status = CheckpointStatus(path)
    if path.is_file():
        if path.stat().st_size == 0:
            status.problems.append("the file is empty")
        elif not crc.is_whole_zip(path):
            status.problems.append("it is not a complete torch.save archive (truncated, or not a checkpoint)")
        return status
    if not path.is_dir():
        status.problems.append("it does not exist")
        return status
    marker = read_marker(path)
    status.marker = marker
    if marker is None and (path / MARKER_FILENAME).is_file():
        status.problems.append(
            f"its completion marker `{MARKER_FILENAME}` is corrupted (not the JSON a save writes: the file was"
            " changed or damaged after the save), so nothing proves its files are whole"
        )
        return status
    if marker is None:
        has_dcp = (path / ".metadata").is_file()
        status.problems.append(
            f"it has no completion marker `{MARKER_FILENAME}`: the save was interrupted"
            + (" (DCP's `.metadata` is there, but nothing proves every shard and `meta.pt` were written after it)"
               if has_dcp else "")
        )
        return status
    listed = marker["files"]
    for name in required:
        if name not in listed:
            status.problems.append(f"the marker does not list `{name}`")
    for name, size in listed.items():
        file = path / name
        if not file.is_file():
            status.problems.append(f"`{name}` is missing")
        elif file.stat().st_size != size:
            status.problems.append(f"`{name}` is truncated or changed: {file.stat().st_size} bytes, {size} written")
    return status


def data_problems(status: CheckpointStatus, names: Optional[Iterable[str]] = None) -> list[str]:
    """Read the data and compare it with the checksums written at save (``names``: only those files).

    A directory whose marker predates checksums has nothing to compare with and passes.
    """
    if status.path.is_file():
        problem = crc.verify_zip(status.path)
        return [problem] if problem else []
    sums = (status.marker or {}).get("checksums")
    if not isinstance(sums, dict):
        return []
    return crc.mismatches(status.path, sums, sorted(sums) if names is None else names)


@dataclass(frozen=True)
class Recorded:
    """What a complete checkpoint records about itself: the run that wrote it (``None``: not recorded),
    its global step (-1: not recorded) and its save time (0: not recorded)."""

    path: Path
    run: Optional[str]
    step: int
    saved_at: float

    @property
    def order(self) -> tuple[int, float]:
        """Newest sorts last: by step, then by the recorded save time (never mtime or name)."""
        return self.step, self.saved_at


def recorded(status: CheckpointStatus) -> Recorded:
    """Read a complete checkpoint's record: a directory's marker, a single file's own dict (memory-mapped:
    its tensors are not read)."""
    if status.marker is not None:
        marker = record = status.marker
    else:
        try:
            marker = torch.load(status.path, map_location="cpu", mmap=True, weights_only=False)
        except Exception:  # noqa: BLE001 - any unreadable file simply records nothing
            marker = {}
        marker = marker if isinstance(marker, dict) else {}
        record = marker.get(RUN_KEY) if isinstance(marker.get(RUN_KEY), dict) else {}
    run, step, when = record.get("run"), marker.get("global_step"), record.get("saved_at")
    return Recorded(
        status.path, run if isinstance(run, str) else None, step if isinstance(step, int) else -1,
        float(when) if isinstance(when, (int, float)) else 0.0,
    )


def newest_complete_checkpoint(
    folder: Union[str, Path], exclude: Optional[Path] = None, verify_data: bool = False
) -> Optional[Path]:
    """The newest complete checkpoint (a ``*.ckpt`` directory or file) in ``folder``, whatever its name
    and whichever run wrote it: by the step, then the save time, recorded inside (:func:`recorded`).

    Complete means the marker and every file it lists at its size (a file: a whole archive);
    ``verify_data`` also reads the data against the checksums (newest first, until one passes).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = []
    for candidate in folder.iterdir():
        if candidate.name.startswith(".") or candidate.suffix != ".ckpt":
            continue
        if exclude is not None and candidate.resolve() == exclude.resolve():
            continue
        status = checkpoint_problems(candidate)
        if status.complete:
            found.append((recorded(status).order, status))
    for _, status in sorted(found, key=lambda item: item[0], reverse=True):
        if not verify_data or not data_problems(status):
            return status.path
    return None


def describe_problems(status: CheckpointStatus) -> str:
    """One message: the path, what is wrong, and the newest complete checkpoint beside it (if any)."""
    suggestion = newest_complete_checkpoint(status.path.parent, exclude=status.path, verify_data=True)
    hint = (
        f" The newest complete checkpoint in the same folder is {str(suggestion)!r}: pass it as `ckpt_path`."
        if suggestion is not None
        else " No complete checkpoint was found in the same folder."
    )
    return f"The checkpoint {str(status.path)!r} cannot be loaded: {'; '.join(status.problems)}.{hint}"


def verify_checkpoint(path: Union[str, Path], verify_data: bool = True) -> CheckpointStatus:
    """Raise if ``path`` is not a complete checkpoint (``FileNotFoundError`` if it does not exist,
    :class:`IncompleteCheckpointError` otherwise, :class:`CorruptCheckpointError` if ``verify_data``
    and a file does not match its checksum); return its status (with the marker) if it is."""
    status = checkpoint_problems(path)
    if status.complete and verify_data:
        status.problems.extend(data_problems(status))
        if status.problems:
            raise CorruptCheckpointError(describe_problems(status))
    if status.complete:
        return status
    message = describe_problems(status)
    if not status.path.exists():
        raise FileNotFoundError(message)
    raise IncompleteCheckpointError(message)


def mark_checkpoint_complete(path: Union[str, Path]) -> dict[str, Any]:
    """Vouch for a sharded checkpoint written without a marker (by lightning-para before markers existed).

    Checks that DCP's ``.metadata`` and ``meta.pt`` load and that every byte range DCP's metadata
    names lies inside its shard file, then writes the marker. It cannot tell a torn checkpoint whose
    files all have plausible sizes from a good one: only use it on checkpoints you know were finished.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a sharded checkpoint directory.")
    metadata = FileSystemReader(str(path)).read_metadata()
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = [
        f"`{name}` is missing" if not (path / name).is_file() else f"`{name}` is shorter than {end} bytes"
        for name, end in sorted(ends.items())
        if not (path / name).is_file() or (path / name).stat().st_size < end
    ]
    if not (path / "meta.pt").is_file():
        problems.append("`meta.pt` is missing")
    if problems:
        raise IncompleteCheckpointError(f"Not marking {str(path)!r} complete: {'; '.join(problems)}.")
    return write_marker(path, {"vouched": True})


__all__ = [
    "MARKER_FILENAME",
    "HIDDEN_TAGS",
    "RUN_KEY",
    "CheckpointStatus",
    "Recorded",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "checkpoint_problems",
    "data_problems",
    "describe_problems",
    "fsync_dir",
    "fsync_file",
    "hidden_sibling",
    "mark_checkpoint_complete",
    "new_token",
    "newest_complete_checkpoint",
    "partial_path",
    "read_marker",
    "recorded",
    "verify_checkpoint",
    "write_marker",
]
