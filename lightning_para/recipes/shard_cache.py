"""Token shards at URLs: fetched ahead of use into a bounded local cache, in the background, with retries.

A path with a scheme (``https://``, ``s3://``, ``gs://``: whatever ``fsspec`` opens) is remote. What ``lightning-para
prepare`` writes is uploaded as it is (``meta.json`` and ``shards/``); nanoGPT / llm.c ``.bin`` files by their URLs.

* The cache is a folder of whole shards under ``max_bytes``. A download first reserves the shard's full size (a
  sparse ``.part`` file), evicting the least recently used shards the coming samples do not need; the ``.part`` is
  renamed into place when complete. Processes sharing the folder (the ranks of a node, DataLoader workers) reserve
  under one file lock and fetch a shard once: the ``.part`` is the claim, the others wait for it (and take over one
  that stopped growing). Shards in use are touched, so the least recently used are the ones evicted.
* A background thread fetches the shards of the coming positions in the order they are needed, while they fit.
* Downloads go by byte ranges of :data:`CHUNK`; a failed range (a dropped connection, a timeout) is retried from its
  start, ``retries`` times with backoff, so a shard is never fetched twice nor spliced from two versions of a read.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

CHUNK = 8 << 20
STALE_SECONDS = 120.0
EXTRA = "pip install 'lightning-para[remote]'"


def is_url(path: Any) -> bool:
    return "://" in str(path)


def filesystem(url: str) -> Any:
    """The ``fsspec`` filesystem of ``url`` (imported here: the ``remote`` extra is optional)."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ImportError(f"`{url}` is a URL: reading shards over the network needs fsspec ({EXTRA}).") from None
    try:
        return url_to_fs(url)[0]
    except ImportError as err:  # the protocol's own package: aiohttp (http), s3fs, gcsfs
        raise ImportError(f"`{url}`: {err} ({EXTRA} installs http(s); s3:// needs s3fs, gs:// gcsfs).") from None


def read_range(url: str, start: Optional[int], end: Optional[int], retries: int) -> bytes:
    """Bytes ``[start, end)`` of ``url`` (all of it for ``None``), retried with backoff; a missing file is not retried."""
    fs = filesystem(url)
    for attempt in range(retries + 1):
        try:
            return fs.cat_file(url, start=start, end=end)
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as err:  # a dropped connection, a timeout, a 5xx: the transports raise their own types
            if attempt == retries:
                raise OSError(f"Reading `{url}` failed {retries + 1} times (last: {type(err).__name__}: {err}). Check"
                              " the server, or raise `data.retries`.") from err
            time.sleep(min(0.1 * 2**attempt, 10.0))
    raise AssertionError("unreachable")


def remote_size(url: str) -> int:
    return int(filesystem(url).size(url))


class ShardCache:
    """Local copies of remote shards in ``folder``, at most ``max_bytes`` together (see the module docstring)."""

    def __init__(self, folder: str, max_bytes: int, retries: int = 5) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"`data.cache_bytes={max_bytes!r}` must be a positive number of bytes.")
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.retries = max_bytes, retries
        self.downloads = 0  # shards this process fetched
        self.peak_bytes = 0  # the most the folder held, measured after each reservation
        self._own()

    def _own(self) -> None:
        """Fresh threading state in a new process (a forked DataLoader worker inherits none that works)."""
        if getattr(self, "_pid", None) != os.getpid():
            self._pid, self._lock, self._wake = os.getpid(), threading.Lock(), threading.Event()
            self._wanted: list[tuple[str, int]] = []
            self._thread: Optional[threading.Thread] = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pid", "_lock", "_wake", "_wanted", "_thread")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._own()

    def read(self, url: str, nbytes: int, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` from byte ``offset`` of ``url`` (``nbytes`` long), fetched now if not cached."""
        self._own()
        if nbytes > self.max_bytes:
            raise ValueError(f"The shard `{url}` has {nbytes} bytes, more than `data.cache_bytes={self.max_bytes}`."
                             f" Set `data.cache_bytes` to at least a few shards (>= {2 * nbytes}).")
        final = self._local_name(url)
        while True:
            if self._fetch(url, nbytes, final, urgent=True):
                try:
                    return np.fromfile(final, dtype=dtype, count=count, offset=offset)
                except FileNotFoundError:
                    continue  # evicted by another process between the check and the read
            time.sleep(0.02)  # another thread or process is fetching it

    def prefetch(self, shards: list[tuple[str, int]]) -> None:
        """Fetch ``(url, nbytes)`` in this order in the background, while they fit beside the ones in use."""
        self._own()
        with self._lock:
            self._wanted = shards
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
            self._thread.start()

    def _prefetch_loop(self) -> None:
        while self._wake.wait():
            self._wake.clear()
            with self._lock:
                wanted = list(self._wanted)
            for url, nbytes in wanted:
                if self._wake.is_set():
                    break  # a newer list
                try:
                    if self._fetch(url, nbytes, self._local_name(url), urgent=False) is None:
                        break  # no room: the rest waits for the reads to move on
                except Exception:  # noqa: BLE001 - the read that needs this shard fetches it again and raises
                    break

    def _local_name(self, url: str) -> Path:
        return self.folder / f"{hashlib.sha1(url.encode()).hexdigest()[:24]}.bin"

    def _fetch(self, url: str, nbytes: int, final: Path, urgent: bool) -> Optional[bool]:
        """True once ``final`` is here; False while another fetches it; None (not ``urgent``) when it does not fit."""
        try:
            if time.time() - final.stat().st_mtime > 1.0:
                os.utime(final)  # in use: the least recently used is evicted first
            return True
        except FileNotFoundError:
            pass
        part = final.with_suffix(".part")
        with self._folder_lock():
            if final.exists():
                return True
            if part.exists():
                if time.time() - part.stat().st_mtime < STALE_SECONDS:
                    return False
                part.unlink()  # its fetcher stopped: take it over
            with self._lock:
                keep = {self._local_name(u).name for u, _ in self._wanted}
            if not self._make_room(nbytes, keep) and not (urgent and self._make_room(nbytes, set())):
                return None if not urgent else False
            with open(part, "xb") as f:
                f.truncate(nbytes)  # the full size, reserved now
            self.peak_bytes = max(self.peak_bytes, self._used()[0])
        try:
            self._download(url, nbytes, part)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        with self._folder_lock():  # a rename beside a reservation's scan would hide the shard from it
            os.replace(part, final)
        with self._lock:
            self.downloads += 1
        return True

    def _download(self, url: str, nbytes: int, part: Path) -> None:
        with open(part, "r+b") as f:
            done = 0
            while done < nbytes:
                chunk = read_range(url, done, min(done + CHUNK, nbytes), self.retries)
                if not chunk or len(chunk) > min(CHUNK, nbytes - done):
                    raise ValueError(
                        f"`{url}` answered {len(chunk)} bytes at offset {done} of the {nbytes} its record says: it is"
                        " truncated or was changed, or the server ignores range requests. Upload the shard again."
                    )
                f.seek(done)
                f.write(chunk)
                done += len(chunk)

    def _used(self) -> tuple[int, list[tuple[float, Path, int]]]:
        files = []
        for p in self.folder.iterdir():
            if p.suffix in (".bin", ".part"):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, p, st.st_size))
        return sum(f[2] for f in files), sorted(files)

    def _make_room(self, nbytes: int, keep: set[str]) -> bool:
        """Evict complete shards, least recently used first and none in ``keep`` (and stale ``.part`` files of
        stopped fetchers), until ``nbytes`` more fit."""
        used, files = self._used()
        for mtime, p, size in files:
            if used + nbytes <= self.max_bytes:
                break
            if (p.suffix == ".bin" and p.name not in keep) or time.time() - mtime > STALE_SECONDS:
                p.unlink(missing_ok=True)
                used -= size
        return used + nbytes <= self.max_bytes

    @contextmanager
    def _folder_lock(self) -> Iterator[None]:
        with open(self.folder / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["CHUNK", "ShardCache", "filesystem", "is_url", "read_range", "remote_size"]
