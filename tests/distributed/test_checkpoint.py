"""Checkpoints under every ZeRO stage: resume, reshard between layouts, consolidate.

One epoch is 10 optimizer steps (160 samples, global batch 16), so "stopped after step 10"
is an end-of-epoch checkpoint and resuming needs no mid-epoch data fast-forward.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para import consolidate_checkpoint
from tests.models import RegressionNet, regression_dataset
from tests.parity import (
    LossRecorder,
    assert_losses_close,
    assert_params_close,
    fit_job,
    fit_reference,
    mean_over_dp,
    trainer_kwargs,
)

EPOCH_DATA = functools.partial(regression_dataset, 160)
GLOBAL_BATCH = 16
CLIP = {"gradient_clip_val": 1.0}
_reference: dict[str, Any] = {}


def reference() -> dict:
    if not _reference:
        _reference.update(fit_reference(RegressionNet, EPOCH_DATA, GLOBAL_BATCH, 20, CLIP))
    return _reference


def _train(strategy_kwargs: dict, max_steps: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None,
           seed: int = 0) -> dict:
    """Inside a worker: train to `max_steps`, optionally saving each epoch or resuming from a checkpoint."""
    return fit_job(RegressionNet, strategy_kwargs, EPOCH_DATA, GLOBAL_BATCH, max_steps, CLIP,
                   collect=("losses", "params", "saved", "scale", "step"), ckpt_dir=ckpt_dir, resume=resume,
                   model_seed=seed)


def _losses(results: list[dict]) -> list[float]:
    return mean_over_dp([r["losses"] for r in results], [list(range(len(results)))])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_continues_with_identical_losses(pools, tmp_path, zero):
    pool = pools.get(2)
    first = pool.run(_train, {"zero": zero}, 10, str(tmp_path))
    checkpoint = first[0]["saved"][0]
    assert Path(checkpoint).is_dir() and (Path(checkpoint) / ".metadata").is_file()  # sharded by default
    # A differently initialised module proves the weights come from the checkpoint.
    resumed = pool.run(_train, {"zero": zero}, 20, None, checkpoint, 123)
    ref = reference()
    assert_losses_close(_losses(first), ref["losses"][:10])
    assert_losses_close(_losses(resumed), ref["losses"][10:])
    assert_params_close(resumed[0]["params"], ref["params"])

    # Consolidated into one ordinary file, the weights load into a plain LightningModule.
    consolidated = tmp_path / "consolidated.ckpt"
    consolidate_checkpoint(checkpoint, consolidated)
    plain = RegressionNet.load_from_checkpoint(consolidated)
    assert_params_close({n: p.detach() for n, p in plain.named_parameters()}, first[0]["params"], rtol=0, atol=0)


def test_reshard_zero1_dp2_into_zero3_dp4_and_zero0(pools, tmp_path):
    """A checkpoint is layout-independent: written by dp=2 ZeRO-1, read by dp=4 ZeRO-3 and dp=2 ZeRO-0."""
    checkpoint = pools.get(2).run(_train, {"zero": 1}, 10, str(tmp_path))[0]["saved"][0]
    ref = reference()
    as_zero0 = pools.get(2).run(_train, {"zero": 0}, 20, None, checkpoint, 7)
    assert_losses_close(_losses(as_zero0), ref["losses"][10:])
    as_zero3 = pools.get(4).run(_train, {"zero": 3}, 20, None, checkpoint, 7)
    assert_losses_close(_losses(as_zero3), ref["losses"][10:])
    assert_params_close(as_zero3[0]["params"], ref["params"])


def _plain_fit(max_steps: int, ckpt_dir=None, resume=None) -> list[float]:
    """Plain Lightning on one device (default strategy), optionally saving or resuming."""
    from torch.utils.data import DataLoader

    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    callbacks: list = [recorder]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="plain"))
    trainer = L.Trainer(devices=1, max_steps=max_steps, callbacks=callbacks,
                        **trainer_kwargs(**CLIP, enable_checkpointing=ckpt_dir is not None))
    trainer.fit(RegressionNet(), DataLoader(EPOCH_DATA(), batch_size=GLOBAL_BATCH), ckpt_path=resume)
    return recorder.losses


def test_single_file_save_and_plain_lightning_interop(pools, tmp_path):
    """`save_distributed_checkpoint=False` writes one ordinary file that plain Lightning resumes from
    exactly as from its own checkpoint; and a plain Lightning checkpoint resumes under ZeRO-3."""
    pool = pools.get(2)
    first = pool.run(_train, {"zero": 2, "save_distributed_checkpoint": False}, 10, str(tmp_path / "para"))
    single_file = Path(first[0]["saved"][0])
    assert single_file.is_file()
    ref = reference()

    plain_dir = tmp_path / "plain"
    _plain_fit(10, ckpt_dir=plain_dir)
    plain_checkpoint = plain_dir / "plain.ckpt"
    # Lightning's own single-device restart (not exercised by ParaStrategy) does not reproduce an
    # uninterrupted run step for step here, so the fair check of the file format is: plain
    # Lightning continues from our file exactly as it continues from its own checkpoint.
    from_ours, from_plain = _plain_fit(20, resume=str(single_file)), _plain_fit(20, resume=str(plain_checkpoint))
    assert_losses_close(from_ours, from_plain)

    # The other direction, under the strategy: exact continuation of the uninterrupted run.
    resumed = pool.run(_train, {"zero": 3}, 20, None, str(plain_checkpoint), 5)
    assert_losses_close(_losses(resumed), ref["losses"][10:])


@pytest.mark.parametrize("precision, zero", [("bf16-true", 1), ("16-mixed", 2)])
def test_resume_restores_masters_and_loss_scale(pools, tmp_path, precision, zero):
    pool = pools.get(2)
    layout = {"zero": zero, "precision": precision}
    uninterrupted = pool.run(_train, layout, 20)
    first = pool.run(_train, layout, 10, str(tmp_path))
    resumed = pool.run(_train, layout, 20, None, first[0]["saved"][0], 3)
    # Same layout and precision: the continuation repeats the uninterrupted run exactly, which
    # needs the fp32 masters (bf16-true) and the loss scale (16-mixed) restored, not re-derived.
    assert_losses_close(_losses(resumed), _losses(uninterrupted)[10:], rtol=1e-6)
    assert resumed[0]["scale"] == uninterrupted[0]["scale"]
    assert_params_close(resumed[0]["params"], uninterrupted[0]["params"], rtol=1e-6)
    if precision == "bf16-true":
        consolidated = consolidate_checkpoint(first[0]["saved"][0])
        weights = consolidated["state_dict"]
        assert all(t.dtype == torch.float32 for t in weights.values()), "consolidation exports the fp32 masters"


