"""Configuration validation, the strategy registry and precision selection (no processes)."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

import lightning_para
from lightning_para import ParallelConfig, ParaPrecision, ParaStrategy
from lightning_para.precision import as_para_precision


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"zero": 4}, r"`zero=4` is not a ZeRO stage. Choose one of 0, 1, 2, 3"),
        ({"zero": True}, r"`zero=True` is not a ZeRO stage"),
        ({"tp": 0}, r"`tp=0` must be a positive integer"),
        ({"pp": -1}, r"`pp=-1` must be a positive integer"),
        ({"dp": 0}, r"`dp=0` must be a positive integer"),
        ({"ep": 3, "dp": 4}, r"`ep=3` must divide `dp=4`.*Choose ep in \[1, 2, 4\]"),
        ({"bucket_size_mb": 0}, r"`bucket_size_mb=0` must be a positive number"),
        ({"schedule": "pipedream"}, r"`schedule='pipedream'` is unknown. Choose one of 'gpipe', '1f1b'"),
        ({"activation_checkpointing": "some"}, r"`activation_checkpointing='some'` is unknown"),
        ({"zero_accumulation": "sometimes"}, r"`zero_accumulation='sometimes'` is unknown"),
        ({"zero": 1, "pp": 2, "zero_accumulation": "reduce_each_microbatch"},
         r"`zero_accumulation='reduce_each_microbatch'`.*needs `zero=2` \(got zero=1\)"),
        ({"zero": 3, "zero3_units": "layers"}, r"`zero3_units='layers'` is unknown. Choose one of 'auto', 'blocks'"),
        ({"microbatches": 0}, r"`microbatches=0` must be a positive integer"),
        ({"pipeline_balance": "flops"}, r"`pipeline_balance='flops'` is unknown"),
    ],
)
def test_bad_options_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        ParaStrategy(**kwargs)


def test_zero3_units_without_zero3_warns():
    with pytest.warns(UserWarning, match=r"`zero3_units='blocks'` has no effect with zero=1"):
        ParaStrategy(zero=1, zero3_units="blocks")


def test_dp_auto_and_world_size_checks():
    assert ParallelConfig(tp=2, pp=2).resolve_dp(8) == 2
    assert ParallelConfig().resolve_dp(3) == 3
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp=2 x tp=2 = 4"):
        ParallelConfig(tp=2, pp=2).resolve_dp(6)
    with pytest.raises(ValueError, match=r"pp=1 x dp=2 x tp=2 = 4 do not match the world size 8"):
        ParallelConfig(dp=2, tp=2).resolve_dp(8)
    with pytest.raises(ValueError, match=r"`ep=4` must divide `dp=2`.*Choose ep in \[1, 2\]"):
        ParallelConfig(ep=4).resolve_dp(2)


def test_registry_names():
    assert "para" in L.pytorch.strategies.StrategyRegistry
    trainer = L.Trainer(strategy="para_zero3", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ParaStrategy) and trainer.strategy.config.zero == 3
    trainer = L.Trainer(strategy="para", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.config.zero == 0


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_flag_becomes_para_precision(mode):
    trainer = L.Trainer(strategy=ParaStrategy(), precision=mode, accelerator="cpu", devices=1, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ParaPrecision) and plugin.precision == mode
    assert trainer.precision_plugin is not None


def test_strategy_precision_argument_wins_and_enables_fp16_on_cpu():
    trainer = L.Trainer(strategy=ParaStrategy(precision="16-mixed"), accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.precision_plugin.precision == "16-mixed"
    with pytest.raises(ValueError, match="either `precision=` or `precision_plugin=`"):
        ParaStrategy(precision="bf16-true", precision_plugin=ParaPrecision())


def test_precision_choices():
    with pytest.raises(ValueError, match=r"`precision='64-true'` is not supported.*'32-true', 'bf16-mixed'"):
        ParaPrecision("64-true")
    class DoublePrecision(Precision):
        precision = "64-true"

    with pytest.raises(ValueError, match=r"does not support `precision='64-true'`"):
        as_para_precision(DoublePrecision())
    fp16 = as_para_precision(HalfPrecision("16-true"))
    assert (fp16.param_dtype, fp16.master_dtype, fp16.scaler) == (
        __import__("torch").float16, __import__("torch").float32, None,
    )
    assert as_para_precision(Precision()).precision == "32-true"
    assert as_para_precision(MixedPrecision("bf16-mixed", "cpu")).precision == "bf16-mixed"
    assert as_para_precision(HalfPrecision("bf16-true")).master_dtype is not None
    bf16 = ParaPrecision("bf16-true")
    assert (bf16.param_dtype, bf16.master_dtype, bf16.uses_loss_scaling) == (
        __import__("torch").bfloat16, __import__("torch").float32, False,
    )
    assert ParaPrecision("16-mixed").uses_loss_scaling


def test_public_api():
    for name in ("ParaStrategy", "ParaPrecision", "ParallelConfig", "ParallelDims", "consolidate_checkpoint"):
        assert hasattr(lightning_para, name)


def test_one_process_needs_no_launcher():
    """At devices=1 there is no launcher: Lightning's would write LOCAL_RANK/WORLD_SIZE into this
    process, and a later multi-device Trainer here would take itself for a launched child and hang."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    one = L.Trainer(strategy=ParaStrategy(), accelerator="cpu", devices=1, logger=False)
    assert one.strategy.launcher is None
    two = L.Trainer(strategy=ParaStrategy(), accelerator="cpu", devices=2, logger=False)
    assert isinstance(two.strategy.launcher, _SubprocessScriptLauncher)
