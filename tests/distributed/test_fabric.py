"""Fabric's ParaStrategy: a LitGPT-style loop (``tests/fabric_loop.py``) trains to one device's losses.

Each layout runs ``fabric.init_module(empty_init=True)`` -> ``fabric.setup`` -> ``fabric.setup_optimizers``
-> ``fabric.setup_dataloaders`` -> 2 accumulation micro-steps under ``fabric.no_backward_sync`` ->
``fabric.backward`` -> ``fabric.clip_gradients`` -> ``optimizer.step()`` on real gloo ranks, and its
per-micro-step loss (the mean over dp ranks) must equal the same loop on one device with the global
batch within ``FP32_RTOL`` (1e-5 relative: fp32 reductions in another order). LitGPT's ``GPT`` (GQA;
under tp and pp through ``lightning_para.integrations.litgpt``) and this repo's GPT recipe run every
acceptance layout; the recipe also the other families. Resume: ``fabric.save`` at step 4 and
``fabric.load`` into a model initialised with another seed continue with the uninterrupted run's
losses (1e-6 into the same layout, 1e-5 into another).
"""

from __future__ import annotations

import importlib.util

import pytest

import torch

from tests.fabric_loop import (
    fabric_direct_call_job,
    fabric_idle_rank_job,
    fabric_job,
    fabric_load_params_job,
    fabric_reference,
    fabric_reliability_job,
    mean_over_dp,
    trainer_job,
)
from tests.harness import WorkerError
from tests.parity import FP32_RTOL, assert_float8_close, assert_losses_close

GLOBAL_BATCH = 8
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
needs_litgpt = pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (pip install lightning-para[litgpt])")

_REFERENCES: dict[tuple[str, int], list[float]] = {}


def reference(model: str, steps: int = 4) -> list[float]:
    key = (model, steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = fabric_reference(model, GLOBAL_BATCH, steps=steps)
    return _REFERENCES[key]


LAYOUTS_2 = [
    pytest.param("recipe", {"tp": 2}, id="recipe-tp2"),
    pytest.param("recipe", {"tp": 2, "sequence_parallel": True}, id="recipe-tp2-sp"),
    pytest.param("recipe", {"tp": 2, "zero": 3}, id="recipe-tp2-zero3"),
    pytest.param("recipe", {"tp": 2, "loss_parallel": True}, id="recipe-tp2-loss-parallel"),
    pytest.param("recipe", {"tp": 2, "sequence_parallel": True, "loss_parallel": True}, id="recipe-tp2-sp-loss-parallel"),
    pytest.param("recipe", {"pp": 2}, id="recipe-pp2"),
    pytest.param("recipe", {"dp": 2, "zero": 0}, id="recipe-zero0"),
    pytest.param("recipe", {"dp": 2, "zero": 2}, id="recipe-zero2"),
    pytest.param("recipe", {"dp": 2, "zero": 2, "zero_accumulation": "reduce_each_step"}, id="recipe-zero2-reduce-each-step"),
    pytest.param("recipe", {"dp": 2, "zero": 3}, id="recipe-zero3"),
    pytest.param("litgpt", {"dp": 2, "zero": 3}, id="litgpt-zero3", marks=needs_litgpt),
    pytest.param("litgpt", {"dp": 2, "zero": 1}, id="litgpt-zero1", marks=needs_litgpt),
    pytest.param("litgpt", {"tp": 2}, id="litgpt-tp2", marks=needs_litgpt),
    pytest.param("litgpt", {"tp": 2, "sequence_parallel": True}, id="litgpt-tp2-sp", marks=needs_litgpt),
    pytest.param("litgpt_pp", {"pp": 2}, id="litgpt-pp2", marks=needs_litgpt),
    pytest.param("litgpt", {"cp": 2}, id="litgpt-cp2-ring", marks=needs_litgpt),
    pytest.param("litgpt", {"cp": 2, "cp_method": "all_to_all"}, id="litgpt-cp2-all-to-all", marks=needs_litgpt),
    pytest.param("recipe", {"cp": 2}, id="recipe-cp2"),
]


@pytest.mark.parametrize("model,layout", LAYOUTS_2)
def test_fabric_loop_matches_one_device(pools, model, layout):
    results = pools.get(2).run(fabric_job, model, layout, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference(model), rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- the other families under Fabric
def test_compile_tp2(pools):
    """``compile`` (aot_eager on CPU, as tests/distributed/test_compile.py) compiles each block after TP."""
    results = pools.get(2).run(fabric_job, "recipe", {"tp": 2, "compile": {"backend": "aot_eager"}}, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference("recipe"), rtol=FP32_RTOL)


def test_expert_parallel_ep2(pools):
    """The MoE recipe under dp2 x ep2 (experts sharded over ep, their data parallelism over edp), with the
    auxiliary-loss-free selection bias on: ParaStrategy updates it from the global load after each step."""
    results = pools.get(2).run(fabric_job, "moe_biased", {"dp": 2, "ep": 2}, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference("moe_biased"), rtol=FP32_RTOL)


def test_fp8_tp2_sp_matches_torchao_one_device(pools):
    """``fp8="tensorwise"`` under tp2 + SP: the activations' amax is global, so torchao's own float8 run on the
    global batch is the same math (``tests/distributed/test_fp8.py``) up to float8 rounding flips, which
    ``assert_float8_close`` measures against float8's own distance from the fp32 run (two SGD steps: AdamW
    amplified a flip to 1.3e-3 two micro-steps later, against fp32's 1e-5)."""
    pytest.importorskip("torchao")
    layout = {"tp": 2, "sequence_parallel": True, "fp8": "tensorwise"}
    results = pools.get(2).run(fabric_job, "recipe", layout, GLOBAL_BATCH, steps=2, sgd=True)
    float8, fp32 = (fabric_reference("recipe", GLOBAL_BATCH, steps=2, fp8=fp8, sgd=True) for fp8 in (True, False))
    assert_float8_close(mean_over_dp(results), results[0]["params"], float8, fp32)


@pytest.mark.parametrize("layout", [{"tp": 2, "sequence_parallel": True}, {"dp": 2, "zero": 1}], ids=["tp2-sp", "zero1"])
def test_joint_setup_repoints_the_optimizer(pools, layout):
    """``fabric.setup(model, optimizer)`` with an optimizer made from the meta model: re-pointed by name at the
    parallel parameters, the same losses."""
    results = pools.get(2).run(fabric_job, "recipe", layout, GLOBAL_BATCH, joint_setup=True)
    assert_losses_close(mean_over_dp(results), reference("recipe"), rtol=FP32_RTOL)


def test_pipeline_eval_step_is_the_forward_loss(pools):
    """``pipeline_eval_step`` after training: the same value on both pipeline ranks, and finite."""
    results = pools.get(2).run(fabric_job, "recipe", {"pp": 2}, GLOBAL_BATCH, steps=1)
    assert results[0]["eval_loss"] == results[1]["eval_loss"] and 0 < results[0]["eval_loss"] < 20
    assert all("pipeline_step(model, batch)" in r["direct_call"] for r in results)


def test_planted_bug_sampler_per_process_fails_parity(pools):
    """The check can fail: a sampler per process instead of per dp rank (what `distributed_sampler_kwargs`
    prevents) feeds the two tensor-parallel ranks different samples."""
    results = pools.get(2).run(fabric_job, "recipe", {"tp": 2}, GLOBAL_BATCH, planted_sampler_per_process=True)
    with pytest.raises(AssertionError):
        assert_losses_close(mean_over_dp(results), reference("recipe"), rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- resume
RESUME_STEPS = 6  # save at step 4, two more steps after it


def _resume(pools, tmp_path, model, saved_layout, loaded_layout, world, loaded_world=None):
    path = str(tmp_path / "ckpt")
    full = pools.get(world).run(
        fabric_job, model, saved_layout, GLOBAL_BATCH, steps=RESUME_STEPS, save_at=4, save_path=path
    )
    uninterrupted = mean_over_dp(full)[4 * 2:]
    resumed = pools.get(loaded_world or world).run(
        fabric_job, model, loaded_layout, GLOBAL_BATCH, steps=RESUME_STEPS, resume=path, resume_step=4, seed=123
    )
    return mean_over_dp(resumed), uninterrupted


def test_resume_same_layout_zero3(pools, tmp_path):
    resumed, uninterrupted = _resume(pools, tmp_path, "recipe", {"dp": 2, "zero": 3}, {"dp": 2, "zero": 3}, 2)
    assert_losses_close(resumed, uninterrupted, rtol=1e-6)


def test_resume_into_another_layout_zero3_to_tp2(pools, tmp_path):
    resumed, uninterrupted = _resume(pools, tmp_path, "recipe", {"dp": 2, "zero": 3}, {"tp": 2, "sequence_parallel": True}, 2)
    assert_losses_close(resumed, uninterrupted, rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- 4 processes (sorted last: one pool restart)
def test_zz_hybrid_sharding(pools):
    """HSDP: ZeRO-3 over dp_shard=2, replicated over dp_replicate=2."""
    results = pools.get(4).run(fabric_job, "recipe", {"dp_replicate": 2, "dp_shard": 2, "zero": 3}, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference("recipe"), rtol=FP32_RTOL)


@pytest.mark.parametrize("model,layout", [
    pytest.param("litgpt", {"dp": 2, "cp": 2, "zero": 3}, id="litgpt-dp2-cp2-zero3", marks=needs_litgpt),
    pytest.param("litgpt", {"cp": 2, "tp": 2, "sequence_parallel": True}, id="litgpt-cp2-tp2-sp", marks=needs_litgpt),
    pytest.param("recipe", {"cp": 2, "pp": 2}, id="recipe-cp2-pp2"),
])
def test_zz_fabric_loop_with_cp_4_ranks_matches_one_device(pools, model, layout):
    results = pools.get(4).run(fabric_job, model, layout, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference(model), rtol=FP32_RTOL)


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("model", ["recipe", pytest.param("litgpt", marks=needs_litgpt)])
def test_zz_fabric_loop_dp2_tp2_matches_one_device(pools, zero, model):
    results = pools.get(4).run(fabric_job, model, {"dp": 2, "tp": 2, "zero": zero}, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(results), reference(model), rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- Fabric and the Trainer
def test_pipeline_step_losses_equal_the_trainers_pp2(pools):
    """``strategy.pipeline_step`` under Fabric and the Trainer's pp2 (accumulation 2, clipping): the same losses."""
    fabric = pools.get(2).run(fabric_job, "recipe", {"pp": 2}, GLOBAL_BATCH)
    trainer = pools.get(2).run(trainer_job, {"pp": 2}, GLOBAL_BATCH)
    # Lightning reports each micro-step's loss divided by accumulate_grad_batches (its closure's loss); the loop, whole.
    assert_losses_close(mean_over_dp(fabric), [2 * loss for loss in mean_over_dp(trainer)], rtol=FP32_RTOL)


def test_run_step_cp2_losses_equal_the_trainers(pools):
    """``strategy.run_step`` under Fabric and the Trainer's cp2 (the same core step routing): the same losses."""
    fabric = pools.get(2).run(fabric_job, "recipe", {"cp": 2}, GLOBAL_BATCH)
    trainer = pools.get(2).run(trainer_job, {"cp": 2}, GLOBAL_BATCH)
    assert_losses_close(mean_over_dp(fabric), [2 * loss for loss in mean_over_dp(trainer)], rtol=FP32_RTOL)


@needs_litgpt
def test_planted_bug_local_positions_under_cp_fails_parity_and_the_check_names_it(pools):
    """The cp parity can fail: without LitGPT's adapter each chunk's RoPE starts at 0. With ``cp_check=False``
    the losses differ from one device's; with the check on, the first ``run_step`` raises naming positions."""
    results = pools.get(2).run(fabric_job, "litgpt", {"cp": 2, "cp_check": False}, GLOBAL_BATCH, planted_local_positions=True)
    with pytest.raises(AssertionError):
        assert_losses_close(mean_over_dp(results), reference("litgpt"), rtol=FP32_RTOL)
    with pytest.raises(WorkerError, match="positions built from the local length"):
        pools.get(2).run(fabric_job, "litgpt", {"cp": 2}, GLOBAL_BATCH, planted_local_positions=True)


def test_model_called_outside_run_step_under_cp_raises(pools):
    """Under cp a direct call would run the whole sequence on every cp rank: it raises naming ``run_step``."""
    with pytest.raises(WorkerError, match="fabric.strategy.run_step"):
        pools.get(2).run(fabric_direct_call_job, {"cp": 2})


def test_trainer_checkpoint_loads_into_fabric_and_back(pools, tmp_path):
    """A Trainer checkpoint (dp2 ZeRO-2) loads into a Fabric model of another layout (tp2), and a Fabric
    checkpoint (tp2) into a Fabric ZeRO-3 model: the weights are the saved ones, exactly."""
    trained = pools.get(2).run(trainer_job, {"dp": 2, "zero": 2}, GLOBAL_BATCH, ckpt_dir=str(tmp_path / "trainer"))
    saved = trained[0]["params"]
    loaded = pools.get(2).run(fabric_load_params_job, "recipe", {"tp": 2}, str(tmp_path / "trainer" / "last.ckpt"))
    assert saved.keys() == loaded[0]["params"].keys()
    for name, value in saved.items():
        assert torch.equal(value, loaded[0]["params"][name]), name
    assert "global_step" in loaded[0]["rest"]  # the Trainer's own entries come back as Fabric's leftovers


def test_fabric_checkpoint_into_another_fabric_layout(pools, tmp_path):
    path = str(tmp_path / "fabric")
    pools.get(2).run(fabric_job, "recipe", {"tp": 2}, GLOBAL_BATCH, steps=2, save_at=2, save_path=path)
    reference_params = pools.get(2).run(fabric_load_params_job, "recipe", {"tp": 2}, path)[0]["params"]
    resharded = pools.get(2).run(fabric_load_params_job, "recipe", {"dp": 2, "zero": 3}, path)[0]["params"]
    for name, value in reference_params.items():
        assert torch.equal(value, resharded[name]), name


def test_resume_pipeline_same_layout_and_into_zero3(pools, tmp_path):
    """A pp2 checkpoint (each rank saves its stage) resumes under pp2, and reshards into ZeRO-3."""
    resumed, uninterrupted = _resume(pools, tmp_path, "recipe", {"pp": 2}, {"pp": 2}, 2)
    assert_losses_close(resumed, uninterrupted, rtol=1e-6)
    resumed = pools.get(2).run(
        fabric_job, "recipe", {"dp": 2, "zero": 3}, GLOBAL_BATCH, steps=RESUME_STEPS, resume=str(tmp_path / "ckpt"),
        resume_step=4, seed=123,
    )
    assert_losses_close(mean_over_dp(resumed), uninterrupted, rtol=FP32_RTOL)


def test_bf16_true_zero3_fabric_equals_the_trainer(pools):
    """``precision="bf16-true"`` (fp32 masters as FSDP2's shards) under both front ends: the same losses. Fabric
    hands the loop fp32 outputs (as Lightning's half-precision plugins do), so the Trainer's model computes its
    cross-entropy on fp32 logits too (``GPT(loss_fp32=True)``); and ``fabric.init_module`` makes the weights in
    bf16 (the masters are upcast from them), as ``trainer.init_module()`` would."""
    fabric = pools.get(2).run(fabric_job, "recipe", {"dp": 2, "zero": 3, "precision": "bf16-true"}, GLOBAL_BATCH)
    trainer = pools.get(2).run(trainer_job, {"dp": 2, "zero": 3, "precision": "bf16-true"}, GLOBAL_BATCH, loss_fp32=True, init_in_half=True)
    assert_losses_close(mean_over_dp(fabric), [2 * loss for loss in mean_over_dp(trainer)], rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- reliability under Fabric
def test_non_finite_loss_stops_every_rank_and_integrity_reports_a_flipped_replica(pools):
    results = pools.get(2).run(fabric_reliability_job, "nan")
    for rank, result in enumerate(results):
        assert "error" in result and "rank 1" in result["error"] and "step 0" in result["error"], (rank, result)
        assert result["at"] == 1, rank  # every rank stops at the same step
    results = pools.get(2).run(fabric_reliability_job, "flip")
    assert results[0]["reports"] and "c_proj" in " ".join(results[0]["reports"])


def test_trainer_resumes_from_a_fabric_checkpoint(pools, tmp_path):
    """``trainer.fit(ckpt_path=<a Fabric checkpoint>)`` in another layout takes the model and optimizer state (its
    loops start afresh, from the first batch): its losses equal a Fabric run resumed from the same checkpoint on
    the same batches."""
    path = str(tmp_path / "fabric")
    pools.get(2).run(fabric_job, "recipe", {"dp": 2, "zero": 3}, GLOBAL_BATCH, steps=2, save_at=2, save_path=path)
    fabric = pools.get(2).run(
        fabric_job, "recipe", {"tp": 2}, GLOBAL_BATCH, steps=4, resume=path, resume_step=2, seed=5, data_from_start=True
    )
    trainer = pools.get(2).run(trainer_job, {"tp": 2}, GLOBAL_BATCH, steps=2, resume=path)
    assert_losses_close(mean_over_dp(fabric), [2 * loss for loss in mean_over_dp(trainer)], rtol=FP32_RTOL)


# ----------------------------------------------------------------------------- SIGTERM (on_sigterm)
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step_and_resumes_exactly(pools, tmp_path):
    """A real SIGTERM to rank 1 after step 2: every rank sees ``strategy.preempted`` after the same later step
    (the step guard's agreement, read a step late), the loop saves there, and a resumed run continues with the
    uninterrupted run's losses (1e-6)."""
    from tests.fabric_loop import fabric_preemption_job

    path = str(tmp_path / "preempted")
    full = pools.get(2).run(fabric_preemption_job, str(tmp_path / "unused"), "checkpoint", steps=7)
    assert all(r["stopped_after"] is None for r in full)
    stopped = pools.get(2).run(fabric_preemption_job, path, "checkpoint", steps=7, signal_after=1)
    after = {r["stopped_after"] for r in stopped}
    assert len(after) == 1 and after.pop() == 4, [r["stopped_after"] for r in stopped]  # signal at 2, agreed read at 4
    resumed = pools.get(2).run(fabric_preemption_job, path, "checkpoint", steps=7, resume=True)
    assert_losses_close(mean_over_dp(stopped) + mean_over_dp(resumed), mean_over_dp(full), rtol=1e-6)


def test_sigterm_with_on_sigterm_exit_raises_exit_code_143_on_every_rank_at_the_same_step(pools, tmp_path):
    from tests.fabric_loop import fabric_preemption_job

    results = pools.get(2).run(fabric_preemption_job, str(tmp_path / "unused"), "exit", steps=7, signal_after=1)
    # Raised inside the fourth optimizer.step() (where the checkpoint run sees `preempted`), before the loop counts it.
    assert [(r["exit_code"], r["stopped_after"]) for r in results] == [(143, 3), (143, 3)]


def test_a_rank_in_its_own_code_is_no_hang_and_no_thread_of_ours_outlives_the_teardown(pools):
    """The watchdog under Fabric (``docs/reliability.md``): a rank idle for 2x ``watchdog_timeout`` between calls,
    while its peer waits in ``fabric.barrier()`` or in a gradient all-reduce, is alive (before, every rank exited with
    code 75). Its thread stops through ``stop()`` (Lightning's test teardown) and on the strategy's teardown. A second
    Fabric marked launched without ``launch()`` works."""
    for rank, threads in enumerate(pools.get(2).run(fabric_idle_rank_job, 3.0)):
        assert threads["during"] == [("lightning-para-watchdog", True, True)], (rank, threads)
        assert threads["after"] == [], (rank, threads)
