"""The thread budget per rank (issue 17): cores shared out between the ranks of a node, unless the
user chose. The cases run in fresh interpreters, since the test process itself is pinned to one
thread (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_para.threads import available_cores, thread_budget

# Torch's default threads shared out between 2 x cores ranks (one each); then a user's own
# torch.set_num_threads (a count that is never torch's default) is kept.
DEFAULT_THEN_USER = """
import torch
from lightning_para.threads import apply_thread_budget, available_cores
cores = available_cores()
first = apply_thread_budget(2 * cores)
after_default = torch.get_num_threads()
torch.set_num_threads(cores + 1)
print(first, after_default, apply_thread_budget(4), torch.get_num_threads())
"""
ENVIRONMENT = """
import torch
from lightning_para.threads import apply_thread_budget
print(apply_thread_budget(1), torch.get_num_threads())
"""


def _start(script: str, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return subprocess.Popen([sys.executable, "-c", script], env={**clean, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _words(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return out.split()


def test_budget_is_cores_over_ranks():
    assert thread_budget(4, cores=2) == 1 and thread_budget(2, cores=16) == 8 and thread_budget(3, cores=8) == 2
    with pytest.raises(ValueError, match="ranks_on_this_node=0"):
        thread_budget(0)


@pytest.mark.slow  # spawns real processes (~25 s)
def test_default_threads_are_shared_out_and_the_users_choice_wins():
    # Both fresh interpreters at once (the suite runs one test at a time: an interpreter keeps one core busy).
    default_then_user, environment = _start(DEFAULT_THEN_USER), _start(ENVIRONMENT, OMP_NUM_THREADS="1")
    first, after_default, second, after_user = _words(default_then_user)
    assert after_default == "1" and first in ("1", "None")  # None: torch already ran one thread here
    assert (second, after_user) == ("None", str(available_cores() + 1))
    # OMP_NUM_THREADS=1 wins over the budget of one rank (every core)
    assert _words(environment) == ["None", "1"]
