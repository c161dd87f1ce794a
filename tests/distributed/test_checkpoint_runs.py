"""Issue 37 on real gloo groups: ``ParaModelCheckpoint``'s ``"last"`` orders by the step recorded inside
each checkpoint (a consolidated copy of an old step written last is not "last"), and no thread of ours
outlives ``fit``, nor a ``trainer.save_checkpoint`` made after it (Lightning's own teardown check). An explicit
path loads as named, whichever run wrote it; where ``"hpc"`` loads this run's own checkpoint in place of the one
Lightning's lookup named, ``trainer.ckpt_path`` and Lightning's "Restored all states" line name the loaded one.

The preemption and kill scenarios with separately started ranks are in
``tests/integration/test_resume_this_run.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_para.checkpoint import consolidate_checkpoint
from lightning_para.checkpoint.atomic import read_marker
from tests.distributed.test_reliability import gpt, gpt_fit_job
from tests.parity import trainer_kwargs

OURS = ("para-ckpt-lock", "lightning-para-watchdog")


def _our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name in OURS and t.is_alive())


def fit_then_save_job(folder: str) -> dict[str, list[str]]:
    """Inside a worker: fit 4 steps saving every 2, then a save after ``fit`` (as 3 of Lightning's tests do)."""
    from lightning_para import ParaStrategy
    from lightning_para.recipes import TextDataModule

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=ParaStrategy(dp=dist.get_world_size()), max_steps=4,
        callbacks=[ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1)],
        **trainer_kwargs(limit_val_batches=0, enable_checkpointing=True),
    )
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # the lock is taken when the run starts
            seen["lock_at_start"] = [str(os.path.exists(os.path.join(folder, ".para_lock.json")))]

    trainer.callbacks.append(Probe())
    trainer.fit(gpt(), datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000))
    seen["after_fit"] = _our_threads()
    trainer.save_checkpoint(os.path.join(folder, "after.ckpt"))
    seen["after_save"] = _our_threads()
    seen["lock_after"] = [str(os.path.exists(os.path.join(folder, ".para_lock.json")))]
    return seen


def test_no_thread_of_ours_outlives_fit_nor_a_save_after_it(pools, tmp_path):
    for rank, seen in enumerate(pools.get(2).run(fit_then_save_job, str(tmp_path / "ckpt"))):
        assert seen["after_fit"] == [] and seen["after_save"] == [], (rank, seen)
        if rank == 0:
            assert seen["lock_at_start"] == ["True"] and seen["lock_after"] == ["False"], seen
    assert read_marker(tmp_path / "ckpt" / "after.ckpt")["run"] == read_marker(tmp_path / "ckpt" / "step=4.ckpt")["run"]


@pytest.mark.slow
def test_last_is_the_newest_step_not_a_consolidated_copy_written_after_it(pools, tmp_path):
    pool = pools.get(2)
    folder = tmp_path / "ckpt"
    uninterrupted = pool.run(gpt_fit_job, {"dp": 2}, 8, str(folder), None, 2, 0, True)[0]["logged"]
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["step=3.ckpt", "step=6.ckpt"]
    # A consolidated copy of step 3 placed in the folder after step 6 (the newest file by mtime, no marker).
    copy = folder / "consolidated.ckpt"
    consolidate_checkpoint(folder / "step=3.ckpt", copy)
    future = time.time() + 1000
    os.utime(copy, (future, future))
    resumed = pool.run(gpt_fit_job, {"dp": 2}, 8, str(folder), "last", 2, 0, True)[0]["logged"]
    assert resumed == uninterrupted[6:8]  # resumed at step 6: bit-identical, as the same layout must be


def _fit(root: str, run_id: str, steps: int, folder: str | None = None, ckpt_path: str | None = None) -> L.Trainer:
    from lightning_para import ParaStrategy
    from lightning_para.recipes import TextDataModule

    L.seed_everything(0, verbose=False)
    callbacks = [ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_last=True)] if folder else []
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=ParaStrategy(dp=dist.get_world_size(), run_id=run_id), max_steps=steps,
        default_root_dir=root, callbacks=callbacks, **trainer_kwargs(limit_val_batches=0, enable_checkpointing=bool(folder)),
    )
    trainer.fit(gpt(), datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000), ckpt_path=ckpt_path)
    return trainer


def explicit_and_hpc_paths_job(root: str) -> dict[str, object]:
    """Inside a worker: run "a" saves ``last.ckpt`` (step 2) and ``hpc_ckpt_1.ckpt`` in ``root``, run "b"
    ``hpc_ckpt_2.ckpt`` beside it. "a" resumes ``"hpc"`` (Lightning's lookup names b's) and a new run "c" is given
    a's ``last.ckpt`` by its path: what each loaded, by ``trainer.ckpt_path``, Lightning's log and the global step."""
    folder = os.path.join(root, "ckpt")
    _fit(root, "a", 2, folder).save_checkpoint(os.path.join(root, "hpc_ckpt_1.ckpt"))
    _fit(root, "b", 1).save_checkpoint(os.path.join(root, "hpc_ckpt_2.ckpt"))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        hpc = _fit(root, "a", 3, ckpt_path="hpc")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            named = _fit(root, "c", 3, folder, ckpt_path=os.path.join(folder, "last.ckpt"))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    return {
        "hpc": (str(hpc.ckpt_path), hpc.global_step), "named": (str(named.ckpt_path), named.global_step),
        "restored": [line for line in lines if line.startswith("Restored all states")],
        "warned": [str(w.message) for w in caught if "as named" in str(w.message)],
    }


def test_an_explicit_path_loads_as_named_and_the_log_names_the_checkpoint_loaded(pools, tmp_path):
    root = tmp_path / "shared"
    results = pools.get(2).run(explicit_and_hpc_paths_job, str(root))
    for result in results:  # "hpc": a's own step-2 checkpoint, not b's hpc_ckpt_2 (step 1) that Lightning named
        assert result["hpc"] == (str(root / "hpc_ckpt_1.ckpt"), 3), result
        # Before, refused as if "last" had been asked: "found no checkpoint of this run (c)".
        assert result["named"] == (str(root / "ckpt" / "last.ckpt"), 3), result
    assert results[0]["restored"] == [
        f"Restored all states from the checkpoint at {root / 'hpc_ckpt_1.ckpt'}",
        f"Restored all states from the checkpoint at {root / 'ckpt' / 'last.ckpt'}",
    ], results[0]
    assert results[0]["warned"] and "run a wrote it, this run is c" in results[0]["warned"][0], results[0]
