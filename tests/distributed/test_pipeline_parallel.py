"""Pipeline parallelism on real gloo process groups, against one device.

The model (``tests/distributed/pp_models.py``) is ordinary Lightning code plus the three-line
``configure_pipeline()`` contract. Every layout trains 10 optimizer steps and must match a
single-process run of the same global batch: per-step losses within 1e-5 relative and final
parameters within 1e-5, with gradient clipping and with gradient accumulation too.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from tests.distributed.pp_models import TinyTokenModel, token_dataset
from tests.harness import WorkerError
from tests.parity import (
    LossRecorder,
    ShardedData,
    assert_losses_close,
    assert_params_close,
    fit_reference,
    full_parameters,
    trainer_kwargs,
)

STEPS = 10
BATCH = 16  # global batch; microbatches of 4 samples at m=4

PLAIN: dict[str, Any] = {}
CLIP = {"gradient_clip_val": 1.0}
ACCUMULATE = {"accumulate_grad_batches": 2}
VARIANTS = {"plain": PLAIN, "clip": CLIP, "accumulate": ACCUMULATE}


class LoggedLoss(Callback):
    """What every rank's loggers and callbacks see as ``train_loss`` after each step."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.idle: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))
        if "pipeline/idle_fraction" in trainer.callback_metrics:
            self.idle.append(float(trainer.callback_metrics["pipeline/idle_fraction"]))


class GradNorms(Callback):
    """The true global gradient norm each optimizer step sees (after unscaling, before clipping)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning_para.parallel.data.grad_norm import global_grad_norm

        params = [p for group in optimizer.param_groups for p in group["params"]]
        replication = trainer.strategy.parallel_model.grad_replication
        self.values.append(float(global_grad_norm(params, replication=replication)))


class MeasureActivations(Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        trainer.strategy.parallel_model.pipeline.measure_activations = True


def pp_job(
    strategy_kwargs: dict[str, Any],
    trainer_overrides: Optional[dict[str, Any]] = None,
    *,
    global_batch: int = BATCH,
    max_steps: int = STEPS,
    evaluate: bool = False,
    measure_activations: bool = False,
    model_kwargs: Optional[dict[str, Any]] = None,
    pipeline: bool = True,
    extra_callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any]:
    """In every worker: train the token model under ParaStrategy; report losses, params, pipeline stats."""
    from lightning_para import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = TinyTokenModel(**(model_kwargs or {}))
    recorder, logged, norms = LossRecorder(), LoggedLoss(), GradNorms()
    callbacks = [recorder, logged, norms, *extra_callbacks] + ([MeasureActivations()] if measure_activations else [])
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps, callbacks=callbacks,
        use_distributed_sampler=False, **trainer_kwargs(**(trainer_overrides or {})),
    )
    dp = strategy.config.resolve_dp(dist.get_world_size())
    data = ShardedData(token_dataset, global_batch // dp)
    trainer.fit(module, datamodule=data)
    result: dict[str, Any] = {
        "rank": dist.get_rank(),
        "losses": recorder.losses,
        "logged": logged.values,
        "logged_idle": logged.idle,
        "params": full_parameters(module),  # this rank's stages only, under their original names
        "stats": strategy.pipeline_stats() if pipeline else None,
        "scale": strategy.precision_plugin.scale,
        "grad_norms": norms.values,
    }
    if evaluate:
        result["val"] = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"])
        result["test"] = float(trainer.test(module, datamodule=data, verbose=False)[0]["test_loss"])
        result["predictions"] = torch.cat(trainer.predict(module, datamodule=data))
    return result


def merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The union of every rank's stage parameters (names are unique across stages)."""
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r["params"].items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)  # dp/tp replicas agree exactly
            merged[name] = value
    return merged


_REFERENCES: dict[str, dict[str, Any]] = {}


def reference(variant: str) -> dict[str, Any]:
    """Single-device run of the same model and global batch (cached per module run)."""
    if variant not in _REFERENCES:
        _REFERENCES[variant] = fit_reference(TinyTokenModel, token_dataset, BATCH, STEPS, VARIANTS[variant])
    return _REFERENCES[variant]


def assert_matches_reference(results: list[dict[str, Any]], variant: str) -> None:
    ref = reference(variant)
    for r in results:
        assert_losses_close(r["losses"], ref["losses"])
    assert_params_close(merged_params(results), ref["params"])


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "layout",
    [
        {"schedule": "gpipe"},
        {"schedule": "1f1b"},
        {"schedule": "interleaved", "virtual_stages": 2},
        {"schedule": "zero_bubble"},
    ],
    ids=lambda d: d["schedule"],
)
def test_pp2_schedules_match_single_device(pools, layout, variant):
    results = pools.get(2).run(pp_job, {"pp": 2, "microbatches": 4, **layout}, VARIANTS[variant])
    assert_matches_reference(results, variant)
    # The loss every rank logs (progress bar, loggers, ModelCheckpoint) is the last stage's.
    last = next(r for r in results if r["stats"].stages[-1] == 2 * layout.get("virtual_stages", 1) - 1)
    for r in results:
        assert r["logged"] == last["logged"]
        assert r["losses"] == last["losses"]
    # Each rank ran exactly the actions of the schedule, in the schedule's order.
    from tests.pipeline_orders import schedule_action_order

    order = schedule_action_order(layout["schedule"], 2, 4, layout.get("virtual_stages", 1))
    for r in results:
        ran = [f"{e.stage}{e.action}{e.microbatch}" for e in r["stats"].events if e.action != "L"]
        assert ran == order[r["stats"].pp_rank]
        # Busy + idle = step; the idle fraction is logged every step.
        stats = r["stats"]
        assert stats.busy_time_s + stats.idle_time_s == pytest.approx(stats.step_time_s)
        assert len(r["logged_idle"]) == len(r["losses"]) and r["logged_idle"][-1] == pytest.approx(stats.idle_fraction)


@pytest.mark.parametrize("layout", [{"schedule": "looped_bfs", "virtual_stages": 2}, {"schedule": "zbv", "virtual_stages": 2},
                                    {"schedule": "dualpipev", "virtual_stages": 2}], ids=lambda d: d["schedule"])
def test_pp2_other_torch_schedules_match_single_device(pools, layout):
    results = pools.get(2).run(pp_job, {"pp": 2, "microbatches": 4, **layout}, PLAIN)
    assert_matches_reference(results, "plain")


def test_pp2_explicit_split_eval_and_predict(pools):
    """Explicit stage starts; validate/test/predict run a forward-only pipeline on every rank.

    Validation also runs during fit (sanity check, then after step 5) and must not disturb training.
    """
    during_fit = {"num_sanity_val_steps": 2, "val_check_interval": 5, "limit_val_batches": 2}
    results = pools.get(2).run(
        pp_job, {"pp": 2, "microbatches": 4, "pipeline_split": [2]}, during_fit, evaluate=True
    )
    assert results[0]["stats"].stage_layers == {0: ["embed", "blocks.0"]}
    assert results[1]["stats"].stage_layers == {1: ["blocks.1", "blocks.2", "blocks.3", "head"]}
    assert_matches_reference(results, "plain")
    model = TinyTokenModel()
    model.load_state_dict(reference("plain")["params"], strict=False)
    tokens, targets = token_dataset().tensors
    with torch.no_grad():
        logits = model(tokens)
        # Mean over batches of BATCH samples (Lightning's epoch mean of per-batch val losses).
        per_batch = [TinyTokenModel.loss(lg, tg) for lg, tg in zip(logits.split(BATCH), targets.split(BATCH))]
    for r in results:
        assert r["val"] == pytest.approx(torch.stack(per_batch[:2]).mean().item(), rel=1e-5)  # limit_val_batches=2
        assert r["test"] == pytest.approx(torch.stack(per_batch).mean().item(), rel=1e-5)
        torch.testing.assert_close(r["predictions"], logits, rtol=1e-5, atol=1e-5)


def test_pp2_balance_by_measured_time_matches_single_device(pools):
    # The model summary would run a forward with `example_input_array`: no rank can (it is cleared).
    results = pools.get(2).run(pp_job, {"pp": 2, "microbatches": 4, "pipeline_balance": "time"}, {"enable_model_summary": True})
    layers = [name for r in sorted(results, key=lambda r: r["stats"].pp_rank) for name in r["stats"].stage_layers[r["stats"].pp_rank]]
    assert layers == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]  # contiguous, complete
    assert_matches_reference(results, "plain")


def test_pp2_fp16_loss_scaling_matches_data_parallel(pools):
    """16-mixed: the schedule's loss carries the loss scale, so the unscaled steps equal dp=2's."""
    pool = pools.get(2)
    pipeline = pool.run(pp_job, {"pp": 2, "microbatches": 4, "precision": "16-mixed"}, PLAIN)
    data_parallel = pool.run(pp_job, {"dp": 2, "precision": "16-mixed"}, PLAIN, pipeline=False)
    mean = [(a + b) / 2 for a, b in zip(data_parallel[0]["losses"], data_parallel[1]["losses"])]
    # fp16 autocast rounds per-microbatch and per-half-batch matmuls differently: ~1e-3 apart.
    assert_losses_close(pipeline[0]["losses"], mean, rtol=5e-3)
    # AdamW hides a wrong gradient scale in the losses; the unscaled norms would be 2**16 apart.
    assert_losses_close(pipeline[0]["grad_norms"], data_parallel[0]["grad_norms"], rtol=5e-3)
    assert pipeline[0]["scale"] == data_parallel[0]["scale"] == 2.0**16


# ----------------------------------------------------------------------------- memory
def test_gpipe_holds_m_microbatches_of_activations_1f1b_at_most_p(pools):
    """Peak saved-activation bytes on stage 0: GPipe keeps all m microbatches, 1F1B at most p."""
    m, p = 8, 2
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        results = pools.get(2).run(
            pp_job, {"pp": p, "microbatches": m, "schedule": schedule}, PLAIN, global_batch=32, max_steps=2,
            measure_activations=True,
        )
        stage0 = next(r for r in results if r["stats"].stages == [0])
        peaks[schedule] = stage0["stats"].peak_saved_activation_bytes
    ratio = peaks["gpipe"] / peaks["1f1b"]
    assert ratio >= 0.8 * m / p, f"GPipe/1F1B peak activation ratio {ratio:.2f} < 0.8*m/p = {0.8 * m / p}; {peaks}"


# ----------------------------------------------------------------------------- bad input
def _bad_batch_job() -> None:
    pp_job({"pp": 2, "microbatches": 4}, PLAIN, global_batch=6)


def test_batch_not_divisible_by_microbatches_raises_everywhere(pools):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_bad_batch_job, keep_alive_on_error=True, timeout=120)
    assert len(info.value.errors) == 2 and not info.value.pending  # every rank raised, none hung
    assert all("microbatches=4" in tb and "ValueError" in tb for tb in info.value.errors.values())


def _no_contract_job() -> None:
    from tests.models import RegressionNet, regression_dataset

    from lightning_para import ParaStrategy

    trainer = L.Trainer(devices=2, strategy=ParaStrategy(pp=2), max_steps=1, **trainer_kwargs())
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, 8))


def test_module_without_contract_raises_on_every_rank(pools):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_no_contract_job, keep_alive_on_error=True, timeout=120)
    assert len(info.value.errors) == 2 and not info.value.pending
    assert all("configure_pipeline" in tb and "ValueError" in tb for tb in info.value.errors.values())


# ----------------------------------------------------------------------------- checkpoints
EPOCH = {"limit_train_batches": 5}  # 5 steps per epoch: a checkpoint at an epoch end resumes exactly


def _checkpoint_job(strategy_kwargs: dict[str, Any], directory: str, resume_from: Optional[str]) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_para import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = TinyTokenModel()
    recorder = LossRecorder()
    # monitor= works because every rank logs the last stage's train_loss.
    saver = ModelCheckpoint(dirpath=directory, monitor="train_loss", save_on_train_epoch_end=True, save_top_k=1)
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, max_epochs=1 if resume_from is None else 2,
        callbacks=[recorder, saver], use_distributed_sampler=False,
        **trainer_kwargs(enable_checkpointing=True, **EPOCH),
    )
    dp = strategy.config.resolve_dp(dist.get_world_size())
    trainer.fit(module, datamodule=ShardedData(token_dataset, BATCH // dp), ckpt_path=resume_from)
    return {"losses": recorder.losses, "params": full_parameters(module), "best": saver.best_model_path}


def test_pp2_checkpoint_resumes_in_pp1_on_the_single_device_trajectory(pools, tmp_path):
    """Train 5 steps at pp=2, save (sharded, by ModelCheckpoint on train_loss), resume at pp=1 x dp=2 ZeRO-1."""
    pool = pools.get(2)
    first = pool.run(_checkpoint_job, {"pp": 2, "microbatches": 4}, str(tmp_path), None)
    best = first[0]["best"]
    assert best and all(r["best"] == best for r in first)
    second = pool.run(_checkpoint_job, {"dp": 2, "zero": 1}, str(tmp_path / "resumed"), best)
    ref = fit_reference(TinyTokenModel, token_dataset, BATCH, 10, EPOCH)
    assert_losses_close(first[0]["losses"], ref["losses"][:5])
    mean = [(a + b) / 2 for a, b in zip(second[0]["losses"], second[1]["losses"])]
    assert_losses_close(mean, ref["losses"][5:])
    assert_params_close(second[0]["params"], ref["params"])


def test_pp2_single_file_checkpoint_resumes_in_plain_lightning(pools, tmp_path):
    """A consolidated checkpoint from pp=2 is an ordinary Lightning checkpoint of the whole model."""
    first = pools.get(2).run(_checkpoint_job, {"pp": 2, "microbatches": 4, "save_distributed_checkpoint": False}, str(tmp_path), None)
    checkpoint = torch.load(first[0]["best"], weights_only=False)
    full = TinyTokenModel()
    assert set(checkpoint["state_dict"]) == set(full.state_dict())
    assert sum(len(g["params"]) for g in checkpoint["optimizer_states"][0]["param_groups"]) == len(list(full.parameters()))
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, max_epochs=2, callbacks=[recorder], **trainer_kwargs(**EPOCH))
    from torch.utils.data import DataLoader

    trainer.fit(full, DataLoader(token_dataset(), batch_size=BATCH), ckpt_path=first[0]["best"])
    ref = fit_reference(TinyTokenModel, token_dataset, BATCH, 10, EPOCH)
    assert_losses_close(recorder.losses, ref["losses"][5:])
    assert_params_close(full_parameters(full), ref["params"])


# ----------------------------------------------------------------------------- 4 processes
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pp2_dp2_zero1_matches_single_device(pools, variant):
    results = pools.get(4).run(pp_job, {"pp": 2, "dp": 2, "zero": 1, "microbatches": 2}, VARIANTS[variant])
    ref = reference(variant)
    by_rank = {r["rank"]: r for r in results}
    # Mesh ("pp", "edp", "ep", "tp") = (2, 2, 1, 1): ranks 0, 1 hold stage 0 for dp 0, 1; ranks 2, 3 stage 1.
    # Each dp rank reports the loss of its half of the batch; the halves average to the global loss.
    for a, b in [(0, 1), (2, 3)]:
        mean = [(x + y) / 2 for x, y in zip(by_rank[a]["losses"], by_rank[b]["losses"])]
        assert_losses_close(mean, ref["losses"])
    assert_params_close(merged_params(results), ref["params"])


def test_pp2_dp2_zero2_matches_single_device(pools):
    results = pools.get(4).run(pp_job, {"pp": 2, "dp": 2, "zero": 2, "microbatches": 2}, ACCUMULATE)
    assert_params_close(merged_params(results), reference("accumulate")["params"])


class HeldGradients(Callback):
    """What a pipeline rank holds once its schedule has run, before ``finish_backward``: the whole gradients
    the runner set aside, and the summed shards of per-microbatch reductions (``Bucket.pending``)."""

    def __init__(self) -> None:
        self.whole: list[int] = []
        self.shards: list[int] = []
        self.params: list[int] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        parallel = trainer.strategy.parallel_model
        pending = parallel.pipeline._pending_grads or []
        self.whole.append(sum(g.numel() * g.element_size() for g in pending if g is not None))
        buckets = parallel.data_parallel.engine.buckets
        self.shards.append(sum(b.pending.numel() * b.pending.element_size() for b in buckets if b.pending is not None))
        self.params.append(sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad))


def _dp_gradient_bytes(job_kwargs: dict[str, Any], trainer_overrides: dict[str, Any]) -> dict[str, Any]:
    """One pp_job, with the gradient reductions' bytes over this rank's dp group counted (test-only counter)."""
    from tests.comm_counter import CollectiveCounter

    held = HeldGradients()

    class Counted(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.counter = CollectiveCounter().__enter__()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            dp_group = trainer.strategy.parallel_model.data_parallel.engine.slots[0].group.group_name
            # Gradient buckets only: the logged loss's 4-byte all-reduce may share the group.
            self.bytes = sum(v for kind, v, g in self.counter.calls
                             if g == dp_group and kind in ("all_reduce", "reduce_scatter") and v > 64)
            self.counter.__exit__(None, None, None)

    counted = Counted()
    result = pp_job(job_kwargs, trainer_overrides, max_steps=3, extra_callbacks=(held, counted))
    result.update(whole=held.whole, shards=held.shards, params=held.params, dp_bytes=counted.bytes)
    return result


@pytest.mark.parametrize("layout", [{"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zero_bubble"},
                                    {"schedule": "1f1b", "dp_replicate": 2}],
                         ids=lambda d: d["schedule"] + ("-hybrid" if "dp_replicate" in d else ""))
@pytest.mark.parametrize("variant", ["plain", "accumulate"])
def test_pp2_dp2_zero2_reduce_each_microbatch_matches_single_device(pools, layout, variant):
    """ZeRO-2 reduce-scatters each stage's gradients after each microbatch's backward (issue 23): the same
    training as one device, and no rank holds whole gradients when its schedule ends, only 1/dp shards."""
    kwargs = {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "zero_accumulation": "reduce_each_microbatch", **layout}
    results = pools.get(4).run(pp_job, kwargs, VARIANTS[variant])
    ref = reference(variant)
    by_rank = {r["rank"]: r for r in results}
    for a, b in [(0, 1), (2, 3)]:  # dp pairs of each pipeline rank (see test_pp2_dp2_zero1_matches_single_device)
        assert_losses_close([(x + y) / 2 for x, y in zip(by_rank[a]["losses"], by_rank[b]["losses"])], ref["losses"])
    assert_params_close(merged_params(results), ref["params"])


def _last_microbatch_only_job(strategy_kwargs: dict[str, Any], trainer_overrides: dict[str, Any]) -> dict[str, Any]:
    """pp_job with a bug planted in every rank's engine: each reduction replaces the shards summed so far."""
    from lightning_para.parallel.data.zero import ZeroDataParallel

    original = ZeroDataParallel._finish

    def _finish(self, bucket, *, into_pending=False):
        if into_pending:
            bucket.pending = None  # the bug: the earlier microbatches' shards are forgotten
        return original(self, bucket, into_pending=into_pending)

    ZeroDataParallel._finish = _finish
    try:
        return pp_job(strategy_kwargs, trainer_overrides, max_steps=3)
    finally:
        ZeroDataParallel._finish = original


def test_reduce_each_microbatch_parity_catches_lost_microbatches(pools):
    """The parity check above fails, by far, when the per-microbatch shards are not summed (only the last kept)."""
    kwargs = {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "zero_accumulation": "reduce_each_microbatch",
              "schedule": "1f1b"}
    results = pools.get(4).run(_last_microbatch_only_job, kwargs, PLAIN)
    ref = reference("plain")
    by_rank = {r["rank"]: r for r in results}
    mean = [(x + y) / 2 for x, y in zip(by_rank[0]["losses"], by_rank[1]["losses"])]
    with pytest.raises(AssertionError):
        assert_losses_close(mean, ref["losses"][:3])
    worst = max(abs(a / b - 1) for a, b in zip(mean, ref["losses"]))
    assert worst > 1e-4, worst  # 10x the 1e-5 tolerance at least


def test_reduce_each_microbatch_holds_shards_for_m_times_the_traffic(pools):
    """Measured against "no_sync" on the same pp2 x dp2 ZeRO-2 job: after the schedule a rank holds no whole
    gradient, and fp32 shards of (about) 1/dp of its parameters; the dp reductions carry m times the bytes."""
    m = 4
    base = {"pp": 2, "dp": 2, "zero": 2, "microbatches": m, "schedule": "1f1b"}
    pool = pools.get(4)
    once = pool.run(_dp_gradient_bytes, base, PLAIN)
    each = pool.run(_dp_gradient_bytes, {**base, "zero_accumulation": "reduce_each_microbatch"}, PLAIN)
    for r_once, r_each in zip(sorted(once, key=lambda r: r["rank"]), sorted(each, key=lambda r: r["rank"])):
        params = r_once["params"][-1]
        assert r_once["whole"][-1] == params and r_once["shards"][-1] == 0  # "no_sync": every whole gradient
        assert r_each["whole"][-1] == 0
        # fp32 shards: half of the rows of each bucket, rounded up per parameter (torch.chunk's padding).
        assert params / 2 <= r_each["shards"][-1] <= params / 2 * 1.1, (r_each["shards"], params)
        assert r_each["dp_bytes"] == m * r_once["dp_bytes"], (r_each["dp_bytes"], r_once["dp_bytes"])


def test_pp4_matches_single_device(pools):
    results = pools.get(4).run(pp_job, {"pp": 4, "microbatches": 4, "schedule": "1f1b"}, PLAIN)
    assert sorted(r["stats"].stages[0] for r in results) == [0, 1, 2, 3]
    assert_matches_reference(results, "plain")


# ----------------------------------------------------------------------------- with tensor parallelism
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pp2_tp2_matches_single_device(pools, variant):
    """TP inside each stage (the model declares per-block plans); logits gathered (no loss parallel)."""
    results = pools.get(4).run(pp_job, {"pp": 2, "tp": 2, "microbatches": 4, "loss_parallel": False}, VARIANTS[variant])
    assert_matches_reference(results, variant)


def test_pp2_tp2_loss_parallel_zero_bubble_matches_single_device(pools):
    """Vocab-sharded logits with loss parallel on the last stage, under a split-backward schedule."""
    results = pools.get(4).run(pp_job, {"pp": 2, "tp": 2, "microbatches": 4, "schedule": "zero_bubble"}, CLIP)
    assert_matches_reference(results, "clip")


def test_pp2_dp2_tp2_interleaved_zero1_matches_single_device(pools):
    """All three dimensions on 8 processes: interleaved stages, ZeRO-1 over dp, TP inside stages."""
    kwargs = {"pp": 2, "dp": 2, "tp": 2, "zero": 1, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}
    results = pools.get(8).run(pp_job, kwargs, ACCUMULATE)
    ref = reference("accumulate")
    by_rank = {r["rank"]: r for r in results}
    # Mesh (pp, edp, ep, tp) = (2, 2, 1, 2): ranks 0 and 2 are dp 0 and 1 of pipeline rank 0, tp 0.
    assert_losses_close([(a + b) / 2 for a, b in zip(by_rank[0]["losses"], by_rank[2]["losses"])], ref["losses"])
    assert_params_close(merged_params(results), ref["params"])
