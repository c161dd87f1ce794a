"""Issue 24 in one process: the step guard's decisions and the tensor-parallel range checks (no process group).

Multi-rank behaviour (every rank raising the same error, pipeline stages, SIGTERM under real launchers):
``tests/distributed/test_bad_input.py`` and ``tests/integration/test_preemption.py``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from lightning_para.parallel.tensor.bounds import check_targets, check_token_ids
from lightning_para.reliability.step_guard import (
    PREEMPTED_EXIT_CODE, NonFiniteError, Preempted, StepGuard, hpc_checkpoint_path,
)


def test_a_nan_loss_or_gradient_raises_at_the_check_and_names_the_step():
    guard = StepGuard()
    guard.observe_loss(torch.tensor(1.0), step=2)
    guard.check(2)  # finite: nothing
    guard.observe_loss(torch.tensor(float("nan")), step=3)
    guard.check(3)  # launched: read at the next check (no host sync on the step's own flags)
    with pytest.raises(NonFiniteError, match=r"the loss was not finite first at step 3, on rank 0 \(their local batch\)"):
        guard.check(4)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    guard = StepGuard()
    guard.check(7, [p])
    with pytest.raises(NonFiniteError, match="the gradients were not finite at step 7"):
        guard.settle()  # before a checkpoint save and at the end of fit
    guard.settle()  # nothing in flight any more
    guard = StepGuard(check_finite=False)  # opted out: trains on
    guard.observe_loss(torch.tensor(float("nan")), step=3)
    guard.check(3, [p])
    guard.settle()


def test_pipeline_stage_outputs_name_the_first_stage_and_skip_shape_inference():
    guard = StepGuard()
    stages = [torch.nn.Identity(), torch.nn.Identity()]
    inferring = {"now": True}
    guard.watch_stage_outputs(enumerate(stages), lambda: 5, lambda: inferring["now"])
    stages[0](torch.full((2,), float("nan")))  # placeholders during shape inference: ignored
    guard.check(5)
    inferring["now"] = False
    stages[1](torch.full((2,), float("nan")))
    stages[0](torch.full((2,), float("nan")))
    with torch.no_grad():  # validation: ignored
        stages[0](torch.full((2,), float("nan")))
    guard.check(5)
    with pytest.raises(NonFiniteError, match="the forward output of pipeline stage 0 was not finite first at step 5"):
        guard.check(6)


def test_sigterm_is_recorded_agreed_at_the_check_and_stops_at_the_next_boundary_after_a_save():
    previous = signal.getsignal(signal.SIGTERM)
    guard = StepGuard(on_sigterm="checkpoint")
    guard.install_signal_handler()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.signal_received == signal.SIGTERM and guard.stop_signal is None
        saved = []
        guard.at_step_boundary(4, lambda: saved.append(1) or "/ckpt/hpc_ckpt_1.ckpt")  # not agreed yet: goes on
        guard.check(5, [])  # the step's agreement, launched
        guard.at_step_boundary(5, lambda: saved.append(1) or "/ckpt/hpc_ckpt_1.ckpt")  # read at the next check
        assert saved == []
        guard.check(6, [])  # reads step 5's: every rank agreed on the signal
        with pytest.raises(Preempted) as info:
            guard.at_step_boundary(6, lambda: saved.append(1) or "/ckpt/hpc_ckpt_1.ckpt")
    finally:
        guard.restore_signal_handler()
    assert signal.getsignal(signal.SIGTERM) == previous
    assert saved == [1] and info.value.code == PREEMPTED_EXIT_CODE == 143
    assert "stopped after SIGTERM: saved the checkpoint '/ckpt/hpc_ckpt_1.ckpt'; exiting with code 143" in str(info.value)


def test_options_and_checkpoint_names(tmp_path):
    from lightning_para import ParaStrategy

    with pytest.raises(ValueError, match="`check_finite='no'` must be True"):
        ParaStrategy(check_finite="no")
    with pytest.raises(ValueError, match="`on_sigterm='requeue'` is unknown. Choose 'checkpoint'"):
        ParaStrategy(on_sigterm="requeue")
    assert hpc_checkpoint_path(str(tmp_path)) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_3.ckpt").mkdir()
    (tmp_path / ".hpc_ckpt_9.ckpt.partial-x").mkdir()  # an interrupted save is not a version
    assert hpc_checkpoint_path(str(tmp_path)) == str(tmp_path / "hpc_ckpt_4.ckpt")


def test_range_checks_raise_what_torch_raises_on_one_device():
    ids = torch.tensor([[1, 2, 300]])
    with pytest.raises(IndexError):
        F.embedding(ids, torch.zeros(256, 4))
    with pytest.raises(IndexError, match=r"Token ids must lie in \[0, 256\) .* ids from 1 to 300"):
        check_token_ids(ids, 256)
    with pytest.raises(IndexError, match=r"ids from -1 to 2"):
        check_token_ids(torch.tensor([-1, 2]), 256)
    check_token_ids(torch.tensor([0, 255]), 256)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        F.cross_entropy(torch.zeros(2, 5), torch.tensor([1, 7]))
    with pytest.raises(IndexError, match=r"Target 7 is out of bounds. Labels must lie in \[0, 5\)"):
        check_targets(torch.tensor([1, 7]), 5)
    with pytest.raises(IndexError, match="Target -3 is out of bounds"):
        check_targets(torch.tensor([1, -3]), 5)
    check_targets(torch.tensor([1, -100, 4]), 5)  # ignore_index
    check_targets(torch.rand(2, 5), 5)  # class probabilities
