"""Issue 24: bad input never trains silently, on real gloo groups.

* A non-finite loss stops every rank by default, before the optimizer step, naming the step and
  the rank where it first appeared (under pp: the stage that produced it); ``check_finite=False``
  trains on.
* Token ids and labels outside ``[0, vocab)`` raise ``IndexError`` under ``tp=2`` (the vocab-parallel
  embedding, loss parallel), as plain torch does at ``tp=1``, on every rank.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from tests.distributed.test_reliability import nan_able_gpt
from tests.parity import trainer_kwargs

NAN_STEP = 3


class PlantNaN(Callback):
    """In the step run at ``global_step == NAN_STEP``, on global ranks ``ranks``: the local loss becomes NaN
    (``where="loss"``), or the output of the module named ``where`` (a block of pipeline stage 0)."""

    def __init__(self, ranks: tuple[int, ...], where: str = "loss") -> None:
        self.ranks, self.where, self.handle = ranks, where, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        planted = trainer.global_step == NAN_STEP and dist.get_rank() in self.ranks
        if self.where == "loss":
            pl_module.nan_loss = planted
        elif planted:
            module = dict(pl_module.named_modules())[self.where]
            self.handle = module.register_forward_hook(lambda m, a, out: out * torch.nan)
        elif self.handle is not None:
            self.handle.remove()
            self.handle = None


def nan_job(strategy_kwargs: dict[str, Any], ranks: tuple[int, ...], where: str = "loss", max_steps: int = 5) -> dict:
    """The GPT recipe with a NaN planted at step 3; returns what training left behind (if it ends)."""
    from lightning_para import ParaStrategy
    from lightning_para.recipes import TextDataModule

    L.seed_everything(0, verbose=False)
    model = nan_able_gpt(preset="tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, sample_tokens=0)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=max_steps,
                        callbacks=[PlantNaN(ranks, where)], **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000))
    finite = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in model.parameters())
    return {"steps": trainer.global_step, "finite": finite}


def test_a_nan_loss_under_zero1_stops_every_rank_naming_the_step_and_rank(pools):
    """zero=1 x dp=2, default settings: rank 1's local loss is NaN at step 3. Before this check the run ended
    with exit code 0 and NaN parameters; now every rank raises the same NonFiniteError before the optimizer step."""
    with pytest.raises(Exception) as info:
        pools.get(2).run(nan_job, {"dp": 2, "zero": 1}, (1,), keep_alive_on_error=True)
    assert len(info.value.errors) == 2, info.value
    for traceback in info.value.errors.values():
        assert "NonFiniteError: lightning-para: the loss was not finite first at step 3, on rank 1 (their local batch)." \
               in traceback, traceback[-2000:]
        assert "check_finite=False" in traceback


@pytest.mark.slow
def test_opting_out_trains_on(pools):
    """``check_finite=False``: the old behaviour, explicitly chosen (the NaN reaches the parameters)."""
    result = pools.get(2).run(nan_job, {"dp": 2, "zero": 1, "check_finite": False}, (1,))
    assert all(r == {"steps": 5, "finite": False} for r in result), result


@pytest.mark.slow
def test_under_pp_the_stage_that_produced_the_nan_is_named(pools):
    """pp=2 x dp=2 (ranks 0, 1: stage 0; ranks 2, 3: stage 1). A NaN out of block 0 (stage 0) on rank 0 reaches
    rank 2's loss too; the report names stage 0 and rank 0 only. A NaN made in the loss names the last stage."""
    pool = pools.get(4)
    with pytest.raises(Exception) as info:
        pool.run(nan_job, {"pp": 2, "dp": 2}, (0,), "blocks.0", keep_alive_on_error=True)
    assert len(info.value.errors) == 4, info.value
    for traceback in info.value.errors.values():
        assert "the forward output of pipeline stage 0 was not finite first at step 3, on rank 0 (pipeline rank 0)." \
               in traceback, traceback[-2000:]


# ----------------------------------------------------------------------------- out-of-range ids and labels
def bad_ids_job(strategy_kwargs: dict[str, Any], what: str, value: int) -> None:
    """The GPT recipe with one token id (``what="ids"``) or label (``what="labels"``) set to ``value`` in the
    first batch of dp rank 0 (every tp rank of it sees the same batch)."""
    from lightning_para import ParaStrategy
    from lightning_para.recipes import GPT, TextDataModule

    class BadBatch(GPT):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.trainer.global_step == 0 and self.trainer.strategy.parallel_dims.local_rank("dp") == 0:
                x, y = x.clone(), y.clone()
                (x if what == "ids" else y)[0, 3] = value
            return super().training_step((x, y), batch_idx)

    L.seed_everything(0, verbose=False)
    model = BadBatch(preset="tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, sample_tokens=0)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=2,
                        **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000))


def test_out_of_range_token_ids_and_labels_raise_under_tp2(pools):
    """tp=2 (the vocab-parallel embedding, loss parallel): an id >= vocab, a negative id and a label >= vocab
    raise IndexError on both ranks (they share the batch), as plain torch does at tp=1; ignore_index is fine."""
    pool = pools.get(2)
    for what, value, expected in [
        ("ids", 10_000, "Token ids must lie in [0, 256)"),
        ("ids", -1, "this batch holds ids from -1"),
        ("labels", 10_000, "Target 10000 is out of bounds"),
    ]:
        with pytest.raises(Exception) as info:
            pool.run(bad_ids_job, {"tp": 2}, what, value, keep_alive_on_error=True)
        assert len(info.value.errors) == 2, info.value
        for traceback in info.value.errors.values():
            assert "IndexError" in traceback and expected in traceback, traceback[-2000:]
    pool.run(bad_ids_job, {"tp": 2}, "labels", -100)  # cross-entropy's ignore_index: trains
