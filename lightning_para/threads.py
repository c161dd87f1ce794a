"""One intra-op thread budget per rank on CPU, as ``torchrun`` gives (``OMP_NUM_THREADS``).

Lightning's own launcher sets no thread budget, so ``N`` ranks on a machine each start one
intra-op thread per core: on 2 cores, 4 ranks run 8 threads and the README demo ran 3.5x
slower than with one thread per rank. :func:`apply_thread_budget` gives each rank
``max(1, cores // ranks_on_this_node)`` threads unless the user chose: ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` in the environment, or a ``torch.set_num_threads`` call (any count that is
not torch's own default) always wins.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

_USER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def available_cores() -> int:
    """Logical CPUs this process may run on (its affinity mask, e.g. under a job scheduler)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _physical_cores(logical: int) -> int:
    """Physical cores among ``logical`` CPUs: torch's default thread count (``c10::get_num_physical_cores``)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        siblings = [int(line.split(":")[1]) for line in info.splitlines() if line.startswith("siblings")]
        cores = [int(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu cores")]
        if siblings and cores and cores[0] > 0:
            return max(1, logical * cores[0] // siblings[0])
    except (OSError, ValueError, IndexError):
        pass
    return logical


def user_chose_threads() -> bool:
    """Whether the thread count was set by the user (environment or ``torch.set_num_threads``)."""
    if any(os.environ.get(name) for name in _USER_ENV):
        return True
    logical = available_cores()
    return torch.get_num_threads() not in (logical, _physical_cores(logical))


def thread_budget(ranks_on_this_node: int, cores: Optional[int] = None) -> int:
    """``max(1, cores // ranks_on_this_node)``: the cores shared out between the ranks of one node."""
    if ranks_on_this_node < 1:
        raise ValueError(f"`ranks_on_this_node={ranks_on_this_node}` must be at least 1.")
    return max(1, (available_cores() if cores is None else cores) // ranks_on_this_node)


def apply_thread_budget(ranks_on_this_node: int) -> Optional[int]:
    """Set this rank's intra-op threads to :func:`thread_budget` unless the user chose; returns the
    count set, or ``None`` when the user's choice was kept (or nothing needed to change)."""
    if user_chose_threads():
        return None
    budget = thread_budget(ranks_on_this_node)
    if budget == torch.get_num_threads():
        return None
    torch.set_num_threads(budget)
    return budget


__all__ = ["apply_thread_budget", "available_cores", "thread_budget", "user_chose_threads"]
