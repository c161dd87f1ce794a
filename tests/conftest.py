"""Shared fixtures: one pool of real gloo workers per test module, one thread per process.

Two tiers (README): ``pytest -q`` runs the default tier (<= 5 minutes on 2 cores) and
``pytest -q -m ""`` the full suite (CI, <= 25 minutes). Every test in a multi-process folder
(``distributed/``, ``integration/``, ``lightning_compat/``) is marked ``slow`` here, unless its module
sets ``DEFAULT_TIER = True`` (``distributed/test_default_tier.py``: one parity check per dimension and
composition family). A new multi-process module therefore lands in the full suite by default; a slow
unit test carries ``@pytest.mark.slow`` itself.
"""

import os
import tempfile

import pytest
import torch

from tests.harness import PoolManager

# Two cores: every process (this one and each rank) must stay on one thread.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Before the test workers' fork server imports transformers (tests/harness.py): the tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The planner's per-machine calibration cache (lightning_para/calibrate/measure.py) changes CPU step-time
# predictions; tests use an empty one unless they set their own, so they do not depend on the machine.
os.environ["LIGHTNING_PARA_CACHE"] = tempfile.mkdtemp(prefix="lightning-para-cache-")

MULTI_PROCESS_FOLDERS = {"distributed", "integration", "lightning_compat"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "DEFAULT_TIER", False):
            continue
        if item.path.parent.name in MULTI_PROCESS_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def pools():
    """``pools.get(world_size)`` gives a live :class:`tests.harness.WorkerPool`; closed after the module."""
    manager = PoolManager()
    yield manager
    manager.close()
