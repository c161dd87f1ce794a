"""The one runner of calibration's measurement processes: fresh processes from a fork server, never waiting on a
dead one (a process that dies is an error naming the measurement, not a hang)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence


def measurement_context(preload: Sequence[str] = ("torch", "lightning_para.calibrate.measure")) -> Any:
    """Where measurement processes (and the dry run's ranks) come from: a fork server that imports ``preload``
    once, so each process starts in about a second instead of a new interpreter's ~10 s on two busy cores (torch
    and Lightning imported again each time); spawn where the platform has no fork server. Each process is still
    fresh: its threads, its (fake) process group and its measurements are its own."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # no effect once the server runs (e.g. the test harness's)
    return context


def run_measurement(target: Callable[..., None], args_per_process: Sequence[tuple[Any, ...]], timeout: float,
                    what: str, results: Optional[int] = None) -> Any:
    """Start one fresh process (:func:`measurement_context`) per ``args_per_process`` entry running
    ``target(*args, queue)``, and return
    the first thing one of them puts on the queue (``results=k``: a list of the first ``k`` things). Never
    waits on a dead process: if every process has exited without the results, or ``timeout`` seconds pass,
    it raises :class:`RuntimeError` naming ``what`` (the children's own error is on stderr)."""
    import queue as queue_module

    ctx = measurement_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out), daemon=True) for args in args_per_process]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    wanted, got = results or 1, []
    try:
        while len(got) < wanted:
            try:
                got.append(out.get(timeout=0.5))
                continue
            except queue_module.Empty:
                pass
            if all(not proc.is_alive() for proc in procs):
                try:  # results put just before the processes exited
                    while len(got) < wanted:
                        got.append(out.get(timeout=1.0))
                    break
                except queue_module.Empty:
                    codes = [proc.exitcode for proc in procs]
                    raise RuntimeError(f"Calibrating {what} failed: its process exited with {codes} without a"
                                       " result (its error is printed above).") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"Calibrating {what} took more than {timeout:.0f} s; is the machine overloaded?")
        return got if results is not None else got[0]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


__all__ = ["measurement_context", "run_measurement"]
