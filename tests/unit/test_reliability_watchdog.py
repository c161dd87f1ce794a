"""The watchdog's decisions against a real TCPStore, with peers played by the test (no training).

Each case runs a Watchdog for rank 0 with a 1 s timeout; ``exit_fn`` records the exit code
instead of ending the process. Real processes killed mid-training: ``tests/integration/test_watchdog.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lightning_para.reliability.processes import node_fingerprint
from lightning_para.reliability.watchdog import FAILURE_GRACE, WATCHDOG_EXIT_CODE, Watchdog

TIMEOUT = 1.0


class Peers:
    """Fake ranks 1.. beating into the store like real watchdogs do."""

    def __init__(self, store, token: str) -> None:
        self.store = dist.PrefixStore(f"lightning_para/watchdog/{token}/", store)
        self.records: dict[int, dict] = {}
        self.beating: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, rank: int, beating: bool = True, **fields) -> None:
        self.records[rank] = {"rank": rank, "beat": 0, "t": time.time(), "pid": 10**7 + rank, "node": "elsewhere",
                              "host": "peerhost", "what": f"training_step (global step 3) on {rank}", "idle": 0.0,
                              "exempt": False, "armed": True, "seq": 10, "state": "running", "error": "", **fields}
        if beating:
            self.beating.add(rank)
        self._write(rank)

    def _write(self, rank: int) -> None:
        self.store.set(f"rank{rank}", json.dumps(self.records[rank]))

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for rank in list(self.beating):
                self.records[rank]["beat"] += 1
                self.records[rank]["t"] = time.time()
                self._write(rank)

    def __enter__(self) -> "Peers":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _watchdog(store, token: str, world_size: int = 3, **kwargs) -> tuple[Watchdog, list[int], io.StringIO]:
    exits: list[int] = []
    out = io.StringIO()
    dog = Watchdog(TIMEOUT, rank=0, world_size=world_size, store=store, token=token, interval=0.1,
                   exit_fn=exits.append, stream=out, **kwargs)
    return dog, exits, out


def _wait_for(exits: list[int], seconds: float) -> float:
    start = time.monotonic()
    while not exits and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_peer_without_heartbeat_is_named_with_what_it_was_doing(store):
    with Peers(store, "a") as peers:
        peers.add(1)
        peers.add(2)
        dog, exits, out = _watchdog(store, "a")
        dog.start().progress("backward and gradient sync (global step 3)")
        time.sleep(0.3)
        peers.beating.discard(2)  # rank 2's heartbeat stops: its process died (on another node)
        took = _wait_for(exits, 5 * TIMEOUT)
    assert exits == [WATCHDOG_EXIT_CODE] and took < TIMEOUT + 1.0
    text = out.getvalue()
    assert "[rank 0] lightning-para watchdog: rank 2 (pid 10000002 on peerhost) is gone: no heartbeat for" in text
    assert "Its last report" in text and "'training_step (global step 3) on 2'" in text
    assert "This rank was in 'backward and gradient sync (global step 3)'" in text and "Main thread stack" in text


def test_a_killed_peer_on_this_node_is_noticed_at_once(store):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Peers(store, "b") as peers:
            peers.add(1, pid=child.pid, node=node_fingerprint())
            peers.add(2)
            dog, exits, out = _watchdog(store, "b")
            dog.start().progress("training_step (global step 1)")
            time.sleep(0.5)  # the watchdog has read rank 1's record: a peer on this node
            os.kill(child.pid, 9)  # not reaped: a zombie, which counts as dead
            took = _wait_for(exits, 5 * TIMEOUT)
    finally:
        child.kill()
        child.wait()
    assert exits == [WATCHDOG_EXIT_CODE] and took < 0.8 * TIMEOUT  # by pid, well before the heartbeat timeout
    assert f"rank 1 (pid {child.pid} on peerhost) is gone: its process no longer exists" in out.getvalue()


def test_finished_peers_are_not_failures_and_stop_is_quiet(store):
    with Peers(store, "c") as peers:
        peers.add(1, beating=False, state="done")
        peers.add(2)
        dog, exits, _ = _watchdog(store, "c")
        dog.start()
        for step in range(25):  # this rank keeps making progress
            dog.progress(f"training_step (global step {step})")
            time.sleep(0.1 * TIMEOUT)
        dog.stop()
    assert exits == []
    record = json.loads(dist.PrefixStore("lightning_para/watchdog/c/", store).get("rank0"))
    assert record["state"] == "done"


def test_a_stuck_run_names_the_rank_furthest_behind(store):
    with Peers(store, "d") as peers:
        peers.add(1, what="backward and gradient sync (global step 5)", seq=12, idle=0.9)
        peers.add(2, what="train batch 5 loaded (global step 5)", seq=11, idle=0.9)  # behind: stuck loading data
        dog, exits, out = _watchdog(store, "d")
        dog.start()
        for i in range(12):
            dog.progress(f"step {i}")
        took = _wait_for(exits, 5 * TIMEOUT)
    assert exits == [WATCHDOG_EXIT_CODE] and took < TIMEOUT + 1.0
    text = out.getvalue()
    assert "rank 2 is stuck: no progress for 1 s in 'train batch 5 loaded (global step 5)'" in text
    assert "the other stalled ranks wait in:" in text


def test_exempt_phases_may_outlast_the_timeout(store):
    with Peers(store, "e") as peers:
        peers.add(1)
        peers.add(2)
        dog, exits, _ = _watchdog(store, "e")
        dog.start().progress("training_step (global step 1)")
        dog.progress("saving checkpoint last.ckpt", exempt=True)
        time.sleep(2.5 * TIMEOUT)
        dog.stop()
    assert exits == []


def test_under_fabric_a_rank_stalled_in_a_call_waits_while_a_peer_is_in_its_own_code(store):
    from lightning_para.core.run_guard import RunGuard

    resume = RunGuard(lambda: 0, integrity_check_every_n_steps=None, integrity_action="raise", watchdog_timeout=1.0,
                      timeout=None, check_finite=False, on_sigterm=None, front_end="Fabric").resume
    with Peers(store, "u") as peers:
        peers.add(1, exempt=True, in_user_code=True)  # rank 1 evaluates in its loop, between calls
        peers.add(2)
        counter = dist.PrefixStore("lightning_para/watchdog/u/", store)
        counter.add("in_user_code", 1)
        dog, exits, out = _watchdog(store, "u", resume=resume)
        dog.start().progress("backward and gradient sync (step 3)")  # blocked on rank 1 in the all-reduce
        time.sleep(2.5 * TIMEOUT)
        assert exits == []
        dog.progress("the loop's own code after fabric.backward (step 3)", in_user_code=True)
        assert int(counter.add("in_user_code", 0)) in (1, 2)  # this rank too, once its next beat is out
        counter.add("in_user_code", -1)  # rank 1 calls in again; a real hang now is still caught
        dog.progress("optimizer step (step 3)")
        took = _wait_for(exits, 5 * TIMEOUT)
    assert exits == [WATCHDOG_EXIT_CODE] and took < TIMEOUT + 1.0
    assert "e.g. fabric.load(path, state) from the last fabric.save." in out.getvalue() and "trainer" not in out.getvalue()


def test_the_thread_ends_when_the_process_group_is_destroyed_or_its_stop_is_called(store):
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
    with Peers(store, "g") as peers:
        peers.add(1)
        dog, exits, _ = _watchdog(store, "g", world_size=2)
        dog.start()
        dist.destroy_process_group()
        dog._thread.join(timeout=2.0)
        assert not dog._thread.is_alive() and exits == []
        again, _, _ = _watchdog(store, "g", world_size=2)
        thread = again.start()._thread
        thread.stop()  # what Lightning's test teardown calls on a leftover daemon thread
        assert thread.daemon and not thread.is_alive()


def test_a_verdict_posted_by_another_rank_ends_this_one_and_a_missing_peer_is_named(store):
    with Peers(store, "f") as peers:
        peers.add(1)
        peers.add(2)
        dog, exits, out = _watchdog(store, "f")
        dog.start()
        peers.store.set("verdict", "rank 7 is gone: its process no longer exists")
        _wait_for(exits, 2.0)
    assert exits == [WATCHDOG_EXIT_CODE] and "[rank 0] lightning-para watchdog: rank 7 is gone" in out.getvalue()
    dog, exits, out = _watchdog(store, "g", world_size=2)  # rank 1 never publishes
    dog.start()
    _wait_for(exits, 5 * TIMEOUT)
    assert exits == [WATCHDOG_EXIT_CODE] and "rank 1 never started its watchdog" in out.getvalue()


def test_a_rank_that_raised_releases_its_waiting_peers_after_a_short_grace(store):
    """Issue 24: one rank raises (a bad batch on one dp rank); its peers wait for it in a collective. Its
    failure notice ends them after FAILURE_GRACE intervals, long before the timeout; it itself does not exit."""
    with Peers(store, "h") as peers:
        peers.add(1)
        peers.add(2)
        failing, failing_exits, _ = _watchdog(store, "h")
        failing.rank = 1  # plays rank 1: its own watchdog stops and posts the notice
        failing.start().progress("training_step (global step 0)")
        waiting, exits, out = _watchdog(store, "h")
        waiting.start().progress("backward and gradient sync (global step 0)")
        try:  # as torch's pipeline stage reports it: a RuntimeError from the user's error
            raise RuntimeError("\n    [Stage 0] failed to run forward:\n    args: ...") from IndexError(
                "Token ids must lie in [0, 256)")
        except RuntimeError as error:
            failing.failed(error)
        took = _wait_for(exits, 5 * TIMEOUT)
    assert failing_exits == [] and exits == [WATCHDOG_EXIT_CODE]
    assert FAILURE_GRACE * 0.1 <= took < TIMEOUT, took
    assert "lightning-para watchdog: rank 1 stopped after IndexError: Token ids must lie in [0, 256) while doing" \
           " 'training_step (global step 0)'" in out.getvalue()


def test_the_rank_hosting_the_store_stays_until_its_peers_read_its_failure(store):
    """The store dies with rank 0. Exiting right after posting its failure notice left loaded peers a vanished
    store and the verdict "rank 0 is gone" without the root cause; rank 0 now stays until a peer posts the
    verdict (after FAILURE_GRACE intervals), or every peer has stopped, bounded by FAILURE_GRACE + 2 intervals."""
    with Peers(store, "i") as peers:
        peers.add(2)
        host, host_exits, _ = _watchdog(store, "i")  # rank 0: hosts the store
        host.start().progress("training_step (global step 0)")
        waiting, exits, out = _watchdog(store, "i")
        waiting.rank = 1
        waiting.start().progress("backward and gradient sync (global step 0)")
        started = time.monotonic()
        try:
            raise IndexError("Token ids must lie in [0, 256)")
        except IndexError as error:
            host.failed(error)  # returns once rank 1 has posted the verdict
        stayed = time.monotonic() - started
        assert exits == [WATCHDOG_EXIT_CODE] and host_exits == []
        assert FAILURE_GRACE * 0.1 <= stayed < (FAILURE_GRACE + 2) * 0.1 + 0.5, stayed
        assert "rank 0 stopped after IndexError: Token ids must lie in [0, 256)" in out.getvalue()
    with Peers(store, "j") as peers:  # every peer stopped already (they raised too): no wait
        peers.add(1, state="failed", error="IndexError: ...")
        peers.add(2, state="done")
        host, _, _ = _watchdog(store, "j")
        host.start()
        started = time.monotonic()
        host.failed(IndexError("Token ids must lie in [0, 256)"))
        assert time.monotonic() - started < FAILURE_GRACE * 0.1, "waited for peers that had stopped"


def test_bad_timeouts_raise_before_any_process_starts():
    from lightning_para import ParaStrategy

    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="`watchdog_timeout=.*` must be a positive number of seconds, or None"):
            ParaStrategy(watchdog_timeout=bad)
    ParaStrategy(watchdog_timeout=None)
