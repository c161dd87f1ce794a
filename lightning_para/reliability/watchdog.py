"""A watchdog for dead or stuck ranks: heartbeats over the process group's store, no collectives.

Why: when one rank dies, the others wait in their next collective -- a pipeline receive, a
gradient all-reduce, Lightning's per-step broadcast -- until the process-group ``timeout``
(30 minutes by default; NCCL's own watchdog acts on the same timeout). Under separately started
ranks nothing else ends them. With ``ParaStrategy(watchdog_timeout=T)`` every surviving rank logs
which rank was lost and what it was doing, and exits with :data:`WATCHDOG_EXIT_CODE`.

How (a daemon thread per rank, started when the strategy sets up the process group):

* **Heartbeat.** Every ``interval`` (``T/10``, clamped to 0.5-5 s) the thread writes one small
  JSON record to the process group's TCPStore (through its own client connection, so it never
  waits behind the main thread): a beat counter, the wall time, its pid and node, and what the
  main thread last reported (``"training_step (global step 12)"``, ``"saving checkpoint ..."``).
  The training loop only assigns two attributes per hook: nothing on the training path waits.
* **Dead peers.** Each rank reads the records of its next two ranks (ring order): a beat that
  has not changed for ``T`` seconds means the rank is gone. Peers on the same node are also
  checked by pid every 0.25 s, so a killed local rank is noticed at once; the rank hosting the
  store (rank 0, except under torchrun) is presumed gone when the store stays unreachable.
* **Stuck peers.** A rank whose main thread has reported no progress for ``T`` seconds (outside
  setup and checkpoint I/O, which may legitimately take longer) reads every record once and
  names the culprit: a gone rank first, then one that stopped after an exception, then the
  stalled rank that is furthest behind.
* **One verdict.** The first rank to decide writes the verdict to the store (compare-and-set);
  every rank polls that key, so all survivors print the same lines and exit within about one
  interval of each other.
* **A rank that raised.** A rank whose main thread raised an error that is not a lost peer (an
  ``IndexError`` from a bad batch on one dp rank, a user error) posts a *failure notice*. Its peers
  are usually blocked in their next collective, waiting for it; each rank that still runs
  :data:`FAILURE_GRACE` intervals after reading the notice turns it into the verdict and exits
  (ranks that raised the same error themselves have stopped their watchdog by then and raise
  normally). So one rank's error releases the others in seconds instead of ``timeout``.

Choose ``T`` above the longest gap between progress reports (a training step, a validation
batch) and below the process-group ``timeout``: the watchdog only helps if it fires first.

Why this module is long: one class with three detectors (heartbeat age, local pids, stalls),
the store-failure handling that must work while the store's host is gone, and the verdict
text, which is the point of the feature; splitting them would scatter one state machine.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store  # private: see docs/architecture.md

WATCHDOG_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a peer failed; restart from the last checkpoint
LOCAL_CHECK_SECONDS = 0.25
FAILURE_GRACE = 3  # intervals a rank waits after a peer's failure notice before exiting itself
NEIGHBOURS = 2
_LOCAL_WINDOW = 64  # ranks on either side whose records are read once, to find this node's peers


def check_watchdog_timeout(value: Optional[float], timeout: Optional[timedelta] = None) -> None:
    """``ValueError`` naming the argument (called before any process group exists).

    ``timeout`` is the process group's (collective) timeout: the watchdog must fire first, or a rank
    blocked on a lost peer fails with the collective's timeout, naming nobody, before the watchdog
    can name the lost rank.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"`watchdog_timeout={value!r}` must be a positive number of seconds, or None to switch the watchdog off."
        )
    limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and value >= limit:
        raise ValueError(
            f"`watchdog_timeout={value!r}` s must be below `timeout={timeout!r}` ({limit:g} s, the collective"
            " timeout): otherwise a rank blocked on a lost peer fails with the collective's timeout before the"
            " watchdog names the lost rank. Lower `watchdog_timeout` or raise `timeout`."
        )


def node_fingerprint() -> str:
    """Which kernel and pid namespace this process lives in: peers with the same one can be checked by pid."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("no-proc")
    return "/".join(parts)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie -- killed, not yet reaped by its parent -- counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_PEER_FAILURE_HINTS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "nccl")


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """A collective failed because another rank went away (gloo/NCCL errors, process-group timeouts)."""
    if isinstance(error, (dist.DistError, TimeoutError, ConnectionError)):
        return True
    return isinstance(error, RuntimeError) and any(hint in str(error).lower() for hint in _PEER_FAILURE_HINTS)


def store_client(timeout: float) -> dist.Store:
    """A store client of its own for the watchdog thread: a new connection to the default group's
    TCPStore (so a blocked main-thread store call never delays a heartbeat), else the store itself."""
    store = _get_default_store()
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        # A short operation timeout: once the store's host is gone every operation (a reconnect) waits this long.
        client = dist.TCPStore(
            base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        return client  # the default group's own keys stay under their prefix; ours get their own (Watchdog)
    return store


@dataclass
class _Watched:
    """What this rank knows about one peer it watches."""

    record: Optional[dict[str, Any]] = None
    beat_seen_at: float = 0.0  # monotonic time at which the current beat value was first seen


@dataclass
class _Report:
    """What the main thread last said it was doing (assigned from the main thread, read by the watchdog)."""

    what: str = "starting"
    since: float = field(default_factory=time.monotonic)
    exempt: bool = True
    seq: int = 0


class Watchdog:
    """Heartbeats and failure detection for one rank (see the module docstring).

    Args:
        timeout: seconds without a heartbeat (gone) or without progress (stuck) before acting.
        rank, world_size: this rank in the default process group.
        store: a store every rank reaches (:func:`store_client`).
        token: the same on every rank for one run (a fresh namespace each ``fit``).
        exit_fn: called with :data:`WATCHDOG_EXIT_CODE` after the verdict is printed (``os._exit``).
        stream: where the verdict goes (stderr).
    """

    def __init__(
        self,
        timeout: float,
        *,
        rank: int,
        world_size: int,
        store: dist.Store,
        token: str,
        interval: Optional[float] = None,
        exit_fn: Callable[[int], Any] = os._exit,
        stream: Any = None,
    ) -> None:
        check_watchdog_timeout(timeout)
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(max(self.timeout / 10, 0.5), 5.0)
        self.rank, self.world_size = rank, world_size
        self.store = dist.PrefixStore(f"lightning_para/watchdog/{token}/", store)
        self.exit_fn = exit_fn
        self.stream = stream
        self.verdict: Optional[str] = None
        self._report = _Report()
        self._armed = False
        self._state, self._error = "running", ""
        self._beat = 0
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._node, self._pid = node_fingerprint(), os.getpid()
        self._main_ident = threading.main_thread().ident
        self._watched = {r: _Watched() for r in self._neighbours()}
        self._local_peers: dict[int, dict[str, Any]] = {}  # rank -> latest record, for peers on this node
        self._dead_local: dict[int, int] = {}  # local peers whose process is gone -> the check that saw it
        self._last_store_error = ""
        self._pid_checks = 0
        self._local_unknown = set(range(max(0, rank - _LOCAL_WINDOW), min(world_size, rank + _LOCAL_WINDOW + 1))) - {rank}
        self._store_down_since: Optional[float] = None
        self._failure_seen_at: Optional[float] = None

    # ---------------------------------------------------------------- main thread: cheap reports
    def progress(self, what: str, exempt: bool = False) -> None:
        """The main thread is now doing ``what`` (two attribute writes; no lock, no I/O).
        ``exempt`` phases (setup, checkpoint I/O) may take longer than the timeout without counting as stuck."""
        self._report = _Report(what, time.monotonic(), exempt, self._report.seq + 1)
        if not exempt:
            self._armed = True

    def start(self) -> "Watchdog":
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning-para-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, state: str = "done", error: str = "") -> None:
        """Stop the thread; peers ignore a rank that stopped with ``state="done"`` (a finished fit)."""
        if self._state == "failed":  # Lightning tears down after an exception: that is no finished fit
            state, error = self._state, self._error
        self._state, self._error = state, error
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2 * self.interval, 5.0))
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store may be gone with a finished rank 0
            pass

    def failed(self, error: BaseException) -> None:
        """The main thread raised. A communication error (a peer closed its connection, a collective
        timed out) usually means a peer died: keep watching for up to ``timeout`` so this rank, too,
        names the lost rank and exits with :data:`WATCHDOG_EXIT_CODE`. Otherwise (or if nothing is
        found) stop beating and publish the error; peers blocked on this rank act once the beat is
        ``timeout`` old."""
        root = error
        while root.__cause__ is not None:  # e.g. torch's pipeline stage wraps the user's error in a RuntimeError
            root = root.__cause__
        text = " ".join(f"{type(root).__name__}: {root}".split())[:300]  # one line: the verdict is one line
        if looks_like_a_lost_peer(error) and self._thread is not None and self._thread.is_alive():
            self.progress(f"handling {text[:120]}")
            self._thread.join(timeout=self.timeout + 2 * self.interval)  # it exits the process on a verdict
            self.stop("failed", text)
            return
        what = self._report.what
        self.stop("failed", text)
        try:  # peers waiting for this rank in a collective exit after FAILURE_GRACE intervals, naming it
            notice = f"rank {self.rank} stopped after {text} while doing {what!r}"
            self.store.compare_set("failure", "", notice)
            if self.hosts_store:
                self._linger_for_peers()
        except Exception:  # noqa: BLE001 - the store may be gone
            pass

    @property
    def hosts_store(self) -> bool:
        """Whether this process serves the process group's TCPStore: rank 0, except under torchrun (its
        agent hosts the store and says so in ``TORCHELASTIC_USE_AGENT_STORE``)."""
        return self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"

    def _linger_for_peers(self) -> None:
        """This rank raised and hosts the store, which dies with it: stay until the peers have read the
        failure notice (one of them posts the verdict after FAILURE_GRACE intervals) or have stopped too,
        at most ``FAILURE_GRACE + 2`` intervals. Exiting at once would leave the peers a vanished store
        and no root cause ("rank 0 is gone"), a race a loaded node loses."""
        deadline = time.monotonic() + (FAILURE_GRACE + 2) * self.interval
        while time.monotonic() < deadline:
            if self.store.check(["verdict"]) or self._every_peer_stopped():
                return
            time.sleep(min(LOCAL_CHECK_SECONDS, self.interval))

    def _every_peer_stopped(self) -> bool:
        if self.world_size > 256:  # one read per rank per check: only wait for the verdict at scale
            return False
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            record = self._get(rank)
            if record is None or record["state"] == "running":
                return False
        return True

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.wait(min(LOCAL_CHECK_SECONDS, self.interval)):
            try:
                if self._check_local_pids():  # no store operation: works while the store is down
                    # A local peer just died: decide now (two store operations), before anything else --
                    # under Lightning's launcher its child observer SIGKILLs every survivor within 5 s.
                    self._confirm_dead_local_peers()
                now = time.monotonic()
                if now < next_beat:
                    continue
                next_beat = now + self.interval
                if self._store_down_since is not None:
                    self._store_unreachable(None)  # may decide (grace over), then probes the store once
                self._publish()
                self._store_down_since = None
                self._read_verdict()
                self._read_failure(now)
                self._learn_local_peers()
                self._confirm_dead_local_peers()
                self._watch_neighbours(now)
                self._check_self(now)
            except _Exit:
                return
            except Exception as error:  # noqa: BLE001 - a store that stopped answering
                if self._stop.is_set():
                    return
                self._store_unreachable(error)
            if self.verdict is not None:
                return

    def _publish(self) -> None:
        report = self._report
        self._beat += 1
        record = {
            "rank": self.rank, "beat": self._beat, "t": time.time(), "pid": self._pid, "node": self._node,
            "host": socket.gethostname(), "what": report.what, "idle": time.monotonic() - report.since,
            "exempt": report.exempt, "armed": self._armed, "seq": report.seq, "state": self._state, "error": self._error,
        }
        self.store.set(f"rank{self.rank}", json.dumps(record))

    def _get(self, rank: int) -> Optional[dict[str, Any]]:
        key = f"rank{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _neighbours(self) -> list[int]:
        count = min(NEIGHBOURS, self.world_size - 1)
        return [(self.rank + i) % self.world_size for i in range(1, count + 1)]

    def _read_verdict(self) -> None:
        if self.store.check(["verdict"]):
            self._die(self.store.get("verdict").decode(), by_other=True)

    def _read_failure(self, now: float) -> None:
        if not self.store.check(["failure"]):
            return
        if self._failure_seen_at is None:
            self._failure_seen_at = now
        elif now - self._failure_seen_at >= FAILURE_GRACE * self.interval:
            self._decide(self.store.get("failure").decode())

    def _watch_neighbours(self, now: float) -> None:
        for rank, seen in self._watched.items():
            record = self._get(rank)
            if record is None:
                if now - self._started >= self.timeout:
                    self._decide(f"rank {rank} never started its watchdog within {self.timeout:.0f} s (it died during setup?)")
                continue
            if seen.record is None or record["beat"] != seen.record["beat"]:
                seen.beat_seen_at = now
            seen.record = record
            if record["state"] == "done":
                continue
            silent = now - seen.beat_seen_at
            if silent >= self.timeout:
                self._decide(self._gone(record, f"no heartbeat for {silent:.1f} s"))

    def _learn_local_peers(self) -> None:
        """Read the records of nearby ranks (once each) to find the peers on this node, and keep the
        latest record of each local peer (what it was doing, whether it finished)."""
        for rank in sorted(self._local_unknown):
            record = self._get(rank)
            if record is not None:
                self._local_unknown.discard(rank)
                if record["node"] == self._node:
                    self._local_peers[rank] = record
        for rank in list(self._local_peers):
            if rank not in self._dead_local:
                self._local_peers[rank] = self._get(rank) or self._local_peers[rank]  # latest: finished or not

    def _check_local_pids(self) -> bool:
        """Whether a local peer's process was newly found gone."""
        self._pid_checks += 1
        found = False
        for rank, record in self._local_peers.items():
            if rank not in self._dead_local and record["state"] != "done" and not process_alive(record["pid"]):
                self._dead_local[rank] = self._pid_checks
                found = True
        return found

    def _first_dead_local(self) -> list[dict[str, Any]]:
        """The local peers seen dead first (survivors that exit after their own verdict die later)."""
        if not self._dead_local:
            return []
        first = min(self._dead_local.values())
        return [self._local_peers[r] for r, seen in sorted(self._dead_local.items()) if seen == first]

    def _confirm_dead_local_peers(self) -> None:
        """A local peer's process is gone: unless its last record says it finished, it is lost."""
        for rank in sorted(self._dead_local):
            record = self._get(rank) or self._local_peers[rank]
            if record["state"] == "done":
                del self._dead_local[rank]
                self._local_peers.pop(rank, None)
                continue
            self._decide(self._gone(record, "its process no longer exists"))

    def _check_self(self, now: float) -> None:
        report = self._report
        if not self._armed or report.exempt or now - report.since < self.timeout:
            return
        self._decide(self._diagnose_stall(now - report.since))

    def _store_unreachable(self, error: Optional[BaseException]) -> None:
        """The store fails. A local peer that died is the likely host (rank 0, unless torchrun's agent
        hosts it): decide after a short grace (at the normal end of a run, rank 0 may exit a moment
        before this rank stops its watchdog). Otherwise the host is remote: give it ``min(timeout, 10)``."""
        now = time.monotonic()
        if error is not None:
            self._last_store_error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if self._store_down_since is None:
            self._store_down_since = now
        down = now - self._store_down_since
        self._check_local_pids()
        dead = self._first_dead_local()
        if dead and down >= min(self.timeout, 2.0):
            self._die("; ".join(
                self._gone(record, "its process no longer exists, and the process group's store (it probably hosted"
                           f" it) has been unreachable for {down:.1f} s") for record in dead
            ), by_other=False)
        if down >= min(self.timeout, 10.0):
            self._die(
                f"the process group's store has been unreachable for {down:.1f} s ({self._last_store_error}); the rank"
                " hosting it (rank 0 under Lightning's launcher and separately started ranks; torchrun's agent under"
                " torchrun) is presumed gone",
                by_other=False,
            )

    # ---------------------------------------------------------------- verdicts
    @staticmethod
    def _gone(record: dict[str, Any], why: str) -> str:
        ago = f", {time.time() - record['t']:.1f} s before" if record.get("t") else ""
        state = f"; it had stopped after {record['error']}" if record.get("state") == "failed" else ""
        return (
            f"rank {record['rank']} (pid {record['pid']} on {record['host']}) is gone: {why}{state}."
            f" Its last report{ago}: {record['what']!r}"
        )

    def _diagnose_stall(self, idle: float) -> str:
        """This rank has made no progress for ``timeout``: read every record once and name the culprit."""
        records = {r: self._get(r) for r in range(self.world_size) if r != self.rank}
        stale_after = max(self.timeout / 2, 3 * self.interval)
        missing = [r for r, rec in records.items() if rec is None]
        if missing:
            return f"rank(s) {', '.join(map(str, missing))} never started their watchdog"
        live = {r: rec for r, rec in records.items() if rec["state"] != "done"}
        gone = [rec for rec in live.values() if rec["t"] is not None and time.time() - rec["t"] > stale_after]
        if gone:
            return "; ".join(self._gone(rec, f"no heartbeat for {time.time() - rec['t']:.1f} s") for rec in gone)
        failed = [rec for rec in live.values() if rec["state"] == "failed"]
        if failed:
            return "; ".join(f"rank {rec['rank']} stopped after {rec['error']} while doing {rec['what']!r}" for rec in failed)
        me = {"rank": self.rank, "what": self._report.what, "idle": idle, "seq": self._report.seq, "armed": True, "exempt": False}
        stalled = [rec for rec in [*live.values(), me] if rec["armed"] and not rec["exempt"] and rec["idle"] >= self.timeout / 2]
        if not stalled:
            return f"rank {self.rank} made no progress for {idle:.0f} s in {self._report.what!r} while its peers did"
        behind = min(rec["seq"] for rec in stalled)
        culprits = [rec for rec in stalled if rec["seq"] == behind]
        waiting = sorted({rec["what"] for rec in stalled if rec["seq"] != behind})
        text = "; ".join(f"rank {rec['rank']} is stuck: no progress for {rec['idle']:.0f} s in {rec['what']!r}" for rec in culprits)
        if waiting:
            text += f" (the other stalled ranks wait in: {', '.join(repr(w) for w in waiting[:4])})"
        return text

    def _decide(self, verdict: str) -> None:
        # First writer wins, so every survivor prints the same verdict.
        try:
            posted = self.store.compare_set("verdict", "", verdict)
            verdict = posted.decode() if isinstance(posted, bytes) else str(posted)
        except Exception:  # noqa: BLE001 - the store is gone too: this rank's own verdict
            pass
        self._die(verdict, by_other=False)

    def _die(self, verdict: str, by_other: bool) -> None:
        self.verdict = verdict
        report = self._report
        lines = [
            f"[rank {self.rank}] lightning-para watchdog: {verdict}.",
            f"[rank {self.rank}] This rank was in {report.what!r} for {time.monotonic() - report.since:.1f} s;"
            f" exiting with code {WATCHDOG_EXIT_CODE} (watchdog_timeout={self.timeout:g} s). Resume from the last"
            " checkpoint, e.g. trainer.fit(..., ckpt_path='last').",
        ]
        frame = sys._current_frames().get(self._main_ident)
        if frame is not None:
            lines.append(f"[rank {self.rank}] Main thread stack:\n" + "".join(traceback.format_stack(frame)).rstrip())
        stream = self.stream or sys.stderr
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - exit anyway
            pass
        self.exit_fn(WATCHDOG_EXIT_CODE)
        raise _Exit


class _Exit(Exception):
    """Ends the watchdog thread after ``exit_fn`` returned (only in tests: ``os._exit`` does not return)."""


def start_watchdog(timeout: float, token: str) -> Watchdog:
    """A started watchdog for this rank of the default process group."""
    store = store_client(timeout=min(max(timeout / 4, 1.0), 5.0))
    return Watchdog(timeout, rank=dist.get_rank(), world_size=dist.get_world_size(), store=store, token=token).start()


__all__ = [
    "FAILURE_GRACE",
    "WATCHDOG_EXIT_CODE",
    "Watchdog",
    "check_watchdog_timeout",
    "looks_like_a_lost_peer",
    "process_alive",
    "start_watchdog",
    "store_client",
]
