"""The 4-process half of ``test_model_parallel.py`` (it sorts last so the package's one pool of
workers grows from 2 to 4 processes once): tp=4, dp=4, dp=2 x tp=2 with the user's TP and FSDP2,
ZeRO-1 or ZeRO-3 added by ParaStrategy to the user's TP, and Lightning's own FSDP2+TP checks."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.lightning_compat.common import FeedForwardModule, compare_with_mps, vector_dataset


def test_user_tp_matches_model_parallel_strategy_tp4(pools):
    compare_with_mps(pools.get(4), {"data_parallel_size": 1, "tensor_parallel_size": 4}, {"tp": 4},
                     partial(FeedForwardModule, tp=True))


def test_user_fsdp2_matches_model_parallel_strategy_dp4(pools):
    compare_with_mps(pools.get(4), {"data_parallel_size": 4, "tensor_parallel_size": 1}, {"dp": 4},
                     partial(FeedForwardModule, fsdp=True))


def test_user_tp_and_fsdp2_match_model_parallel_strategy(pools):
    compare_with_mps(pools.get(4), {"data_parallel_size": 2, "tensor_parallel_size": 2}, {"dp": 2, "tp": 2},
                     partial(FeedForwardModule, tp=True, fsdp=True))


@pytest.mark.parametrize("zero", [1, 3])
def test_user_tp_with_zero_added_by_para_strategy(pools, zero):
    """configure_model applies only TP; ParaStrategy adds ZeRO-1 (or FSDP2) over dp. Lightning's equivalent
    (ModelParallelStrategy cannot add data parallelism itself) is the user's TP + FSDP2."""
    compare_with_mps(pools.get(4), {"data_parallel_size": 2, "tensor_parallel_size": 2}, {"dp": 2, "tp": 2, "zero": zero},
                     partial(FeedForwardModule, tp=True, fsdp=True), para_model=partial(FeedForwardModule, tp=True))


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
