"""The spike guard and the straggler detector on real gloo groups (4 ranks), under the Trainer and under Fabric.

Spike guard: at step 6 of a tiny MLP the loss is multiplied by 100 (a planted batch, loss 100x the running mean).
In skip mode every rank skips that optimizer step -- parameters and optimizer state (Adam's step count too) after
it equal those before it bit for bit -- logs the same step, and training goes on; in clip mode the gradients that
step are scaled to the limit. Off (the default) or on without a spike, the losses are bit for bit the same.

Straggler: rank 2 sleeps 50 ms in each step; it is named (rank and mesh coordinates) within 20 steps. Nobody
sleeps: across 100 steps nobody is named (4 ranks on 2 shared cores: noisy, and that must not name anyone).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.parity import trainer_kwargs

SPIKE_AT, STEPS, SLOW_RANK = 6, 10, 2
GUARD = {"window": 20, "threshold": 6.0, "warmup": 4}


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and every optimizer state tensor (Adam's step included), copied."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in [*module.parameters(), *state]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class Regression(L.LightningModule):
    def __init__(self, fused: bool, plant: bool) -> None:
        super().__init__()
        self.net, self.fused, self.plant = mlp(), fused, plant

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * 100 if self.plant and self.global_step == SPIKE_AT else loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=self.fused)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=4)


class Watch(Callback):
    """Losses; the state before and after the planted step; the gradient norm the optimizer steps with."""

    def __init__(self, slow_rank: int = -1) -> None:
        self.losses: list[float] = []
        self.named: list[list[int]] = []
        self.result: dict[str, Any] = {}
        self.slow_rank = slow_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.slow_rank:
            time.sleep(0.05)
        if batch_idx == SPIKE_AT:
            optimizer = trainer.strategy.core.optimizers[0]
            self.before = snapshot(pl_module, optimizer)
            optimizer.register_step_pre_hook(self.grad_norm)

    def grad_norm(self, optimizer, args, kwargs):
        if "stepped_norm" not in self.result:  # dp, ZeRO-0: every rank holds the whole synced gradient
            self.result["stepped_norm"] = torch.cat([p.grad.reshape(-1) for g in optimizer.param_groups for p in g["params"]]).norm().item()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        straggler = trainer.strategy.straggler
        self.named.append(list(straggler.stragglers) if straggler is not None else [])
        if batch_idx in (SPIKE_AT, SPIKE_AT + 1):
            self.result[f"unchanged_{batch_idx}"] = same(self.before, snapshot(pl_module, trainer.strategy.core.optimizers[0]))


class MemoryLogger(Logger):
    name, version, experiment = "memory", 0, None

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs):
        pass


def trainer_job(strategy_kwargs: dict[str, Any], *, steps: int = STEPS, fused: bool = True, plant: bool = True,
                slow_rank: int = -1) -> dict[str, Any]:
    from lightning_para import ParaStrategy

    L.seed_everything(0, verbose=False)
    watch, logger = Watch(slow_rank), MemoryLogger()
    strategy = ParaStrategy(**strategy_kwargs)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=steps, callbacks=[watch],
                        **trainer_kwargs(logger=logger, limit_val_batches=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regression(fused, plant))
    spike, straggler = strategy.spike_guard, strategy.straggler
    return {
        **watch.result, "losses": watch.losses, "named": watch.named,
        "events": [vars(e) for e in spike.events] if spike is not None else [],
        "warnings": [str(w.message) for w in caught if "straggler" in str(w.message)],
        "panel": [m for m in logger.metrics if any(k.startswith("straggler/") for k in m)],
        "named_at": dict(straggler.named_at) if straggler is not None else {},
    }


def fabric_job(strategy_kwargs: dict[str, Any], *, steps: int = STEPS, fused: bool = False, plant: bool = True,
               slow_rank: int = -1) -> dict[str, Any]:
    from lightning_para.fabric import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    model = fabric.setup(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=4))
    result: dict[str, Any] = {"losses": [], "named": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in zip(range(steps), loader):
            if fabric.global_rank == slow_rank:
                time.sleep(0.05)
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss * 100 if plant and step == SPIKE_AT else loss)
            fabric.clip_gradients(model, optimizer, max_norm=1e3)  # a global norm the spike guard judges
            before = snapshot(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            if step == SPIKE_AT:
                result["unchanged_6"] = same(before, snapshot(model, optimizer))
            result["losses"].append(float(loss))
            result["named"].append(list(strategy.straggler.stragglers) if strategy.straggler is not None else [])
    strategy.core.run_guard.settle()  # the last step's agreement: its events are logged
    result["events"] = [vars(e) for e in strategy.spike_guard.events] if strategy.spike_guard is not None else []
    result["warnings"] = [str(w.message) for w in caught if "straggler" in str(w.message)]
    return result


def assert_skipped_everywhere(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert [e["step"] for e in r["events"]] == [SPIKE_AT], r["events"]  # every rank logs the same step
        assert r["events"][0]["action"] == "skip" and r["events"][0]["loss"] > 10 * r["events"][0]["loss_limit"]
        assert r["unchanged_6"]  # parameters and optimizer state bit for bit as before the step


# ----------------------------------------------------------------------------- spike guard
@pytest.mark.parametrize("zero,fused", [(1, True), (0, False)], ids=["zero1-fused-found-inf", "zero0-host-read"])
def test_trainer_spike_is_skipped_on_every_rank_and_training_goes_on(pools, zero, fused):
    results = pools.get(4).run(trainer_job, {"dp": 4, "zero": zero, "spike_guard": {**GUARD, "action": "skip"}}, fused=fused)
    assert_skipped_everywhere(results)
    assert not results[0]["unchanged_7"] and len(results[0]["losses"]) == STEPS  # the next step trains


def test_trainer_spike_guard_off_or_quiet_changes_no_loss_and_clip_mode_clips(pools):
    pool = pools.get(4)
    off = pool.run(trainer_job, {"dp": 4}, plant=False)[0]["losses"]
    quiet = pool.run(trainer_job, {"dp": 4, "spike_guard": GUARD}, plant=False)[0]
    assert quiet["losses"] == off and quiet["events"] == []  # bit for bit: no spike, no change
    clipped = pool.run(trainer_job, {"dp": 4, "spike_guard": {**GUARD, "action": "clip"}}, fused=False)
    for r in clipped:
        (event,) = r["events"]
        assert event["step"] == SPIKE_AT and event["action"] == "clip"
        coef = min(event["loss_limit"] / event["loss"], event["grad_norm_limit"] / event["grad_norm"])
        assert r["stepped_norm"] == pytest.approx(coef * event["grad_norm"], rel=1e-4)  # stepped at the limit
        assert not r["unchanged_6"]


def test_fabric_spike_is_skipped_on_every_rank(pools):
    for fused in (False, True):  # the host read, then found_inf
        results = pools.get(4).run(fabric_job, {"dp": 4, "zero": 2, "spike_guard": {**GUARD, "action": "skip"}}, fused=fused)
        assert_skipped_everywhere(results)


# ----------------------------------------------------------------------------- straggler
def test_trainer_names_the_slow_rank_with_its_coordinates_and_nobody_otherwise(pools):
    pool = pools.get(4)
    slow = pool.run(trainer_job, {"dp": 4}, steps=20, plant=False, slow_rank=SLOW_RANK)
    for r in slow:
        assert r["named"][-1] == [SLOW_RANK] and r["named_at"][SLOW_RANK] < 20, r["named"]
    (warning,) = slow[0]["warnings"]  # rank 0 warns once in the episode
    assert "rank 2 (pp stage 0, dp rank 2, tp rank 0, ep rank 0, cp rank 0)" in warning, warning
    assert slow[0]["panel"] and all("straggler/rank3/vs_median" in m for m in slow[0]["panel"])
    assert all(not r["warnings"] and not r["panel"] for r in slow[1:])  # only rank 0 warns and logs
    quiet = pool.run(trainer_job, {"dp": 4}, steps=100, plant=False)
    for r in quiet:
        assert not any(r["named"]) and not r["warnings"], r["named"]
        assert len(r["losses"]) == 100


def test_fabric_names_the_slow_rank(pools):
    results = pools.get(4).run(fabric_job, {"dp": 4}, steps=20, plant=False, slow_rank=SLOW_RANK)
    for r in results:
        assert r["named"][-1] == [SLOW_RANK], r["named"]
    assert "rank 2 (pp stage 0, dp rank 2" in results[0]["warnings"][0]
