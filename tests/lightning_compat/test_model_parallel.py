"""A model parallelized in ``configure_model`` (Lightning's ModelParallelStrategy style) under ParaStrategy.

Adapted from the checks of Lightning's ``test_model_parallel_integration.py`` (TP, FSDP2 and
both in ``configure_model``; the device mesh the hook sees; batches identical across tp and
different across dp), plus parity: the same module trains to the same per-step losses under
``ModelParallelStrategy`` and ``ParaStrategy`` on the same ranks (1e-6 relative), and to the
one-device losses on the global batch (1e-5, ``FP32_RTOL``).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.lightning_compat.common import FeedForwardModule, dp_mean_losses, fit_job, max_rel_diff, vector_dataset
from tests.parity import FP32_RTOL, fit_reference

STEPS = 5
GLOBAL_BATCH = 16
# Same module, same ranks, same data under both strategies: only the order of a few fp32 sums
# (ParaStrategy's ZeRO-1 reduce-scatter vs FSDP2's) can differ, ~1e-7 relative per step.
MPS_RTOL = 1e-6

_reference: dict[str, list[float]] = {}


def one_device() -> list[float]:
    if "losses" not in _reference:
        _reference["losses"] = fit_reference(FeedForwardModule, vector_dataset, GLOBAL_BATCH, STEPS)["losses"]
    return _reference["losses"]


def _both(pool, mps_kwargs, para_kwargs, model, para_model=None):
    mps = pool.run(fit_job, "mps", mps_kwargs, model, STEPS, GLOBAL_BATCH)
    para = pool.run(fit_job, "para", para_kwargs, para_model or model, STEPS, GLOBAL_BATCH)
    return mps, para


def _check(mps, para):
    for m, p in zip(mps, para):
        assert (m["dp_rank"], m["dp"]) == (p["dp_rank"], p["dp"]), "the strategies split the data differently"
        assert max_rel_diff(p["losses"], m["losses"]) <= MPS_RTOL, (p["losses"], m["losses"])
    assert max_rel_diff(dp_mean_losses(para), one_device()) <= FP32_RTOL


# ----------------------------------------------------------------------------- 2 processes
def test_user_tp_matches_model_parallel_strategy_tp2(pools):
    mps, para = _both(pools.get(2), {"data_parallel_size": 1, "tensor_parallel_size": 2}, {"tp": 2},
                      partial(FeedForwardModule, tp=True))
    _check(mps, para)


@pytest.mark.parametrize("zero", [0, 3])
def test_user_fsdp2_matches_model_parallel_strategy_dp2(pools, zero):
    """zero=0 is the case that trained silently wrong before: FSDP2's gradients reduced again by ZeRO-0."""
    pool = pools.get(2)
    para = pool.run(fit_job, "para", {"dp": 2, "zero": zero}, partial(FeedForwardModule, fsdp=True), STEPS, GLOBAL_BATCH)
    mps = pool.run(fit_job, "mps", {"data_parallel_size": 2, "tensor_parallel_size": 1}, partial(FeedForwardModule, fsdp=True),
                   STEPS, GLOBAL_BATCH)
    _check(mps, para)


# ----------------------------------------------------------------------------- 4 processes
def test_user_tp_matches_model_parallel_strategy_tp4(pools):
    mps, para = _both(pools.get(4), {"data_parallel_size": 1, "tensor_parallel_size": 4}, {"tp": 4},
                      partial(FeedForwardModule, tp=True))
    _check(mps, para)


def test_user_fsdp2_matches_model_parallel_strategy_dp4(pools):
    mps, para = _both(pools.get(4), {"data_parallel_size": 4, "tensor_parallel_size": 1}, {"dp": 4},
                      partial(FeedForwardModule, fsdp=True))
    _check(mps, para)


def test_user_tp_and_fsdp2_match_model_parallel_strategy(pools):
    mps, para = _both(pools.get(4), {"data_parallel_size": 2, "tensor_parallel_size": 2}, {"dp": 2, "tp": 2},
                      partial(FeedForwardModule, tp=True, fsdp=True))
    _check(mps, para)


def test_user_tp_with_zero1_added_by_para_strategy(pools):
    """configure_model applies only TP; ParaStrategy adds ZeRO-1 over dp. Lightning's equivalent
    (ModelParallelStrategy cannot add data parallelism itself) is the user's TP + FSDP2."""
    mps, para = _both(pools.get(4), {"data_parallel_size": 2, "tensor_parallel_size": 2}, {"dp": 2, "tp": 2, "zero": 1},
                      partial(FeedForwardModule, tp=True, fsdp=True), para_model=partial(FeedForwardModule, tp=True))
    _check(mps, para)


class ChecksLikeLightning(FeedForwardModule):
    """The assertions of Lightning's ``test_fsdp2_tensor_parallel`` (our words), with Lightning's own
    sampler: ``use_distributed_sampler`` inserts a ``DistributedSampler`` from the strategy's dp mesh."""

    def on_train_start(self) -> None:
        from torch.distributed.tensor import DTensor
        from torch.utils.data import DistributedSampler

        mesh = self.device_mesh
        optimizer = self.optimizers()
        assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in self.parameters())
        assert all(isinstance(q, DTensor) and q.device_mesh.ndim == 2 for q in optimizer.param_groups[0]["params"])
        assert all(p.device.type != "meta" for p in self.parameters())
        loader = self.trainer.train_dataloader
        assert isinstance(loader.sampler, DistributedSampler)
        assert len(loader) == 64 // loader.batch_size // mesh["data_parallel"].size()

    def training_step(self, batch, batch_idx):
        gathered = self.all_gather(batch[0])  # (world, batch, dim), in global-rank order
        mesh = self.device_mesh
        tp_ranks = dist.get_process_group_ranks(mesh["tensor_parallel"].get_group())
        dp_ranks = dist.get_process_group_ranks(mesh["data_parallel"].get_group())
        assert all(torch.equal(gathered[tp_ranks[0]], gathered[r]) for r in tp_ranks)
        assert not any(torch.equal(gathered[dp_ranks[0]], gathered[r]) for r in dp_ranks[1:])
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(vector_dataset(64), batch_size=4)


def _lightning_style_fit(strategy_kwargs) -> int:
    import lightning as L

    from lightning_para import ParaStrategy
    from tests.parity import trainer_kwargs

    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=2,
                        **trainer_kwargs())
    L.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):
        model = ChecksLikeLightning(tp=True, fsdp=True)
    trainer.fit(model)
    return trainer.global_step


def test_fsdp2_tensor_parallel_as_lightning_checks_it(pools):
    assert pools.get(4).run(_lightning_style_fit, {"dp": 2, "tp": 2}) == [2] * 4
