"""Issue 14 on real gloo groups: exact mid-epoch resume, strict and verified checkpoint loading.

The GPT recipe trains on ``TextDataModule`` (a ``ResumableDataLoader``): 40 kB of text in windows of
32 tokens and a global batch of 8 make ~140 steps per epoch, so every checkpoint here is mid-epoch.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.parity import FP32_RTOL, assert_losses_close, trainer_kwargs


def nan_able_gpt(**kwargs: Any) -> L.LightningModule:
    """The GPT recipe whose training step returns a NaN loss once ``model.nan_loss`` is set (a planted NaN)."""
    import torch

    from lightning_para.recipes import GPT

    class NaNableGPT(GPT):
        nan_loss = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * torch.nan if self.nan_loss else loss

    return NaNableGPT(**kwargs)

STEPS, SAVE_EVERY = 8, 3


class LoggedLoss(Callback):
    """``train_loss`` as every rank's loggers see it after each step (the global batch's mean)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def gpt(n_layer: int = 2):
    from lightning_para.recipes import GPT

    return GPT(preset="tiny", n_layer=n_layer, n_embd=32, n_head=2, block_size=32, warmup_steps=2, sample_tokens=0)


def gpt_fit_job(
    strategy_kwargs: dict[str, Any], max_steps: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None,
    n_layer: int = 2, seed: int = 0, para_last: bool = False,
) -> dict[str, Any]:
    """Inside a worker: the GPT recipe on TextDataModule; saves every 3 steps into ``ckpt_dir``
    (``para_last``: with ``ParaModelCheckpoint``, whose ``"last"`` is the newest complete checkpoint)."""
    from lightning_para import ParaStrategy
    from lightning_para.recipes import TextDataModule

    L.seed_everything(seed, verbose=False)
    model = gpt(n_layer)
    logged = LoggedLoss()
    callbacks: list[Callback] = [logged]
    if ckpt_dir is not None:
        kind = ModelCheckpoint
        if para_last:
            from lightning_para.checkpoint import ParaModelCheckpoint as kind
        callbacks.append(kind(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1))
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=max_steps,
        callbacks=callbacks, **trainer_kwargs(limit_val_batches=0, enable_checkpointing=ckpt_dir is not None),
    )
    data = TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000)
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    return {"logged": logged.values, "epoch_steps": len(data.train_dataloader())}


@pytest.fixture(scope="module")
def uninterrupted(pools, tmp_path_factory) -> tuple[Path, list[dict]]:
    """tp=2 x pp=2, 8 steps, checkpoints at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("gpt_tp2_pp2")
    return folder, pools.get(4).run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, str(folder))


def test_mid_epoch_resume_is_bit_identical_under_tp2_pp2(pools, uninterrupted):
    folder, full = uninterrupted
    assert full[0]["epoch_steps"] > 100  # step 3 is deep inside the first epoch
    assert all(r["logged"] == full[0]["logged"] for r in full)  # every rank logs the global batch's loss
    # Resumed from the step-3 checkpoint (a different seed: the weights come from the checkpoint).
    resumed = pools.get(4).run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, None, str(folder / "step=3.ckpt"), 2, 123)
    assert resumed[0]["logged"] == full[0]["logged"][SAVE_EVERY:]  # bit for bit: same layout, same batches


def test_mid_epoch_resume_from_dp2_into_dp4(pools, uninterrupted, tmp_path):
    """The global batch sequence continues exactly across a data-parallel change (tolerance: fp32
    reductions in another order than the tp=2 x pp=2 run's)."""
    _, full = uninterrupted
    # The whole run, not 3 steps: the recipe's LR schedule spans `max_steps`, which the resume must share.
    first = pools.get(4).run(gpt_fit_job, {"dp": 2, "tp": 2}, STEPS, str(tmp_path))
    assert_losses_close(first[0]["logged"], full[0]["logged"], rtol=FP32_RTOL)
    resumed = pools.get(4).run(gpt_fit_job, {"dp": 4}, STEPS, None, str(tmp_path / "step=3.ckpt"), 2, 123)
    assert_losses_close(resumed[0]["logged"], full[0]["logged"][SAVE_EVERY:], rtol=FP32_RTOL)


def test_strict_loading_and_incomplete_checkpoints(pools, uninterrupted, tmp_path):
    """Every rank raises the same error at the same point (the verdicts are agreed over ranks first),
    so the pool's process group stays usable (`keep_alive_on_error`)."""
    folder, _ = uninterrupted
    pool = pools.get(4)
    # A 4-layer checkpoint into a 2-layer model: raises on every rank, naming the unexpected keys.
    deep = tmp_path / "deep"
    pool.run(gpt_fit_job, {"dp": 4}, SAVE_EVERY, str(deep), None, 4)
    with pytest.raises(Exception) as info:
        pool.run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, None, str(deep / "step=3.ckpt"), 2, keep_alive_on_error=True)
    for traceback in info.value.errors.values():
        assert "Unexpected key(s) in the checkpoint" in traceback and "'blocks.2.attn.c_q.weight'" in traceback
        assert "strict_loading = False" in traceback
    # An interrupted save (no marker) and a truncated shard: named, with the newest complete checkpoint.
    torn = folder / "torn.ckpt"
    shutil.copytree(folder / "step=6.ckpt", torn)
    (torn / "para_complete.json").unlink()
    with pytest.raises(Exception) as info:
        pool.run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, None, str(torn), 2, keep_alive_on_error=True)
    assert all(
        "IncompleteCheckpointError" in tb and "no completion marker" in tb and "step=6.ckpt" in tb
        for tb in info.value.errors.values()
    ), info.value
    shutil.copytree(folder / "step=6.ckpt", torn, dirs_exist_ok=True)
    shard = sorted(torn.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(Exception) as info:
        pool.run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, None, str(torn), 2, keep_alive_on_error=True)
    assert all(f"`{shard.name}` is truncated or changed: 100 bytes" in tb for tb in info.value.errors.values())


def test_a_flipped_shard_fails_the_resume_on_every_rank_naming_the_file(pools, uninterrupted):
    """The fault campaign's 8 bytes flipped in the middle of a shard (the size unchanged): DCP loaded
    them without complaint and the resumed loss differed. Now every rank checks a share of the files
    against the CRC-32s written at save and all raise, naming the file and the checkpoint to use."""
    folder, _ = uninterrupted
    flipped = folder / "flipped.ckpt"
    shutil.copytree(folder / "step=6.ckpt", flipped)
    try:
        shard = max(flipped.glob("*.distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
        shard.write_bytes(bytes(data))
        with pytest.raises(Exception) as info:
            pools.get(4).run(gpt_fit_job, {"tp": 2, "pp": 2}, STEPS, None, str(flipped), 2, keep_alive_on_error=True)
        assert sorted(info.value.errors) == [0, 1, 2, 3], info.value
        for traceback in info.value.errors.values():
            assert "CorruptCheckpointError" in traceback, traceback[-3000:]
            assert f"`{shard.name}` does not match its crc32 checksum written at save" in traceback
            assert f"newest complete checkpoint in the same folder is {str(folder / 'step=6.ckpt')!r}" in traceback
    finally:
        shutil.rmtree(flipped)


# ----------------------------------------------------------------------------- silent corruption
class Corrupt(Callback):
    """Once ``trainer.global_step == step`` (after that many steps), flip one bit of ``param`` on global rank
    ``rank`` only; in the step run at ``global_step == nan_step`` make the local loss of ``nan_ranks`` NaN
    (their batch only, before any reduction)."""

    def __init__(self, step: int = 0, rank: int = -1, param: str = "", nan_step: int = 0, nan_ranks: tuple = ()):
        self.step, self.rank, self.param, self.nan_step, self.nan_ranks = step, rank, param, nan_step, nan_ranks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and dist.get_rank() == self.rank:
            import torch
            from torch.distributed.tensor import DTensor

            p = dict(pl_module.named_parameters())[self.param]
            local = p.to_local() if isinstance(p, DTensor) else p
            with torch.no_grad():
                local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)  # one flipped mantissa bit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.nan_loss = trainer.global_step == self.nan_step and dist.get_rank() in self.nan_ranks


def corruption_job(strategy_kwargs: dict[str, Any], corrupt: dict[str, Any], max_steps: int = 6) -> list[str]:
    """Train the GPT recipe with integrity checks every 2 steps; return the checker's reports."""
    from lightning_para import ParaStrategy
    from lightning_para.recipes import TextDataModule

    L.seed_everything(0, verbose=False)
    model = nan_able_gpt(preset="tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, sample_tokens=0)
    strategy = ParaStrategy(integrity_check_every_n_steps=2, **strategy_kwargs)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                        callbacks=[Corrupt(**corrupt)], **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000))
    return strategy.core.run_guard.integrity.reports


def test_a_flipped_weight_in_one_replica_is_reported_within_one_interval(pools):
    """dp=2 x tp=2, ZeRO-0: a tp-sharded weight has 2 dp replicas; flipped on rank 1 after step 3, the check
    before step 5 (every 2 steps: at 2, 4, 6) raises on every rank, naming the weight and ranks 1 and 3."""
    pool = pools.get(4)
    with pytest.raises(Exception) as info:
        pool.run(corruption_job, {"dp": 2, "tp": 2}, {"step": 3, "rank": 1, "param": "blocks.0.attn.c_q.weight"},
                 keep_alive_on_error=True)
    assert len(info.value.errors) == 4
    for traceback in info.value.errors.values():
        assert "IntegrityError: lightning-para integrity check at step 4: 'blocks.0.attn.c_q.weight' differs between" \
               " its replicas over dp: rank(s) 1, 3 hold different values" in traceback


def test_a_flipped_norm_weight_and_a_nan_loss_are_reported_in_warn_mode(pools):
    """tp=2 (x dp=2): a norm weight is whole on every rank; flipped on rank 2 it disagrees with its tp peer
    (rank 3) and its dp peer (rank 0). A NaN local loss on the ranks of dp coordinate 1 (2, 3) at step 3 is
    reported with its first step and ranks. warn mode: training goes on, every finding is kept (with
    ``check_finite=False``: by default the NaN loss stops the run at step 3, tests/distributed/test_bad_input.py)."""
    reports = pools.get(4).run(
        corruption_job, {"dp": 2, "tp": 2, "integrity_action": "warn", "check_finite": False},
        {"step": 1, "rank": 2, "param": "blocks.1.ln_1.weight", "nan_step": 3, "nan_ranks": (2, 3)},
    )
    assert all(r == reports[0] for r in reports)
    first, *later = reports[0]
    assert first.startswith("lightning-para integrity check at step 2: ")
    assert "'blocks.1.ln_1.weight' differs between its replicas over tp: rank(s) 2, 3 hold different values" in first
    assert "'blocks.1.ln_1.weight' differs between its replicas over dp: rank(s) 0, 2 hold different values" in first
    assert "'blocks.1.ln_1.weight (optimizer exp_avg)'" not in first  # the flip happened after the step
    assert any("the loss was not finite first at step 3, on rank(s) 2, 3" in r for r in later), later
