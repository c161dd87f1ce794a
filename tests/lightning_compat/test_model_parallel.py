"""A model parallelized in ``configure_model`` (Lightning's ModelParallelStrategy style) under ParaStrategy,
on 2 processes (the 4-process cases are in ``test_wide_model_parallel.py``).

Adapted from the checks of Lightning's ``test_model_parallel_integration.py`` (TP, FSDP2 and
both in ``configure_model``; the device mesh the hook sees; batches identical across tp and
different across dp), plus parity: the same module trains to the same per-step losses under
``ModelParallelStrategy`` and ``ParaStrategy`` on the same ranks (1e-6 relative), and to the
one-device losses on the global batch (1e-5, ``FP32_RTOL``).
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.lightning_compat.common import FeedForwardModule, compare_with_mps


# ----------------------------------------------------------------------------- 2 processes
def test_user_tp_matches_model_parallel_strategy_tp2(pools):
    compare_with_mps(pools.get(2), {"data_parallel_size": 1, "tensor_parallel_size": 2}, {"tp": 2},
                     partial(FeedForwardModule, tp=True))


@pytest.mark.parametrize("zero", [0, 3])
def test_user_fsdp2_matches_model_parallel_strategy_dp2(pools, zero):
    """zero=0 is the case that trained silently wrong before: FSDP2's gradients reduced again by ZeRO-0."""
    compare_with_mps(pools.get(2), {"data_parallel_size": 2, "tensor_parallel_size": 1}, {"dp": 2, "zero": zero},
                     partial(FeedForwardModule, fsdp=True))
