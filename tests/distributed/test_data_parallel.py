"""Data parallel with ZeRO 0/1/2/3: parity, memory and communication against the ZeRO paper.

Every check trains an ordinary LightningModule (``tests.models.RegressionNet``: AdamW with
two param groups, a step LR schedule, gradient clipping at 1.0) in real gloo processes
and compares with one process on the same global batch.
"""

from __future__ import annotations

import functools

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_para.parallel.data import BytesPerParam
from tests.comm_counter import CollectiveCounter, nccl_reduce_scatter_path
from tests.harness import WorkerError
from tests.models import RegressionNet, SGDRegressionNet, regression_dataset
from tests.tp_models import NanoGPT, TokenDataset, token_dataset
from tests.sharpness import SHARP_STD
from tests.parity import (
    LossRecorder,
    ShardedData,
    assert_losses_close,
    assert_params_close,
    fit_job,
    fit_reference,
    full_parameters,
    held_bytes,
    mean_over_dp,
    trainer_kwargs,
)

GLOBAL_BATCH = 16
STEPS = 20
CLIP = {"gradient_clip_val": 1.0}

_references: dict[Any, dict] = {}


def reference(model=RegressionNet, **overrides) -> dict:
    """Single-device run on the global batch, computed once per configuration."""
    key = (model, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = fit_reference(model, regression_dataset, GLOBAL_BATCH, STEPS, {**CLIP, **overrides})
    return _references[key]


def check_parity(results: list[dict], ref: dict, world: int) -> None:
    losses = mean_over_dp([r["losses"] for r in results], [list(range(world))])
    assert_losses_close(losses, ref["losses"])
    assert_params_close(results[0]["params"], ref["params"])


# ----------------------------------------------------------------------------- 2 processes
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_parity_two_processes(pools, zero, accumulate):
    overrides = {"accumulate_grad_batches": accumulate}
    results = pools.get(2).run(
        fit_job, RegressionNet, {"zero": zero}, regression_dataset, GLOBAL_BATCH, STEPS, {**CLIP, **overrides}
    )
    check_parity(results, reference(**overrides), 2)


@pytest.mark.parametrize("zero", [1, 3])
def test_parity_sgd_momentum_steplr(pools, zero):
    """A second optimizer family (SGD + momentum, StepLR, one param group)."""
    results = pools.get(2).run(fit_job, SGDRegressionNet, {"zero": zero}, regression_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check_parity(results, reference(SGDRegressionNet), 2)


@pytest.mark.parametrize("zero", [0, 2])
def test_parity_clip_by_value(pools, zero):
    overrides = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}
    results = pools.get(2).run(fit_job, RegressionNet, {"zero": zero}, regression_dataset, GLOBAL_BATCH, STEPS, overrides)
    check_parity(results, reference(**overrides), 2)


def test_strategy_by_registry_name(pools):
    """``Trainer(strategy="para_zero2")`` resolves through Lightning's registry."""
    results = pools.get(2).run(_fit_registered_name, "para_zero2")
    assert results[0]["strategy"] == ("ParaStrategy", 2)
    assert_losses_close(mean_over_dp([r["losses"] for r in results], [[0, 1]]), reference()["losses"][:5])


def _fit_registered_name(name: str) -> dict:
    import lightning_para  # noqa: F401 - registers the names

    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=2, strategy=name, max_steps=5, callbacks=[recorder], use_distributed_sampler=False,
                        **trainer_kwargs(**CLIP))
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, GLOBAL_BATCH // 2))
    return {"losses": recorder.losses, "strategy": (type(trainer.strategy).__name__, trainer.strategy.config.zero)}


# ----------------------------------------------------------------------------- memory
def _full_bytes() -> int:
    return sum(p.numel() * 4 for p in RegressionNet().parameters())


def _memory_job(zero: int) -> dict:
    """Train a few steps, then measure this rank's tensors directly (not via the library)."""
    from lightning_para import ParaStrategy

    strategy = ParaStrategy(zero=zero)
    L.seed_everything(0, verbose=False)
    module = RegressionNet()
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3, use_distributed_sampler=False,
                        **trainer_kwargs(**CLIP))
    trainer.fit(module, datamodule=ShardedData(regression_dataset, 8))
    return {**held_bytes(module, trainer.optimizers[0]), "breakdown": strategy.memory_breakdown()}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_per_rank_two_processes(pools, zero):
    check_memory(pools.get(2).run(_memory_job, zero), zero, dp=2)


def check_memory(results: list[dict], zero: int, dp: int) -> None:
    full = _full_bytes()  # fp32 parameters of the whole model
    full_optimizer = 2 * full  # AdamW: exp_avg + exp_avg_sq
    for r in results:
        measured, breakdown = r, r["breakdown"]
        # The library's numbers agree with the tensors counted here.
        for key in ("params", "grads", "optimizer"):
            assert getattr(breakdown, key) == measured[key], (key, getattr(breakdown, key), measured[key])
        # ZeRO paper claims, per rank (5% slack for per-tensor `step` scalars and uneven rows).
        shard = 1.05 / dp
        assert measured["optimizer"] <= (shard if zero >= 1 else 1.05) * full_optimizer
        if zero >= 1:
            assert measured["optimizer"] >= 0.95 * full_optimizer / dp
        if zero >= 2:
            assert measured["grads"] <= shard * full
        if zero == 3:
            assert measured["params"] <= shard * full
        else:
            assert measured["params"] == full
        # Expected bytes from the formula match the measurement.
        expected = breakdown.expected
        assert measured["optimizer"] == pytest.approx(expected.optimizer, rel=0.05)
        assert measured["params"] == pytest.approx(expected.params, rel=0.05)


# ----------------------------------------------------------------------------- communication
class _CountWindow(Callback):
    """Counts collective bytes over optimizer steps [first, first + steps) of training."""

    def __init__(self, first_step: int, steps: int, accumulate: int) -> None:
        self.first, self.steps, self.accumulate = first_step, steps, accumulate
        self.counter = CollectiveCounter()
        self.active = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.first * self.accumulate and not self.active:
            self.counter.__enter__()
            self.active = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.active and batch_idx == (self.first + self.steps) * self.accumulate - 1:
            self.counter.__exit__(None, None, None)
            self.active = False


def _comm_job(zero: int, accumulate: int) -> dict:
    from lightning_para import ParaStrategy

    window = _CountWindow(first_step=2, steps=3, accumulate=accumulate)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=zero), max_steps=6,
                        callbacks=[window], accumulate_grad_batches=accumulate, use_distributed_sampler=False,
                        **trainer_kwargs(**CLIP))
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, 8))
    per_step = {k: v / window.steps for k, v in window.counter.bytes_by_kind.items()}
    return {"per_step": window.counter.total / window.steps, "kinds": per_step,
            "calls": {k: sum(c[0] == k for c in window.counter.calls) / window.steps for k in window.counter.bytes_by_kind}}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_communication_per_step(pools, zero):
    """2 psi per optimizer step for ZeRO 0/1/2 and 3 psi - psi_head - psi_last_block for ZeRO-3,
    independent of accumulation.

    ZeRO-1/2 take the real reduce-scatter here (NCCL's path); on gloo each pair of ranks exchanges
    the rows it owes the other instead, the same bytes (checked below)."""
    psi = _full_bytes()
    pool = pools.get(2)
    once, accumulated = (pool.run(nccl_reduce_scatter_path, _comm_job, zero, a)[0] for a in (1, 4))
    expected = (3 if zero == 3 else 2) * psi
    if zero == 3:
        # ZeRO-3 keeps the unit that runs last in forward (the head) and the last block (the
        # body's last Linear) gathered for backward: 2 psi for each (parallel/data/fsdp.py).
        net = RegressionNet()
        expected -= sum(p.numel() * 4 for m in (net.head, net.body[3]) for p in m.parameters())
    for result in (once, accumulated):
        assert result["per_step"] == pytest.approx(expected, rel=0.03), (result, expected)
    # Lightning >= 2.6.6 broadcasts a one-element SIGTERM flag before every training batch
    # (`_TrainingEpochLoop._broadcast_sigterm_tensor`), micro-steps included: not ours, and not gradient traffic.
    def without_lightning_flag(result: dict) -> float:
        return result["per_step"] - result["kinds"].get("broadcast", 0.0)

    assert without_lightning_flag(accumulated) == pytest.approx(without_lightning_flag(once), rel=1e-3)
    kinds = set(once["kinds"]) - {"all_reduce"} if zero else set(once["kinds"])
    if zero in (1, 2, 3):
        assert {"reduce_scatter", "all_gather"} <= kinds
    else:
        assert "all_reduce" in once["kinds"] and "reduce_scatter" not in once["kinds"]
    if zero in (1, 2):
        # The model fits one bucket: one reduce-scatter and one (coalesced) all-gather per step.
        assert once["calls"]["reduce_scatter"] == once["calls"]["all_gather"] == 1, once
        # gloo: each rank sends the other the half of the bucket it owes it and receives its own (a reduce-scatter's
        # bytes: psi / 2 each way, where gloo's own reduce-scatter all-reduces all of it), then the same psi is
        # gathered by one broadcast per rank.
        on_gloo = pool.run(_comm_job, zero, 1)[0]
        assert "reduce_scatter" not in on_gloo["kinds"] and "all_gather" not in on_gloo["kinds"]
        assert on_gloo["calls"]["send"] == on_gloo["calls"]["recv"] == 1, on_gloo
        assert on_gloo["kinds"]["send"] == on_gloo["kinds"]["recv"] == pytest.approx(psi / 2, rel=0.03)
        assert on_gloo["kinds"].get("all_reduce", 0) == once["kinds"].get("all_reduce", 0)  # the step guard's alone
        gathered = on_gloo["kinds"]["broadcast"] - once["kinds"].get("broadcast", 0)  # less Lightning's flag
        assert gathered == pytest.approx(once["kinds"]["all_gather"], rel=1e-9)
        assert on_gloo["calls"]["broadcast"] - once["calls"].get("broadcast", 0) == 2  # one per rank


# ----------------------------------------------------------------------------- overlap and the NCCL path (issue 17)
@pytest.mark.parametrize("zero", [1, 2])
def test_parity_native_reduce_scatter(pools, zero):
    """The real reduce-scatter (every backend but gloo) trains exactly like one device, with accumulation."""
    overrides = {"accumulate_grad_batches": 2}
    results = pools.get(2).run(
        nccl_reduce_scatter_path, fit_job, RegressionNet, {"zero": zero}, regression_dataset, GLOBAL_BATCH, STEPS,
        {**CLIP, **overrides},
    )
    check_parity(results, reference(**overrides), world=2)


class _FirstLayerMark(Callback):
    """Marks, among the counted collectives, the moment backward produced the first layer's gradient."""

    def __init__(self, window: _CountWindow) -> None:
        self.window = window

    def on_train_start(self, trainer, pl_module):
        # Registered after ZeRO's own hook (set up with the model), so it runs after that bucket's launch.
        def mark(param):
            if self.window.active:
                self.window.counter.calls.append(("first-layer-grad", 0, None))

        pl_module.body[0].weight.register_post_accumulate_grad_hook(mark)


def _overlap_job(zero: int) -> dict:
    from lightning_para import ParaStrategy

    window = _CountWindow(first_step=1, steps=1, accumulate=1)
    strategy = ParaStrategy(zero=zero, bucket_size_mb=1e-6)  # one bucket per parameter
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3,
                        callbacks=[window, _FirstLayerMark(window)], use_distributed_sampler=False,
                        **trainer_kwargs(**CLIP))
    trainer.fit(RegressionNet(depth=3), datamodule=ShardedData(regression_dataset, 8))
    return {"calls": [c[0] for c in window.counter.calls], "buckets": len(strategy.parallel_model.data_parallel.engine.buckets)}


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_reduction_overlaps_backward(pools, zero):
    """Every stage launches a bucket as soon as backward fills it: most buckets' collectives are issued
    before backward reaches the first layer; ZeRO-1/2 then all-gather every bucket at once."""
    for result in pools.get(2).run(_overlap_job, zero):
        calls, buckets = result["calls"], result["buckets"]
        assert buckets == len(list(RegressionNet(depth=3).parameters()))  # one per parameter
        before = calls[: calls.index("first-layer-grad")]
        reductions = [c for c in before if c in ("all_reduce", "reduce_scatter", "send")]  # gloo's: a send per peer
        # All but the first layer's own two buckets (its bias and weight finish backward last).
        assert len(reductions) >= buckets - 2, calls
        if zero:  # gloo: one broadcast per rank (`layout.all_gather_rows`), after backward
            after = calls[calls.index("first-layer-grad"):]
            assert after.count("broadcast") == 2 and "all_gather" not in calls, calls


def _zero3_gpt_job(steps: int, zero3_units: str = "auto", accumulate: int = 1, tie: bool = False) -> dict:
    from lightning_para import ParaStrategy

    window, recorder = _CountWindow(first_step=2, steps=3, accumulate=accumulate), LossRecorder()
    L.seed_everything(0, verbose=False)
    module = _tiny_gpt(tie)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=3, zero3_units=zero3_units),
                        max_steps=steps, callbacks=[recorder, window], use_distributed_sampler=False,
                        **trainer_kwargs(**CLIP, accumulate_grad_batches=accumulate))
    trainer.fit(module, datamodule=ShardedData(_long_token_dataset, 8 // dist.get_world_size()))
    params = full_parameters(module)
    return {"losses": recorder.losses, "params": params if dist.get_rank() == 0 else None,
            "per_step": window.counter.total_of("all_gather", "reduce_scatter") / window.steps,
            "calls": {k: sum(c[0] == k for c in window.counter.calls) / window.steps for k in ("all_gather", "reduce_scatter")}}


def _long_token_dataset():
    """Enough micro-steps for one epoch of the comm window with accumulation (an epoch's last,
    incomplete accumulation would step the optimizer early, and batch indices restart)."""
    return TokenDataset(n=96)


def _tiny_gpt(tie: bool = False):
    from lightning_para.recipes import GPT

    class SGDGPT(GPT):
        # Plain SGD: AdamW divides by sqrt(v) and would amplify summation-order rounding (~1e-7)
        # in near-zero gradients past the 1e-6 parameter tolerance within a few steps.
        # lr 0.1, not 0.5: with sharp weights (init 0.3) a 1e-7 perturbation of the initial weights moved
        # parameters by 6e-7 after 6 steps at 0.5 (atol is 1e-6), 1.6e-8 at 0.1 (tests.sharpness.perturbation_param_drift).
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return SGDGPT(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64, sample_tokens=0, tie_weights=tie,
                  init_std=SHARP_STD)


@pytest.mark.parametrize("zero3_units, accumulate, tie", [
    ("blocks", 1, False), ("blocks_and_ends", 1, False), ("blocks", 2, False), ("blocks", 1, True),
])
def test_zero3_units_move_3psi_less_embedding_head_and_last_block(pools, zero3_units, accumulate, tie):
    """ZeRO-3 on the GPT recipe matches one device while moving 3 psi - psi_embedding - psi_head -
    psi_last_block under either unit choice: the embedding is not gathered again for backward, and
    the head (last in forward) and the last block are not resharded. "blocks" does it in two
    all-gathers and one reduce-scatter fewer (the embedding and head are one grouped unit). With
    accumulation the grouped unit keeps its choice across `no_sync` micro-steps. A tied embedding
    and head join the grouped unit, which holds their table once, gathered once."""
    steps = 6
    overrides = {**CLIP, "accumulate_grad_batches": accumulate}
    results = pools.get(2).run(_zero3_gpt_job, steps, zero3_units, accumulate, tie)
    ref = fit_reference(functools.partial(_tiny_gpt, tie), _long_token_dataset, 8, steps, overrides)
    check_parity(results, ref, world=2)
    model = _tiny_gpt(tie)
    assert (model.embed.wte.weight is model.head.lm_head.weight) == tie
    psi, embedding, head, last_block = (sum(p.numel() * 4 for p in m.parameters())
                                        for m in (model, model.embed, model.head, model.blocks[-1]))
    if tie:  # psi counts the shared table once; so does the grouped unit's one gather
        embedding = 0
    layers = len(model.blocks)
    # Forward gathers every unit; backward every block but the last.
    expected_calls = {"blocks": (layers + 1 + layers - 1, layers + 1),
                      "blocks_and_ends": (layers + 2 + layers - 1, layers + 2)}[zero3_units]
    for r in results:
        assert r["per_step"] == pytest.approx(3 * psi - embedding - head - last_block, rel=0.02), (r["per_step"], psi, r["calls"])
        if accumulate == 1:
            assert (r["calls"]["all_gather"], r["calls"]["reduce_scatter"]) == expected_calls, r["calls"]


# ----------------------------------------------------------------------------- precision
def _bf16_true_job(zero: int, steps: int) -> dict:
    result = fit_job(RegressionNet, {"zero": zero, "precision": "bf16-true"}, regression_dataset, GLOBAL_BATCH, steps,
                     CLIP, collect=("losses", "params", "memory"))
    return result


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_true_fp32_masters_sharded(pools, zero):
    """bf16 weights with fp32 masters: 16 B/param divided by dp as the stage says."""
    results = pools.get(2).run(_bf16_true_job, zero, 10)
    full_params = sum(p.numel() for p in RegressionNet().parameters())
    for r in results:
        mem = r["memory"]
        if zero < 3:
            assert mem.bytes_per_param == BytesPerParam(param=2, grad=2, optimizer=12)
            assert mem.params == 2 * full_params  # bf16 model weights, replicated
            # fp32 master (4) + Adam (8) per parameter, divided by dp from stage 1 on
            expected_optimizer = 12 * full_params / (2 if zero >= 1 else 1)
        else:
            assert mem.bytes_per_param.param == 4  # FSDP2 keeps fp32 shards: they are the masters
            assert mem.params <= 1.05 * 4 * full_params / 2
            expected_optimizer = 8 * full_params / 2
        assert mem.optimizer == pytest.approx(expected_optimizer, rel=0.05)
    _bf16_losses[zero] = mean_over_dp([r["losses"] for r in results], [[0, 1]])
    # The loss falls, and all stages agree with each other to bf16 accuracy.
    assert _bf16_losses[zero][-1] < _bf16_losses[zero][0]
    if 0 in _bf16_losses and zero != 0:
        # bf16 has 8 bits of mantissa; stages reduce in different orders, so agree only to ~1e-2.
        assert_losses_close(_bf16_losses[zero], _bf16_losses[0], rtol=3e-2)


_bf16_losses: dict[int, list[float]] = {}


def _adamw_nanogpt() -> NanoGPT:
    return NanoGPT(optimizer="adamw", lr=0.02)  # AdamW: every weight moves on the first steps


@pytest.mark.slow
def test_zero3_bf16_true_with_selective_recomputation_trains_as_without(pools):
    """FSDP2 casts a unit's inputs to its compute dtype in a forward pre-hook that runs before the composable
    checkpoint's (FSDP2 prepends it), so outside the selective-recomputation region, but again inside it when
    backward recomputes the block: torch's selective checkpoint then met ops its forward never recorded and
    raised ("profiler._record_function_enter_new.default encountered during backward but not found in storage";
    found by the dry run of torchtitan's 8B FSDP layout, issue 23). Recomputation changes no number: ZeRO-3 in
    bf16-true with each selective mode trains exactly as without recomputation."""
    runs = {}
    for mode in (None, "selective", "selective_op"):
        kwargs = {"zero": 3, "precision": "bf16-true", "activation_checkpointing": mode}
        results = pools.get(2).run(fit_job, _adamw_nanogpt, kwargs, token_dataset, GLOBAL_BATCH, 3)
        runs[mode] = (mean_over_dp([r["losses"] for r in results], [[0, 1]]), results[0]["params"])
    losses, params = runs[None]
    assert losses[-1] < losses[0]
    # And like one device in bf16-true (its own rounding: no fp32 masters there, so to bf16's ~1e-2).
    one_device = fit_reference(_adamw_nanogpt, token_dataset, GLOBAL_BATCH, 3, {"precision": "bf16-true"})
    assert_losses_close(losses, one_device["losses"], rtol=2e-2)
    for mode in ("selective", "selective_op"):
        assert runs[mode][0] == losses, mode  # the same bf16 arithmetic, recomputed
        for name, value in params.items():
            assert torch.equal(runs[mode][1][name], value), (mode, name)


class _InjectInfOnRankZero(Callback):
    """After the backward of step 3, poison one element of rank 0's reduced gradient shard only.

    `on_after_backward` runs inside the closure, after ZeRO reduced the gradients and before
    the loss scaler checks them, so only rank 0 can see this inf.
    """

    done = False

    def on_after_backward(self, trainer, pl_module):
        # Once only: a skipped step does not advance `global_step`.
        if trainer.global_step == 3 and dist.get_rank() == 0 and not self.done:
            self.done = True
            for group in trainer.optimizers[0].param_groups:
                for q in group["params"]:
                    if q.grad is not None and q.grad.numel():
                        g = q.grad._local_tensor if hasattr(q.grad, "_local_tensor") else q.grad
                        g.view(-1)[0] = float("inf")
                        return


def _fp16_job(zero: int, inject: bool) -> dict:
    from lightning_para import ParaStrategy

    from tests.parity import full_parameters

    strategy = ParaStrategy(zero=zero, precision="16-mixed")
    L.seed_everything(0, verbose=False)
    module = RegressionNet()
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=6, callbacks=[_InjectInfOnRankZero()] if inject else [],
                        use_distributed_sampler=False, **trainer_kwargs(**CLIP))
    trainer.fit(module, datamodule=ShardedData(regression_dataset, 8))
    precision = strategy.precision_plugin
    # Each rank's own view of the full weights (ZeRO-1/2 all-gather after every step).
    local_view = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in module.named_parameters()}
    return {"scale": precision.scale, "skipped": precision.skipped_steps, "params": local_view,
            "full": full_parameters(module)}


@pytest.mark.parametrize("zero", [1, 2])
def test_fp16_loss_scale_agrees_across_ranks(pools, zero):
    """An inf seen by one rank only makes every rank skip the step and lower the scale."""
    baseline = pools.get(2).run(_fp16_job, zero, False)
    results = pools.get(2).run(_fp16_job, zero, True)
    # fp16 at the initial scale 2**16 may overflow by itself in early steps; the injected inf
    # adds exactly one more skip, on both ranks, and halves the scale once more on both.
    skipped = baseline[0]["skipped"] + 1
    assert [r["skipped"] for r in baseline] == [baseline[0]["skipped"]] * 2
    assert [r["skipped"] for r in results] == [skipped, skipped]
    assert results[0]["scale"] == results[1]["scale"] == baseline[0]["scale"] / 2
    for name in results[0]["params"]:
        torch.testing.assert_close(results[0]["params"][name], results[1]["params"][name], rtol=0, atol=0)
        assert torch.isfinite(results[0]["params"][name]).all()


def test_bf16_mixed_close_to_fp32(pools):
    results = pools.get(2).run(fit_job, RegressionNet, {"zero": 2, "precision": "bf16-mixed"}, regression_dataset,
                               GLOBAL_BATCH, STEPS, CLIP)
    losses = mean_over_dp([r["losses"] for r in results], [[0, 1]])
    # Autocast runs matmuls in bf16 (8-bit mantissa): per-step losses agree with fp32 to ~1e-2.
    assert_losses_close(losses, reference()["losses"], rtol=5e-2)


# ----------------------------------------------------------------------------- evaluation loops
def _evaluate_job(zero: int) -> dict:
    from lightning_para import ParaStrategy

    L.seed_everything(0, verbose=False)
    module = RegressionNet()
    trainer = L.Trainer(devices=2, strategy=ParaStrategy(zero=zero), max_steps=5, use_distributed_sampler=False,
                        limit_val_batches=4, limit_test_batches=4, limit_predict_batches=2, **trainer_kwargs(**CLIP))
    data = ShardedData(regression_dataset, 8)
    trainer.fit(module, datamodule=data)
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    test = trainer.test(module, datamodule=data, verbose=False)[0]["test_loss"]
    predictions = trainer.predict(module, datamodule=data)
    return {"val": val, "test": test, "pred_shapes": [tuple(p.shape) for p in predictions]}


@pytest.mark.parametrize("zero", [1, 3])
def test_validate_test_predict(pools, zero):
    results = pools.get(2).run(_evaluate_job, zero)
    # The single-device model after the same 5 steps, evaluated on the same 4 batches of 16.
    L.seed_everything(0, verbose=False)
    ref = fit_reference(RegressionNet, regression_dataset, GLOBAL_BATCH, 5, CLIP)
    module = RegressionNet()
    module.load_state_dict(ref["params"])
    data = regression_dataset()
    with torch.no_grad():
        x, y = data.tensors
        val = torch.stack([torch.nn.functional.mse_loss(module(x[i:i + 16]), y[i:i + 16]) for i in range(0, 64, 16)])
    # sync_dist averages each batch's loss over the two dp ranks; Lightning then averages the batches.
    assert results[0]["val"] == pytest.approx(val.mean().item(), rel=1e-5)
    assert results[0]["test"] == pytest.approx(val.mean().item(), rel=1e-5)
    assert results[0]["pred_shapes"] == [(8, 16), (8, 16)]


# ----------------------------------------------------------------------------- bad input
def _bad_layout_job(kwargs: dict) -> None:
    from lightning_para import ParaStrategy

    trainer = L.Trainer(devices=2, strategy=ParaStrategy(**kwargs), max_steps=1, **trainer_kwargs())
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, 8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 4}, r"pp=1 x tp=4"),
        ({"dp": 3}, r"pp=1 x dp=3 x tp=1 = 3 do not match the world size 2"),
        ({"dp": 2, "ep": 4}, r"`ep=4` must divide `dp=2`"),
        ({"pp": 2, "tp": 2}, r"pp=2 x tp=2"),
    ],
)
def test_bad_layouts_fail_fast_on_every_rank(pools, kwargs, message):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_bad_layout_job, kwargs, timeout=60, keep_alive_on_error=True)
    assert set(info.value.errors) == {0, 1} and not info.value.pending
    for traceback_text in info.value.errors.values():
        assert "ValueError" in traceback_text
        assert __import__("re").search(message, traceback_text), traceback_text


# ----------------------------------------------------------------------------- 4 processes
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_parity_four_processes_with_accumulation(pools, zero):
    overrides = {"accumulate_grad_batches": 2}
    results = pools.get(4).run(
        fit_job, RegressionNet, {"zero": zero}, regression_dataset, GLOBAL_BATCH, STEPS, {**CLIP, **overrides}
    )
    check_parity(results, reference(**overrides), 4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_per_rank_four_processes(pools, zero):
    check_memory(pools.get(4).run(_memory_job, zero), zero, dp=4)




def _failed_schedule_job() -> dict:
    """The ZeRO-2 engine driven as the pipeline runner drives it under "reduce_each_microbatch", on a 2-rank dp
    mesh: a schedule that fails after one microbatch's reduction leaves nothing behind, and the next one's summed
    shards are exactly the mean of its own microbatches' gradients."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_para.parallel.data.zero import ZeroDataParallel

    torch.manual_seed(0)  # the same weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)  # before the engine hooks `model`'s parameters
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    engine = ZeroDataParallel([(n, p, mesh) for n, p in model.named_parameters()], 2, bucket_size_mb=1e-4,
                              part_of=lambda p: 0)
    rank = dist.get_rank()
    data = [torch.full((2, 4), float(rank + 1 + i)) for i in range(2)]

    def microbatch(x: torch.Tensor) -> None:
        model(x).square().sum().backward()
        engine.reduce_part(0)

    try:
        with engine.reduce_each_microbatch():
            microbatch(data[0])
            raise RuntimeError("the schedule failed")
    except RuntimeError:
        pass
    left = [b for b in engine.buckets if b.pending is not None or b.launched or b.ready]
    with engine.reduce_each_microbatch():
        for x in data:
            microbatch(x)
    shards = {s.name: engine.buckets[s.bucket].pending[s.offset : s.offset + s.shard_numel].clone() for s in engine.slots}
    engine.commit_pending()
    # One device: the sum over both microbatches of the mean over the two ranks' samples.
    expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
    for i in range(2):
        for r in range(dist.get_world_size()):
            reference.zero_grad(set_to_none=True)
            reference(torch.full((2, 4), float(r + 1 + i))).square().sum().backward()
            for name, p in reference.named_parameters():
                expected[name] += p.grad / dist.get_world_size()
    local = {s.name: expected[s.name].reshape(-1)[s.start_row * s.row_numel : s.end_row * s.row_numel] for s in engine.slots}
    return {"left": len(left), "errors": {n: float((shards[n] - local[n]).abs().max()) for n in shards},
            "committed": {s.name: float((s.master.grad.reshape(-1) - local[s.name]).abs().max()) for s in engine.slots}}


def test_reduce_each_microbatch_recovers_from_a_failed_schedule(pools):
    for r in pools.get(2).run(_failed_schedule_job):
        assert r["left"] == 0
        assert max(r["errors"].values()) < 1e-5 and max(r["committed"].values()) < 1e-5, r


def _stage0_views_job() -> dict:
    """ZeRO-0 driven directly: two backwards without ``zero_grad`` between them (DDP adds the second step's
    averaged gradients to the first's). The reduced bucket itself becomes ``.grad`` (one storage, no copy back),
    and the second backward accumulates into it."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_para.parallel.data.zero import ZeroDataParallel

    torch.manual_seed(0)  # the same weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1.0, 1.0)  # sharp: a wrong row or a lost accumulation shows
    reference = copy.deepcopy(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    engine = ZeroDataParallel([(n, p, mesh) for n, p in model.named_parameters()], 0)
    for i in range(2):
        model(torch.full((2, 4), float(rank + 1 + i))).square().sum().backward()
    for i in range(2):
        for r in range(world):
            (reference(torch.full((2, 4), float(r + 1 + i))).square().sum() / world).backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    errors = [float((p.grad - q.grad).abs().max() / q.grad.abs().max()) for p, q in zip(model.parameters(), reference.parameters())]
    return {"storages": len(storages), "buckets": len(engine.buckets), "error": max(errors)}


def test_zero0_gradients_are_the_reduced_bucket(pools):
    for r in pools.get(2).run(_stage0_views_job):
        assert r["storages"] == r["buckets"] == 1, r
        assert r["error"] < 1e-6, r
