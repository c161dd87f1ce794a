"""A weighted mixture on real gloo groups: the GPT recipe trained on ``TokenDataModule(sources=...)`` saves at
step 3 (a small source already wrapped) under dp=2 x tp=2 and resumes at dp=4; every later global batch is
bit-identical to the uninterrupted run's and the losses match (fp32, another reduction order). The same run from
``http://127.0.0.1:PORT/...`` (a real local server, one response cut, a cache of a few shards) gives the same
batches and losses as from the local paths."""

from __future__ import annotations

import json
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.parity import FP32_RTOL, assert_losses_close, trainer_kwargs

STEPS, SAVE_AT, SEQ, BATCH = 8, 3, 32, 8


class Batches(Callback):
    """Every step's loss and this rank's batch, with its data-parallel coordinate."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.batches.append(torch.cat([batch[0], batch[1][:, -1:]], 1))


def mixture_fit_job(sources: dict, strategy_kwargs: dict[str, Any], ckpt_dir: Optional[str], resume: Optional[str],
                    **data_kwargs: Any) -> dict:
    from lightning_para import ParaStrategy
    from lightning_para.recipes import GPT, TokenDataModule

    L.seed_everything(0, verbose=False)
    model = GPT(preset="tiny", vocab_size=512, n_layer=2, n_embd=32, n_head=2, block_size=SEQ, warmup_steps=2, sample_tokens=0)
    record = Batches()
    callbacks: list[Callback] = [record]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1))
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=STEPS,
                        callbacks=callbacks, **trainer_kwargs(limit_val_batches=0, enable_checkpointing=ckpt_dir is not None))
    data = TokenDataModule(sources=sources, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, **data_kwargs)
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    state = trainer.train_dataloader.state_dict() if dist.get_rank() == 0 else None
    return {"losses": record.losses, "batches": record.batches, "state": state,
            "dp": trainer.strategy.distributed_sampler_kwargs}


def _global(results: list[dict]) -> list[torch.Tensor]:
    """Each step's global batch: dp rank r holds every dp-th sequence (one tp replica per dp rank)."""
    by_dp = {r["dp"]["rank"]: r["batches"] for r in results}
    ranks = [by_dp[i] for i in range(len(by_dp))]
    return [torch.stack(step, 1).reshape(BATCH, -1) for step in zip(*ranks)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from lightning_para.cli.prepare import prepare
    from tests.token_data import stdlib_documents, text_folder, train_bpe

    root = tmp_path_factory.mktemp("mixture")
    texts = stdlib_documents(6)
    tokenizer = train_bpe(root / "tokenizer", texts, vocab_size=512)
    parts = {"web": texts[:5], "tiny": [texts[5][:300]]}  # "tiny": a few sequences, wrapped before step 3
    for name, docs in parts.items():
        prepare(str(tokenizer), str(root / name), [str(text_folder(root / f"{name}-text", docs))], progress=False)
    return {"web": (str(root / "web"), 0.7), "tiny": (str(root / "tiny"), 0.3)}


@pytest.fixture(scope="module")
def uninterrupted(pools, sources, tmp_path_factory) -> tuple[Any, list[dict]]:
    folder = tmp_path_factory.mktemp("ckpt")
    return folder, pools.get(4).run(mixture_fit_job, sources, {"dp": 2, "tp": 2}, str(folder), None)


def test_a_mixture_resumes_at_dp4_from_dp2_with_the_same_batches(pools, sources, uninterrupted):
    folder, full = uninterrupted
    resumed = pools.get(4).run(mixture_fit_job, sources, {"dp": 4}, None, str(folder / f"step={SAVE_AT}.ckpt"))
    tiny = full[0]["state"]["mixture"]["sources"]["tiny"]
    assert tiny["samples"] < 0.3 * SAVE_AT * BATCH - 2  # its first pass ended before the checkpoint
    before, after = _global(full), _global(resumed)
    assert len(before) == STEPS and len(after) == STEPS - SAVE_AT
    assert all(torch.equal(a, b) for a, b in zip(before[SAVE_AT:], after))
    assert_losses_close(resumed[0]["losses"], full[0]["losses"][SAVE_AT:], rtol=FP32_RTOL)


def test_training_from_an_http_server_gives_the_local_losses(pools, sources, uninterrupted, tmp_path):
    from pathlib import Path

    from tests.http_server import serve

    _, full = uninterrupted
    root = Path(sources["web"][0]).parent
    largest = max(p.stat().st_size for p in root.glob("*/shards/*.bin"))
    with serve(root) as server:
        remote = {name: (f"{server.url}/{Path(path).name}", w) for name, (path, w) in sources.items()}
        server.drop_once.add((f"/web/{json.loads((root / 'web' / 'meta.json').read_text())['shards'][1]['file']}", 0))
        # four ranks share one cache folder (one fetch per shard; the pool's workers are daemons: no loader workers)
        got = pools.get(4).run(mixture_fit_job, remote, {"dp": 2, "tp": 2}, None, None,
                               cache_dir=str(tmp_path / "cache"), cache_bytes=3 * largest)
    assert any(cut for *_, cut in server.log)  # a response was cut, and the read retried
    assert got[0]["losses"] == full[0]["losses"]  # the same layout, the same batches: bit for bit
    assert all(torch.equal(a, b) for a, b in zip(_global(got), _global(full), strict=True))
    assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.bin")) <= 3 * largest
