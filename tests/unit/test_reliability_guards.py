"""The spike guard's and the straggler detector's decisions in one process (no process group): options, the rolling
z-score and what a spike does to an optimizer step, and who is named when. Multi-rank behaviour under the Trainer
and Fabric: ``tests/distributed/test_guards.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_para.mesh import ParallelDims
from lightning_para.observe.panels import straggler_metrics
from lightning_para.reliability.spike_guard import SpikeGuard, spike_guard_option
from lightning_para.reliability.step_guard import StepGuard
from lightning_para.reliability.straggler import StragglerDetector, mesh_coordinates, straggler_option


def test_options_name_the_argument():
    assert spike_guard_option(None) is None and spike_guard_option("clip").action == "clip"
    assert spike_guard_option({"window": 10, "warmup": 5}).window == 10
    assert straggler_option(False) is None and straggler_option({"factor": 2}).factor == 2.0
    for bad, match in [("sometimes", "action='sometimes'"), ({"window": 1}, "window=1"), ({"warmup": 200}, "warmup=200"),
                       ({"threshold": 0}, "threshold=0"), ({"sigma": 3}, "unexpected keyword argument .sigma."), (3, "spike_guard=3")]:
        with pytest.raises(ValueError, match=match):
            spike_guard_option(bad)
    for bad, match in [({"factor": 1.0}, "factor=1.0"), ({"patience": 0}, "patience=0"), ("yes", "straggler='yes'")]:
        with pytest.raises(ValueError, match=match):
            straggler_option(bad)


def run(action: str, fused: bool, spike_at: int = 8, steps: int = 12) -> dict:
    """A tiny regression stepped through the step guard and the spike guard, as the precision plugin does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    guard, spike = StepGuard(), SpikeGuard(window=8, warmup=4, action=action)
    guard.riders = [spike]
    spike.connect(torch.device("cpu"), guard)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    out: dict = {"losses": []}
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y) * (100 if step == spike_at else 1)
        spike.observe_loss(loss)
        loss.backward()
        guard.check(step, list(model.parameters()))
        before = [t.clone() for t in [*model.parameters(), *optimizer.state[model.weight].values()]] if step else []
        spike.run_step(optimizer, model.parameters(), None, optimizer.step)
        if step == spike_at:
            after = [*model.parameters(), *optimizer.state[model.weight].values()]
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after))
            out["norm"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    guard.settle()
    out["events"] = spike.events
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["found-inf", "host-read"])
def test_a_spike_skips_the_step_exactly_and_nothing_else_changes(fused, capsys):
    quiet = run("skip", fused, spike_at=-1)
    assert quiet["events"] == []
    spiked = run("skip", fused)
    (event,) = spiked["events"]
    assert event.step == 8 and event.loss > 50 * event.loss_limit and event.grad_norm > event.grad_norm_limit
    assert spiked["unchanged"]  # parameters, moments and Adam's step count: bit for bit
    assert spiked["losses"][:8] == quiet["losses"][:8] and spiked["losses"][9:] != quiet["losses"][9:]
    assert "[rank 0] lightning-para spike guard: step 8:" in capsys.readouterr().err


def test_clip_mode_steps_at_the_limit():
    clipped = run("clip", fused=False)
    (event,) = clipped["events"]
    coef = min(event.loss_limit / event.loss, event.grad_norm_limit / event.grad_norm)
    assert not clipped["unchanged"] and clipped["norm"] == pytest.approx(coef * event.grad_norm, rel=1e-5)


def test_the_window_keeps_a_spike_at_its_limit():
    spike = SpikeGuard(window=4, warmup=2)
    for value in (1.0, 1.2, 0.8):
        spike._judge(torch.tensor([value, value]))
    over, limit = spike._judge(torch.tensor([100.0, 1.0]))
    assert over.tolist() == [True, False] and spike._window[0, 3] == limit[0]  # recorded at its limit, not at 100
    over, _ = spike._judge(torch.tensor([float("nan"), 1.0]))
    assert over.tolist() == [True, False]


def test_the_slow_rank_is_named_after_patience_once_per_episode():
    detector = StragglerDetector(factor=1.5, patience=2, every_n_steps=5)
    dims = ParallelDims(pp=2, dp=2, tp=2, ep=1, world_size=8)
    detector.connect(torch.device("cpu"), 0, 8, lambda r: mesh_coordinates(dims, r))
    steady, slow = [0.010] * 8, [0.010] * 6 + [0.030, 0.011]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, figures in enumerate([steady, slow, slow, slow, steady, slow, slow]):
            detector.agreed(step, figures)
            assert detector.stragglers == ([6] if step in (2, 3, 6) else []), step
    assert [str(w.message).split(":")[1] for w in caught] == [" straggler at step 2", " straggler at step 6"]
    assert "rank 6 (pp stage 1, dp rank 1, tp rank 0, ep rank 0, cp rank 0): 30.0 ms, 3.00x the median over ranks" in str(caught[0].message)
    metrics = straggler_metrics(slow, [6])
    assert metrics["straggler/rank6/vs_median"] == pytest.approx(3.0) and metrics["straggler/named"] == 1.0
