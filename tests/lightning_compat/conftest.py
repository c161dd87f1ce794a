"""One pool of gloo workers for the whole Lightning-compatibility package.

The root ``conftest.py`` spawns a pool per test module; here every module shares one, which
saves a spawn (import torch + Lightning on every rank) per module. The 4-process tests live
in ``test_wide_model_parallel.py``, which sorts last, so the 2-process pool starts once and the
4-process pool once.
"""

import pytest

from tests.harness import PoolManager


@pytest.fixture(scope="package")
def pools():
    manager = PoolManager()
    yield manager
    manager.close()
