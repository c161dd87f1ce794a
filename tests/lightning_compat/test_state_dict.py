"""Lightning's state-dict and checkpoint contract under ParaStrategy.

Adapted from Lightning's ``test_strategy_state_dict``, ``test_load_full_state_checkpoint_into_regular_model``
(ModelParallel), ``test_fsdp_strategy_full_state_dict`` and the FSDP ``_run_multiple_stages`` flow
(``trainer.test(ckpt_path=...)`` inside ``torch.inference_mode()``), and the consolidation tool:

* ``save_distributed_checkpoint=False``: rank 0 gets the full state as plain tensors (model and
  optimizer, PyTorch's format), equal to one device's after the same steps; other ranks ``{}``;
* a sharded checkpoint read by Lightning's ``python -m lightning.fabric.utilities.consolidate_checkpoint``
  loads back (ParaStrategy reads that tool's output), and ``lightning-para consolidate`` (``python -m lightning_para.cli.consolidate``)
  writes a file plain Lightning resumes from;
* loading a ZeRO-3 checkpoint works under ``torch.inference_mode()``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_para.cli.consolidate import main as consolidate_main
from tests.harness import run_code
from tests.lightning_compat.common import FeedForwardModule, dp_mean_losses, fit_job, max_rel_diff, vector_dataset
from tests.parity import FP32_RTOL, fit_reference, trainer_kwargs

STEPS = 3
GLOBAL_BATCH = 16
# SGD with momentum: parameters and momentum agree with one device to ~1e-7. (AdamW divides by the
# root of its second moment, which turns fp32 summation-order noise in near-zero gradients into
# ~1e-6 absolute weight differences: fine for losses, too coarse for an element-wise comparison.)
Model = partial(FeedForwardModule, optimizer="sgd", lr=0.3)


def _one_device_state() -> dict[str, Any]:
    """Model and optimizer state after the same steps on one device (Lightning's own strategy)."""
    L.seed_everything(0, verbose=False)
    module = Model()
    trainer = L.Trainer(devices=1, max_steps=STEPS, **trainer_kwargs())
    trainer.fit(module, DataLoader(vector_dataset(), batch_size=GLOBAL_BATCH))
    return {
        "model": {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()},
        "optimizer": trainer.strategy.optimizer_state(trainer.optimizers[0]),
        "keys": list(FeedForwardModule().state_dict()),
    }


def _full_states(trainer, module) -> dict[str, Any]:
    model = trainer.strategy.lightning_module_state_dict()
    optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {"model": model, "optimizer": optimizer}


@pytest.fixture(scope="module")
def one_device():
    return _one_device_state()


@pytest.mark.parametrize(("strategy", "model"), [
    ({"zero": 0}, Model),
    ({"zero": 2}, Model),
    ({"zero": 3}, Model),
    ({"dp": 2, "zero": 0}, partial(Model, fsdp=True)),  # the user's FSDP2
], ids=["zero0", "zero2", "zero3", "user-fsdp2"])
def test_full_state_on_rank_zero_only(pools, one_device, strategy, model):
    results = pools.get(2).run(fit_job, "para", {**strategy, "save_distributed_checkpoint": False}, model, STEPS,
                               GLOBAL_BATCH, None, (), _full_states)
    assert results[1]["extra"] == {"model": {}, "optimizer": {}}
    full = results[0]["extra"]
    assert list(full["model"]) == one_device["keys"]  # same keys, same order as the unwrapped module
    for key, value in full["model"].items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", key
        torch.testing.assert_close(value, one_device["model"][key], rtol=FP32_RTOL, atol=1e-6)
    ours, ref = full["optimizer"], one_device["optimizer"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in ref["param_groups"]]
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert ours["state"].keys() == ref["state"].keys()
    for pid, entry in ref["state"].items():
        for name, value in entry.items():
            assert type(ours["state"][pid][name]) is torch.Tensor
            torch.testing.assert_close(ours["state"][pid][name], value, rtol=FP32_RTOL, atol=1e-6)
    # A plain optimizer of a plain module takes it as it is.
    plain = FeedForwardModule()
    torch.optim.SGD(plain.parameters(), lr=0.3, momentum=0.9).load_state_dict(ours)
    plain.load_state_dict(full["model"])


def _save_sharded(trainer, module, path: str) -> dict[str, Any]:
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path)
    return {"path": path, "params": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                                     for k, v in module.state_dict().items()}}


def test_sharded_checkpoint_through_lightning_consolidation_tool(pools, tmp_path):
    pool = pools.get(2)
    one_epoch = partial(vector_dataset, STEPS * GLOBAL_BATCH)  # the checkpoint falls on an epoch boundary
    saved = pool.run(fit_job, "para", {"zero": 2}, FeedForwardModule, STEPS, GLOBAL_BATCH, None, (),
                     partial(_save_sharded, path=str(tmp_path / "sharded.ckpt")), dataset=one_epoch)
    folder = Path(saved[0]["extra"]["path"])
    # Lightning's own tool, as a user runs it (`python -m`, in a process of its own forked with torch imported).
    fabric_file = tmp_path / "fabric.ckpt"
    tool = run_code("import runpy; runpy.run_module('lightning.fabric.utilities.consolidate_checkpoint', "
                    "run_name='__main__', alter_sys=True)", str(folder), "--output_file", str(fabric_file))
    assert tool.returncode == 0, tool.stderr[-3000:]
    converted = torch.load(fabric_file, weights_only=False)
    for key, value in saved[0]["extra"]["params"].items():
        torch.testing.assert_close(converted["state_dict"][key], value, rtol=0, atol=0)
    assert "optimizer_0" in converted and "loops" in converted
    # ParaStrategy resumes from the tool's output (optimizer state included) on the one-device trajectory.
    resumed = pool.run(fit_job, "para", {"zero": 2}, FeedForwardModule, STEPS + 1, GLOBAL_BATCH,
                       ckpt_path=str(fabric_file), dataset=one_epoch)
    ref = fit_reference(FeedForwardModule, one_epoch, GLOBAL_BATCH, STEPS + 1)["losses"]
    assert max_rel_diff(dp_mean_losses(resumed), ref[STEPS:]) <= FP32_RTOL
    # ... and lightning-para's command writes a file plain Lightning resumes from.
    plain_file = tmp_path / "plain.ckpt"
    assert consolidate_main([str(folder), "--output_file", str(plain_file)]) == 0
    module = FeedForwardModule.load_from_checkpoint(plain_file)
    for key, value in saved[0]["extra"]["params"].items():
        torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)
    trainer = L.Trainer(devices=1, max_steps=STEPS + 1, **trainer_kwargs())
    trainer.fit(FeedForwardModule(), DataLoader(one_epoch(), batch_size=GLOBAL_BATCH), ckpt_path=plain_file)
    assert trainer.global_step == STEPS + 1


def _test_under_inference_mode(path: str) -> dict[str, Any]:
    """Lightning's FSDP flow: fit, save, then test and predict inside ``torch.inference_mode()``, on the
    fitted (already parallelized) module and from the checkpoint into it and into a fresh module."""
    from lightning_para import ParaStrategy

    L.seed_everything(0, verbose=False)
    model = FeedForwardModule()
    data = DataLoader(vector_dataset(64), batch_size=8)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=3), max_steps=STEPS,
                        **trainer_kwargs())
    trainer.fit(model, data)
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path)
    # Validation runs forward only: FSDP2 units kept gathered after forward stay gathered, and a save
    # must still name the sharded parameters.
    trainer.validate(model, data, verbose=False)
    after_validation = path + ".after_validation"
    trainer.save_checkpoint(after_validation)
    with torch.inference_mode():
        losses = [trainer.test(model, data, verbose=False)[0]["test_loss"]]
        losses.append(trainer.test(ckpt_path=path, dataloaders=data, verbose=False)[0]["test_loss"])
        losses.append(trainer.test(ckpt_path=after_validation, dataloaders=data, verbose=False)[0]["test_loss"])
        trainer.predict(model, data)
        trainer.predict(ckpt_path=path, dataloaders=data)
        fresh = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=3), **trainer_kwargs())
        losses.append(fresh.test(FeedForwardModule(), data, ckpt_path=path, verbose=False)[0]["test_loss"])
    return {"losses": losses}


def test_zero3_checkpoint_loads_inside_inference_mode(pools, tmp_path):
    results = pools.get(2).run(_test_under_inference_mode, str(tmp_path / "z3.ckpt"))
    for r in results:
        first, *loaded = r["losses"]
        assert all(abs(x - first) <= 1e-6 * abs(first) for x in loaded), r
