"""A watchdog for dead or stuck ranks: heartbeats over the process group's store, no collectives.

Why: when one rank dies, the others wait in their next collective -- a pipeline receive, a
gradient all-reduce, Lightning's per-step broadcast -- until the process-group ``timeout``
(30 minutes by default; NCCL's own watchdog acts on the same timeout). Under separately started
ranks nothing else ends them. With ``ParaStrategy(watchdog_timeout=T)`` every surviving rank logs
which rank was lost and what it was doing, and exits with :data:`WATCHDOG_EXIT_CODE`.

How (a daemon thread per rank, started when the strategy sets up the process group; ``docs/reliability.md``
explains each step): every ``interval`` (``T/10``, clamped to 0.5-5 s) the thread writes a **heartbeat**
record to the process group's TCPStore through its own client; the training loop only assigns two
attributes per hook. Each rank watches its next two ranks' beats (**dead peers**: a beat unchanged for
``T``), its local peers' pids every 0.25 s, and its own progress (**stuck**: no report for ``T`` outside
setup and checkpoint I/O, then every record is read once to name the culprit). Under Fabric a rank back in its
loop's own code (``in_user_code``: evaluating, writing files, waiting in ``fabric.barrier()``) is alive, not stuck,
and a rank stalled in a call waits while any peer is there (one counter in the store). The first rank to decide
writes **one verdict** (compare-and-set) that every rank polls. A rank whose main thread **raised** an
error that is not a lost peer posts a failure notice; its peers, blocked in their next collective, turn it
into the verdict after :data:`FAILURE_GRACE` intervals.

Choose ``T`` above the longest gap between progress reports (a training step, a validation
batch) and below the process-group ``timeout``: the watchdog only helps if it fires first.

This module runs the detectors and the one-verdict protocol; :mod:`.processes` says whether a
process lives (and which peers share this node), and :mod:`.verdict` writes the verdict text, which is the point of the feature.
"""

from __future__ import annotations

import atexit
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

from lightning_para.reliability.processes import (
    LocalPeers,
    looks_like_a_lost_peer,
    node_fingerprint,
    store_client,
)
from lightning_para.reliability.verdict import gone_text, name_the_stall

WATCHDOG_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a peer failed; restart from the last checkpoint
LOCAL_CHECK_SECONDS = 0.25
FAILURE_GRACE = 3  # intervals a rank waits after a peer's failure notice before exiting itself
NEIGHBOURS = 2


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
    in_user_code: bool = False  # Fabric: between calls, in the loop's own code (exempt; peers wait for it too)


class Watchdog:
    """Heartbeats and failure detection for one rank (see the module docstring).

    Args:
        timeout: seconds without a heartbeat (gone) or without progress (stuck) before acting.
        rank, world_size: this rank in the default process group.
        store: a store every rank reaches (:func:`store_client`).
        token: the same on every rank for one run (a fresh namespace each ``fit``).
        exit_fn: called with :data:`WATCHDOG_EXIT_CODE` after the verdict is printed (``os._exit``).
        stream: where the verdict goes (stderr).
        resume: how the verdict says to resume, in the front end's words.
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
        resume: str = "trainer.fit(..., ckpt_path='last')",
    ) -> None:
        check_watchdog_timeout(timeout)
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(max(self.timeout / 10, 0.5), 5.0)
        self.rank, self.world_size = rank, world_size
        self.store = dist.PrefixStore(f"lightning_para/watchdog/{token}/", store)
        self.exit_fn = exit_fn
        self.stream, self.resume = stream, resume
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
        self._local = LocalPeers(rank, world_size, self._node)  # peers on this node, checked by pid
        self._last_store_error = ""
        self._store_down_since: Optional[float] = None
        self._failure_seen_at: Optional[float] = None
        self._counted = False  # this rank is counted in the store's "in_user_code"
        self._group = dist.is_initialized()  # started with a process group: stop when it is destroyed

    # ---------------------------------------------------------------- main thread: cheap reports
    def progress(self, what: str, exempt: bool = False, in_user_code: bool = False) -> None:
        """The main thread is now doing ``what`` (two attribute writes; no lock, no I/O).
        ``exempt`` phases (setup, checkpoint I/O) may take longer than the timeout without counting as stuck;
        ``in_user_code`` (Fabric, between calls) too, and peers stalled meanwhile wait for this rank."""
        self._report = _Report(what, time.monotonic(), exempt or in_user_code, self._report.seq + 1, in_user_code)
        if not exempt and not in_user_code:
            self._armed = True

    def start(self) -> "Watchdog":
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning-para-watchdog", daemon=True)
        self._thread.stop = self.stop  # type: ignore[attr-defined]  # Lightning's test teardown stops threads by it
        self._thread.start()
        atexit.register(self._at_exit)  # a Fabric script has no teardown: the process's end is the run's
        return self

    def _at_exit(self) -> None:
        """The interpreter ends: finished (peers then ignore this rank), or failed with the error that ends it."""
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self.failed(error) if isinstance(error, BaseException) else self.stop()

    def stop(self, state: str = "done", error: str = "") -> None:
        """Stop the thread; peers ignore a rank that stopped with ``state="done"`` (a finished fit)."""
        if self._state == "failed":  # Lightning tears down after an exception: that is no finished fit
            state, error = self._state, self._error
        self._state, self._error = state, error
        self._stop.set()
        atexit.unregister(self._at_exit)
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
            if self._group and not dist.is_initialized():  # the process group was destroyed: the run is over
                self._stop.set()
                return
            try:
                if self._local.check_pids():  # no store operation: works while the store is down
                    # A local peer just died: decide now (two store operations), before anything else --
                    # under Lightning's launcher its child observer SIGKILLs every survivor within 5 s.
                    self._confirm_dead_local_peers()
                now = time.monotonic()
                if now < next_beat:
                    continue
                next_beat = now + self.interval
                if self._store_down_since is not None:
                    if self._report.in_user_code:  # Fabric: no probe (each one logs) until this rank calls in again
                        continue
                    self._store_unreachable(None)  # may decide (grace over), then probes the store once
                self._publish()
                self._store_down_since = None
                self._read_verdict()
                self._read_failure(now)
                self._local.learn(self._get)
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
        counted = report.in_user_code and self._state == "running"
        if counted != self._counted:
            self.store.add("in_user_code", 1 if counted else -1)
            self._counted = counted

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
                self._decide(gone_text(record, f"no heartbeat for {silent:.1f} s"))

    def _confirm_dead_local_peers(self) -> None:
        """A local peer's process is gone: unless its last record says it finished, it is lost."""
        for record in self._local.confirm_dead(self._get):
            self._decide(gone_text(record, "its process no longer exists"))

    def _check_self(self, now: float) -> None:
        report = self._report
        if not self._armed or report.exempt or now - report.since < self.timeout:
            return
        if int(self.store.add("in_user_code", 0)) > 0:  # a peer is in its loop's own code: this call waits for it
            return
        idle = now - report.since
        records = {r: self._get(r) for r in range(self.world_size) if r != self.rank}
        me = {"rank": self.rank, "what": report.what, "idle": idle, "seq": report.seq, "armed": True, "exempt": False}
        self._decide(name_the_stall(records, me, self.timeout, stale_after=max(self.timeout / 2, 3 * self.interval)))

    def _store_unreachable(self, error: Optional[BaseException]) -> None:
        """The store fails. A local peer that died is the likely host (rank 0, unless torchrun's agent
        hosts it): decide after a short grace (at the normal end of a run, rank 0 may exit a moment
        before this rank stops its watchdog). Otherwise the host is remote: give it ``min(timeout, 10)``."""
        now = time.monotonic()
        if error is not None:
            self._last_store_error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if self._store_down_since is None:
            self._store_down_since = now
        if self._report.in_user_code:  # Fabric: its host may have ended its script first; decide at the next call
            return
        down = now - self._store_down_since
        self._local.check_pids()
        dead = self._local.first_dead()
        if dead and down >= min(self.timeout, 2.0):
            self._die("; ".join(
                gone_text(record, "its process no longer exists, and the process group's store (it probably hosted"
                           f" it) has been unreachable for {down:.1f} s") for record in dead
            ), by_other=False)
        if down >= min(self.timeout, 10.0):
            self._die(
                f"the process group's store has been unreachable for {down:.1f} s ({self._last_store_error}); the rank"
                " hosting it (rank 0 under Lightning's launcher and separately started ranks; torchrun's agent under"
                " torchrun) is presumed gone",
                by_other=False,
            )

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
            f" checkpoint, e.g. {self.resume}.",
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


_running: list[Watchdog] = []  # this process's, at most one: a new run's replaces an earlier run's never torn down


def start_watchdog(timeout: float, token: str, resume: str) -> Watchdog:
    """A started watchdog for this rank of the default process group (``resume``: as :class:`Watchdog`'s)."""
    while _running:
        _running.pop().stop()
    store = store_client(timeout=min(max(timeout / 4, 1.0), 5.0))
    _running.append(Watchdog(timeout, rank=dist.get_rank(), world_size=dist.get_world_size(), store=store, token=token, resume=resume))
    return _running[0].start()


__all__ = [
    "FAILURE_GRACE",
    "WATCHDOG_EXIT_CODE",
    "Watchdog",
    "check_watchdog_timeout",
    "looks_like_a_lost_peer",
    "start_watchdog",
    "store_client",
]
