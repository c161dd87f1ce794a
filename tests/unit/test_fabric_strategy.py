"""Fabric's ParaStrategy without a process group: registry, validation shared with the Trainer's
strategy, precision conversion, and the errors of Lightning's Fabric strategy unit tests
(``tests_fabric/strategies/test_model_parallel.py`` and ``test_fsdp.py``, 2.6.x) that need no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning as L
import lightning_para
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning_para.fabric import FabricParaPrecision, ParaStrategy


def test_registered_in_fabrics_registry():
    assert {"para", "para_zero1", "para_zero2", "para_zero3"} <= set(STRATEGY_REGISTRY)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="para_zero3")
    assert isinstance(fabric.strategy, ParaStrategy) and fabric.strategy.config.zero == 3
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ParaStrategy(tp=2, zero=3))
    assert fabric.strategy.config.tp == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"zero": 5}, {"tp": 0}, {"pp": 2, "schedule": "nope"}, {"dp_replicate": 2, "zero": 0}, {"zero_accumulation": "x"},
     {"activation_checkpointing": "everything"}, {"watchdog_timeout": -1.0}, {"integrity_check_every_n_steps": 0}],
)
def test_same_validation_and_errors_as_the_trainers_strategy(kwargs):
    with pytest.raises(ValueError) as trainer_error:
        lightning_para.ParaStrategy(**kwargs)
    with pytest.raises(ValueError) as fabric_error:
        ParaStrategy(**kwargs)
    assert str(fabric_error.value) == str(trainer_error.value)


def test_degrees_that_cannot_fit_raise_before_any_worker():
    with pytest.raises(ValueError, match="tp"):
        L.Fabric(accelerator="cpu", devices=2, strategy=ParaStrategy(tp=3))._strategy._configure_launcher()


@pytest.mark.parametrize(("kwargs", "match"), [({"layout": "auto"}, "layout='auto'"), ({"on_sigterm": "stop"}, "on_sigterm='stop'")])
def test_trainer_only_options_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParaStrategy(**kwargs)


def test_precision_from_fabric_is_converted():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ParaStrategy(), precision="bf16-true")
    assert isinstance(fabric.strategy.precision, FabricParaPrecision)
    assert fabric.strategy.precision.precision == "bf16-true"
    assert ParaStrategy(precision="16-mixed").precision.uses_loss_scaling
    with pytest.raises(ValueError, match="precision"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ParaStrategy(), precision="64-true")
    with pytest.raises(ValueError, match="either `precision=` or `precision_plugin=`"):
        ParaStrategy(precision="bf16-true", precision_plugin=FabricParaPrecision("32-true"))


def test_checkpoint_io_unsupported():
    """test_model_parallel.py::test_checkpoint_io_unsupported (setting one; the getter returns the unused default)."""
    from lightning.fabric.plugins import TorchCheckpointIO

    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin"):
        ParaStrategy(checkpoint_io=TorchCheckpointIO())
    strategy = ParaStrategy()
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin"):
        strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ParaStrategy(), plugins=[TorchCheckpointIO()])


def test_no_backward_sync_disabled_is_a_no_op():
    """test_model_parallel.py::test_no_backward_sync: ``enabled=False`` changes nothing."""
    strategy = ParaStrategy()
    with strategy._backward_sync_control.no_backward_sync(nn.Linear(2, 2), enabled=False):
        pass


def test_checkpoint_errors_before_any_collective(tmp_path):
    """test_save_checkpoint_storage_options, test_load_checkpoint_no_state, test_load_raw_checkpoint_optimizer_unsupported,
    test_save_checkpoint_one_dist_module_required (the distributed-filter case: test_save_filter, with ranks)."""
    strategy = ParaStrategy()
    with pytest.raises(TypeError, match="storage_options"):
        strategy.save_checkpoint(tmp_path, {}, storage_options=object())
    with pytest.raises(ValueError, match="needs a state with the model"):
        strategy.load_checkpoint(tmp_path, state=None)
    with pytest.raises(NotImplementedError, match="filtered sharded"):
        strategy.save_checkpoint(tmp_path, {"model": nn.Linear(2, 2)}, filter={"model": lambda k, v: True})


def test_a_checkpoint_holds_one_model():
    from lightning_para.checkpoint.fabric_format import split_state

    with pytest.raises(ValueError, match="exactly one model"):
        split_state({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}, lambda x: x, "save_checkpoint")
    with pytest.raises(ValueError, match="exactly one model"):
        split_state({"step": 1}, lambda x: x, "load_checkpoint")


def test_module_init_context_meta_with_empty_init():
    """test_model_parallel.py::test_meta_device_materialization (its first half: meta under empty_init)."""
    strategy = L.Fabric(accelerator="cpu", devices=1, strategy=ParaStrategy()).strategy
    with strategy.module_init_context(empty_init=True):
        layer = nn.Linear(2, 2)
    assert layer.weight.is_meta
    with strategy.module_init_context(empty_init=False):
        layer = nn.Linear(2, 2)
    assert layer.weight.device == torch.device("cpu")


@pytest.mark.parametrize("accumulate", [0, -1, 1.5, True])
def test_accumulate_is_checked_before_any_work(accumulate):
    strategy = ParaStrategy()
    with pytest.raises(ValueError, match="accumulate="):
        strategy.pipeline_step(nn.Linear(2, 2), None, accumulate=accumulate)
    with pytest.raises(ValueError, match="accumulate="):
        strategy.backward(torch.zeros(()), None, accumulate=accumulate)


def test_save_filter_applies_to_every_entry():
    """Lightning's `filter` semantics: per entry of `state`, on its state dict's keys (model, optimizer, others)."""
    from lightning_para.checkpoint.fabric_format import split_state, to_fabric_file, to_trainer_format

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = split_state({"model": model, "optimizer": optimizer, "extra": {"a": 1, "b": 2}}, lambda x: x, "save")
    keep = {"model": lambda k, v: "bias" in k, "optimizer": lambda k, v: k == "param_groups", "extra": lambda k, v: k == "a"}
    out = to_fabric_file(to_trainer_format(parts, model.state_dict(), [optimizer.state_dict()], keep))
    assert set(out["model"]) == {"bias"} and set(out["optimizer"]) == {"param_groups"} and out["extra"] == {"a": 1}


@pytest.mark.parametrize("planted", [False, True])
def test_expert_bias_stays_fp32_under_bf16_true(planted, monkeypatch):
    """`bf16-true` casts the model, buffers included; the MoE selection bias stays fp32, so a 0.001 update from
    0.3 is exactly 0.001 (bf16's spacing there is 2**-9: a bf16 bias moves by 0 or ~0.002). Planted: the
    bias cast like every buffer."""
    import importlib

    from lightning_para.moe import MoE

    parallelize_module = importlib.import_module("lightning_para.parallelize")

    if planted:
        monkeypatch.setattr(parallelize_module, "keep_expert_biases_fp32", lambda module: None)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ParaStrategy(), precision="bf16-true")
    fabric.launch()
    try:
        torch.manual_seed(0)
        model = fabric.setup(MoE(8, 16, 4, top_k=2, bias_update_rate=0.001))
        layer = model.module
        with torch.no_grad():
            layer.expert_bias.fill_(0.3)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.0))
        fabric.backward(model(torch.randn(2, 6, 8)).float().pow(2).mean())
        optimizer.step()
    finally:
        if torch.distributed.is_initialized():  # ParaStrategy's one-process group: the next test starts its own
            torch.distributed.destroy_process_group()
    assert layer.router.weight.dtype == torch.bfloat16
    # Each expert's bias moves by the rate, or not at all where its load was exactly the mean (sign 0).
    step = (layer.expert_bias.double() - torch.tensor(0.3, dtype=layer.expert_bias.dtype).double()).abs()
    exact = bool((((step - 0.001).abs() < 1e-7) | (step < 1e-7)).all() and (step > 1e-7).any())
    assert exact is not planted and (layer.expert_bias.dtype == torch.float32) is not planted, (step, layer.expert_bias)
