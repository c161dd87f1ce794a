"""Shared fixtures: one pool of real gloo workers per test module, one thread per process."""

import os

import pytest
import torch

from tests.harness import PoolManager

# Two cores: every process (this one and each rank) must stay on one thread.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def pools():
    """``pools.get(world_size)`` gives a live :class:`tests.harness.WorkerPool`; closed after the module."""
    manager = PoolManager()
    yield manager
    manager.close()
