"""The 4-process half of ``test_model_parallel.py`` (it sorts last so the package's one pool of
workers grows from 2 to 4 processes once): tp=4, dp=4, dp=2 x tp=2 with the user's TP and FSDP2,
ZeRO-1 or ZeRO-3 added by ParaStrategy to the user's TP, and Lightning's own FSDP2+TP checks."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.lightning_compat.common import (
    FeedForwardModule,
    compare_with_mps,
    dp_mean_losses,
    fit_job,
    max_rel_diff,
    vector_dataset,
)
from tests.parity import FP32_RTOL, assert_params_close, fit_reference, full_parameters


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


# ----------------------------------------------------------------------------- a one-device checkpoint into tp x zero=3
CKPT_STEPS, CKPT_BATCH, CKPT_SAMPLES = 3, 16, 32  # two steps per epoch: the checkpoint at the end of epoch 0


class ParamsAtStart(Callback):
    """The full parameters once the checkpoint is restored (collective: every rank gathers them)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = full_parameters(pl_module)


def _resume_from_file(path: str) -> dict[str, Any]:
    def after(trainer, module):
        start = next(cb for cb in trainer.callbacks if isinstance(cb, ParamsAtStart)).params
        return {"start": start, "end": full_parameters(module), "step": trainer.global_step}

    return fit_job("para", {"dp": 2, "tp": 2, "zero": 3}, partial(FeedForwardModule, tp=True), CKPT_STEPS, CKPT_BATCH,
                   None, (ParamsAtStart(),), after, ckpt_path=path, dataset=partial(vector_dataset, CKPT_SAMPLES))


def test_one_device_checkpoint_loads_into_tp_and_zero3(pools, tmp_path):
    """Issue 24: a plain single-file checkpoint (one device, as under DDP) loaded into dp2 x tp2 ZeRO-3 raised
    ``NotImplementedError`` (FSDP2's shards of tensor-parallel shards, ``_StridedShard``). Lightning's
    ModelParallelStrategy loads it; so does ParaStrategy now: weights and AdamW state are split into the
    DTensor shards, the weights equal the file's exactly, and the next step matches one device (1e-5)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", save_top_k=-1)
    reference = fit_reference(FeedForwardModule, partial(vector_dataset, CKPT_SAMPLES), CKPT_BATCH, CKPT_STEPS,
                              {"enable_checkpointing": True}, callbacks=(checkpoint,))
    path = tmp_path / "epoch=0-step=2.ckpt"
    assert path.is_file()
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert saved["optimizer_states"][0]["state"], "the file carries AdamW's moments"
    results = pools.get(4).run(_resume_from_file, str(path))
    for r in (r["extra"] for r in results):
        assert r["step"] == CKPT_STEPS
        for name, value in saved["state_dict"].items():
            assert torch.equal(r["start"][name], value.float()), name
        # One step after the restore: AdamW's moments came along too, or the parameters would differ.
        assert_params_close(r["end"], reference["params"])
    assert max_rel_diff(dp_mean_losses(results), reference["losses"][-1:]) <= FP32_RTOL
