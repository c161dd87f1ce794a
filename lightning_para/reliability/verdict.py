"""The watchdog's verdict text: which rank is gone or stuck, and what it was doing.

Records are the heartbeats each rank publishes (:meth:`lightning_para.reliability.watchdog.Watchdog._publish`):
``rank``, ``pid``, ``host``, ``t`` (wall time), ``what``, ``idle`` (seconds since its last progress report),
``seq`` (progress reports so far), ``armed``, ``exempt``, ``state`` and ``error``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional


def gone_text(record: Mapping[str, Any], why: str) -> str:
    """One rank is gone: which process, why we think so, and what it last reported."""
    ago = f", {time.time() - record['t']:.1f} s before" if record.get("t") else ""
    state = f"; it had stopped after {record['error']}" if record.get("state") == "failed" else ""
    return (
        f"rank {record['rank']} (pid {record['pid']} on {record['host']}) is gone: {why}{state}."
        f" Its last report{ago}: {record['what']!r}"
    )


def name_the_stall(
    records: Mapping[int, Optional[Mapping[str, Any]]], me: Mapping[str, Any], timeout: float, stale_after: float
) -> str:
    """A rank (``me``, its own report) made no progress for ``timeout``: name the culprit from every other
    rank's record (``None``: it never published). A gone rank first (no heartbeat for ``stale_after``), then
    one that stopped after an exception, then the stalled rank that is furthest behind (fewest reports)."""
    missing = [r for r, rec in records.items() if rec is None]
    if missing:
        return f"rank(s) {', '.join(map(str, missing))} never started their watchdog"
    live = {r: rec for r, rec in records.items() if rec is not None and rec["state"] != "done"}
    gone = [rec for rec in live.values() if rec["t"] is not None and time.time() - rec["t"] > stale_after]
    if gone:
        return "; ".join(gone_text(rec, f"no heartbeat for {time.time() - rec['t']:.1f} s") for rec in gone)
    failed = [rec for rec in live.values() if rec["state"] == "failed"]
    if failed:
        return "; ".join(f"rank {rec['rank']} stopped after {rec['error']} while doing {rec['what']!r}" for rec in failed)
    stalled = [rec for rec in [*live.values(), me] if rec["armed"] and not rec["exempt"] and rec["idle"] >= timeout / 2]
    if not stalled:
        return f"rank {me['rank']} made no progress for {me['idle']:.0f} s in {me['what']!r} while its peers did"
    behind = min(rec["seq"] for rec in stalled)
    culprits = [rec for rec in stalled if rec["seq"] == behind]
    waiting = sorted({rec["what"] for rec in stalled if rec["seq"] != behind})
    text = "; ".join(f"rank {rec['rank']} is stuck: no progress for {rec['idle']:.0f} s in {rec['what']!r}" for rec in culprits)
    if waiting:
        text += f" (the other stalled ranks wait in: {', '.join(repr(w) for w in waiting[:4])})"
    return text


__all__ = ["gone_text", "name_the_stall"]
