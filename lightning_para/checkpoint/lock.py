"""One run per checkpoint directory: a lock file, so two runs cannot destroy each other's saves.

Rank 0 sweeps what interrupted saves left behind (hidden ``.<name>.partial-<token>`` siblings) before
each save. A second run saving into the same directory would sweep the first run's save in progress
(which then dies with a bare ``FileNotFoundError``) and overwrite its ``last.ckpt``. So rank 0 takes
``.para_lock.json`` in every ``ModelCheckpoint`` directory when ``fit`` starts (:mod:`.run`) and keeps it
until the end of ``fit``:

* the file names the run (its id, :mod:`.run`), the host, the pid and when it was taken;
* while held by a running ``fit``, a daemon thread refreshes it every :data:`REFRESH_S` seconds; the
  thread is stopped (joined) in the strategy's teardown, and a save made after ``fit`` holds the
  directory for that save only, without a thread;
* another run's lock is *stale*, and is taken over, when its process is gone (same host and pid
  namespace: the pid is checked) or it was not refreshed for :data:`STALE_S` seconds (another host,
  or a frozen process), so a crashed run never blocks its successor for more than a minute or two;
  a lock of this same process (an earlier ``Trainer``, e.g. a ``trainer.save_checkpoint`` after ``fit``)
  is taken over too: runs in one process follow each other;
* a live lock of another run raises :class:`CheckpointDirectoryLockedError` naming the directory and
  the other run, before anything is swept.

A resumed run (a new process) takes over its own crashed predecessor's lock by the same rules.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

from lightning_para.reliability.processes import node_fingerprint, process_alive

LOCK_FILENAME = ".para_lock.json"
REFRESH_S = 15.0
STALE_S = 120.0  # 8 missed refreshes


class CheckpointDirectoryLockedError(RuntimeError):
    """Another live run saves into the same checkpoint directory."""


def _read(lock_file: Path) -> Optional[dict[str, Any]]:
    try:
        with open(lock_file) as f:
            owner = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: judged by its age alone
    return owner if isinstance(owner, dict) else {}


def stale_reason(owner: dict[str, Any], lock_file: Path, now: Optional[float] = None) -> Optional[str]:
    """Why another run's lock no longer counts (``None``: it does)."""
    now = time.time() if now is None else now
    try:
        refreshed = lock_file.stat().st_mtime
    except FileNotFoundError:
        return "it was released"
    if now - refreshed > STALE_S:
        return f"it was not refreshed for {now - refreshed:.0f} s (more than {STALE_S:.0f} s)"
    pid = owner.get("pid")
    if owner.get("node") == node_fingerprint() and isinstance(pid, int):
        if pid == os.getpid():
            return "this process took it (an earlier Trainer's fit or `trainer.save_checkpoint`)"
        if not process_alive(pid):
            return f"its process {pid} on this host is gone"
    return None


def describe_owner(owner: dict[str, Any]) -> str:
    started = owner.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"run {owner.get('run', '?')} (host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {when})"


class DirectoryLock:
    """Rank 0's claim on the checkpoint directories of one run (one per strategy)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.held: dict[Path, Path] = {}  # directory -> its lock file
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _owner(self) -> dict[str, Any]:
        return {
            "run": self.run_id, "host": socket.gethostname(), "pid": os.getpid(), "node": node_fingerprint(),
            "started_at": time.time(),
        }

    def acquire(self, directory: Path, refresh: bool = True) -> None:
        """Hold ``directory`` for this run, or raise :class:`CheckpointDirectoryLockedError` (rank 0).
        ``refresh``: keep it fresh from a daemon thread until :meth:`release` (a whole ``fit``)."""
        directory = Path(directory).resolve()
        if directory in self.held:
            os.utime(self.held[directory])
            if refresh:
                self._start_refreshing()
            return
        lock_file = directory / LOCK_FILENAME
        for _ in range(5):
            try:
                fd = os.open(lock_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _read(lock_file)
                if owner is None:
                    continue  # released meanwhile: try again
                if owner.get("run") == self.run_id:
                    break
                reason = stale_reason(owner, lock_file)
                if reason is None:
                    raise CheckpointDirectoryLockedError(
                        f"The checkpoint directory {str(directory)!r} is in use by another {describe_owner(owner)}"
                        f" (lock file {str(lock_file)!r}). Two runs saving into one directory would delete each"
                        " other's saves in progress and overwrite each other's `last.ckpt`: give this run its own"
                        " `ModelCheckpoint(dirpath=...)`, or stop the other run. If that run is gone, delete the"
                        f" lock file (it also expires {STALE_S:.0f} s after its last refresh)."
                    ) from None
                doomed = lock_file.with_name(f"{LOCK_FILENAME}.stale-{self.run_id}")
                try:
                    os.rename(lock_file, doomed)  # one taker wins the rename; the others retry and see its lock
                    doomed.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._owner(), f)
            break
        else:
            raise CheckpointDirectoryLockedError(f"Could not take the lock {str(lock_file)!r} (contended).")
        self.held[directory] = lock_file
        if refresh:
            self._start_refreshing()

    def _start_refreshing(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._refresh, name="para-ckpt-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            for lock_file in list(self.held.values()):
                try:
                    os.utime(lock_file)
                except OSError:
                    pass

    def rename(self, run_id: str) -> None:
        """This run continues another's (a resume adopted its id): the lock files it holds name that run."""
        self.run_id = run_id
        for lock_file in self.held.values():
            tmp = lock_file.with_name(f"{LOCK_FILENAME}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(self._owner(), f)
            os.replace(tmp, lock_file)

    def release(self) -> None:
        """Give back every directory this run holds (its lock files are deleted if still its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for lock_file in self.held.values():
            owner = _read(lock_file)
            if owner is not None and owner.get("run") == self.run_id:
                lock_file.unlink(missing_ok=True)
        self.held.clear()


__all__ = ["LOCK_FILENAME", "CheckpointDirectoryLockedError", "DirectoryLock", "describe_owner", "stale_reason"]
