"""Peer processes: whether one lives, which share this node (pid checks are only valid there), whether an
error means one was lost, and the watchdog's own connection to the store they all reach.

The watchdog checks its local peers by pid; the checkpoint lock checks whether its holder still runs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    _get_default_store,  # private: see docs/architecture.md
)

LOCAL_WINDOW = 64  # ranks on either side whose records are read once, to find this node's peers


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

Record = dict[str, Any]


class LocalPeers:
    """The watchdog's peers on this node (same :func:`node_fingerprint`), checked by pid: a killed local rank is
    noticed at once, without the store (which may have died with it). ``get(rank)`` reads a peer's heartbeat
    record (``None``: not published yet)."""

    def __init__(self, rank: int, world_size: int, node: str) -> None:
        self.node = node
        self.peers: dict[int, Record] = {}  # rank -> latest record
        self.dead: dict[int, int] = {}  # local peers whose process is gone -> the check that saw it
        self.checks = 0
        self.unknown = set(range(max(0, rank - LOCAL_WINDOW), min(world_size, rank + LOCAL_WINDOW + 1))) - {rank}

    def learn(self, get: Callable[[int], Optional[Record]]) -> None:
        """Read the records of nearby ranks (once each) to find the peers on this node, and keep the
        latest record of each local peer (what it was doing, whether it finished)."""
        for rank in sorted(self.unknown):
            record = get(rank)
            if record is not None:
                self.unknown.discard(rank)
                if record["node"] == self.node:
                    self.peers[rank] = record
        for rank in list(self.peers):
            if rank not in self.dead:
                self.peers[rank] = get(rank) or self.peers[rank]  # latest: finished or not

    def check_pids(self) -> bool:
        """Whether a local peer's process was newly found gone (no store operation)."""
        self.checks += 1
        found = False
        for rank, record in self.peers.items():
            if rank not in self.dead and record["state"] != "done" and not process_alive(record["pid"]):
                self.dead[rank] = self.checks
                found = True
        return found

    def first_dead(self) -> list[Record]:
        """The local peers seen dead first (survivors that exit after their own verdict die later)."""
        if not self.dead:
            return []
        first = min(self.dead.values())
        return [self.peers[r] for r, seen in sorted(self.dead.items()) if seen == first]

    def confirm_dead(self, get: Callable[[int], Optional[Record]]) -> list[Record]:
        """The last records of local peers whose process is gone and who did not finish (those that finished
        are forgotten)."""
        lost = []
        for rank in sorted(self.dead):
            record = get(rank) or self.peers[rank]
            if record["state"] == "done":
                del self.dead[rank]
                self.peers.pop(rank, None)
                continue
            lost.append(record)
        return lost


__all__ = ["LocalPeers", "looks_like_a_lost_peer", "node_fingerprint", "process_alive", "store_client"]
