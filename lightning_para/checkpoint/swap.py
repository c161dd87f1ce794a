"""Step 4 of the atomic save protocol (:mod:`.atomic`): swap a finished checkpoint into place, and remove
checkpoints and what interrupted saves left, so that no name ever shows a half-written or half-deleted copy.

An existing checkpoint (the ``last.ckpt`` that ``ModelCheckpoint`` rewrites) is exchanged with the new one in one
``renameat2(RENAME_EXCHANGE)`` call where the filesystem has it; elsewhere the old copy is first renamed to
``<stem>.previous<suffix>``, still complete and still matched by ``last*.ckpt``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Union

from lightning_para.checkpoint.atomic import (
    DELETING_TAG,
    HIDDEN_TAGS,
    PREVIOUS_INFIX,
    REPLACED_TAG,
    checkpoint_problems,
    fsync_dir,
    hidden_sibling,
    new_token,
)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``); ``OSError`` if unsupported."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "atomic exchange needs Linux renameat2")
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc < 2.28
        raise OSError(errno.ENOSYS, "libc has no renameat2")
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def previous_path(path: Path) -> Path:
    """``last.ckpt`` -> ``last.previous.ckpt``: the old copy's name while a non-atomic swap is under way."""
    return path.with_name(f"{path.stem}{PREVIOUS_INFIX}{path.suffix}")


def commit(partial: Path, path: Path, exchange: Callable[[Path, Path], None] = _exchange) -> None:
    """Swap the finished ``partial`` into ``path`` (rank 0 only); see the module docstring."""
    if not (path.exists() or path.is_symlink()):
        os.rename(partial, path)
        fsync_dir(path.parent)
        return
    if path.is_symlink():  # ModelCheckpoint(save_last="link") left a link: replace the link, not its target
        if partial.is_file():
            os.replace(partial, path)  # atomic for a file over a link
        else:
            path.unlink()
            os.rename(partial, path)
        fsync_dir(path.parent)
        return
    try:
        exchange(partial, path)  # `partial` now holds the previous checkpoint
        old = partial
    except OSError:
        # No atomic exchange here: keep the previous copy visible under a name Lightning's `last*.ckpt`
        # listing still takes, so a crash between the two renames leaves a complete checkpoint to resume.
        old = previous_path(path)
        _remove(old)
        os.rename(path, old)
        fsync_dir(path.parent)
        os.rename(partial, path)
    fsync_dir(path.parent)
    doomed = hidden_sibling(path, REPLACED_TAG, new_token())
    os.rename(old, doomed)  # hidden first, so a crash mid-delete leaves nothing that looks like a checkpoint
    _remove(doomed)


def remove_partial(partial: Path) -> None:
    """Delete a save that failed (its hidden sibling), e.g. so a full disk gets its space back."""
    _remove(partial)
    fsync_dir(partial.parent)


def remove_checkpoint(path: Union[str, Path]) -> None:
    """Delete a checkpoint so that no half-deleted copy is ever visible: rename to a hidden name, then delete."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink():
        path.unlink()
        return
    doomed = hidden_sibling(path, DELETING_TAG, new_token())
    os.rename(path, doomed)
    fsync_dir(path.parent)
    _remove(doomed)


def sweep_interrupted(
    folder: Union[str, Path], keep: Optional[Path] = None, only: Optional[Callable[[str], bool]] = None
) -> list[Path]:
    """Delete what interrupted saves, swaps and removals left in ``folder`` (hidden siblings and
    ``*.previous.ckpt`` copies that have a complete successor), except ``keep``; ``only``: just the
    hidden siblings whose name it accepts (a folder other runs share). Rank 0, at the start and at a save."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if keep is not None and entry == keep:
            continue
        stale = entry.name.startswith(".") and any(tag in entry.name for tag in HIDDEN_TAGS)
        if only is not None:
            stale = stale and only(entry.name)
        elif not stale and entry.stem.endswith(PREVIOUS_INFIX) and entry.suffix == ".ckpt":
            successor = entry.with_name(entry.stem[: -len(PREVIOUS_INFIX)] + entry.suffix)
            stale = checkpoint_problems(successor).complete
        if stale:
            _remove(entry)
            removed.append(entry)
    return removed


__all__ = ["commit", "previous_path", "remove_checkpoint", "remove_partial", "sweep_interrupted"]
