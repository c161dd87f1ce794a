"""Hybrid sharded data parallel (``dp_replicate x dp_shard``): parity, bytes per rank, bytes per dimension.

Four gloo processes as ``dp_replicate=2 x dp_shard=2``: ranks {0, 1} and {2, 3} each shard the
ZeRO state (one "node" each), ranks {0, 2} and {1, 3} are replicas. The GPT recipe trains 10
steps with clipping and must match one device (fp32, 1e-5 relative per-step loss); memory and
traffic are counted independently of the library (``tests/comm_counter.py``, storage bytes).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch.distributed as dist

from tests.comm_counter import batches_counter, nccl_reduce_scatter_path
from tests.distributed.test_context_parallel_training import (
    CLIP,
    GLOBAL_BATCH,
    STEPS,
    check_every_rank,
    gpt,
    planned_comm_bytes,
    reference,
)
from tests.parity import (
    ShardedData,
    assert_losses_close,
    fit_job,
    fit_reference,
    held_bytes,
    mean_over_dp,
    trainer_kwargs,
)
from tests.tp_models import token_dataset

HSDP = {"dp_replicate": 2, "dp_shard": 2}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_parity(pools, zero):
    results = pools.get(4).run(fit_job, gpt, {**HSDP, "zero": zero}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check_every_rank(results, reference(**CLIP), [[0], [1], [2], [3]])


def test_hsdp_with_context_parallel_parity(pools):
    """dp_replicate=2 x cp=2 (dp_shard=1): ZeRO shards over the cp ranks, replicas all-reduce the shards."""
    kwargs = {"dp_replicate": 2, "cp": 2, "zero": 2}
    results = pools.get(4).run(fit_job, gpt, kwargs, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check_every_rank(results, reference(**CLIP), [[0, 1], [2, 3]])  # rank = replica * cp + cp_rank


@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_with_expert_parallel_parity(pools, zero):
    """ep=2 inside dp_shard=2: experts sharded over ep, their state over edp x replicated over dp_replicate."""
    from tests.distributed.test_expert_parallel import MODEL, check_parity, moe_fit_job

    clip = {"gradient_clip_val": 0.5}
    results = pools.get(4).run(moe_fit_job, MODEL, {**HSDP, "ep": 2, "zero": zero}, overrides=clip)
    check_parity(results, MODEL, tuple(clip.items()))


# ----------------------------------------------------------------------------- bytes per rank
def _hsdp_bytes_job(strategy_kwargs: dict) -> dict:
    from lightning_para import ParaStrategy

    step = batches_counter(2)  # one whole training step, ZeRO's gather included
    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = gpt_constant_lr()  # the recipe's AdamW (two fp32 states), not gpt()'s SGD (one)
    psi = sum(p.numel() for p in module.parameters()) * 4  # fp32 bytes of the whole model
    dp = strategy.config.resolve_dp(dist.get_world_size())
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3, callbacks=[step],
                        use_distributed_sampler=False, **trainer_kwargs(**CLIP))
    trainer.fit(module, datamodule=ShardedData(token_dataset, GLOBAL_BATCH // dp))
    dims = strategy.parallel_dims
    names = {dims.group(name).group_name: name for name in ("dp_shard", "dp_replicate")}
    traffic: dict = {}
    for kind, nbytes, group in step.counter.calls:
        key = (names.get(group, "other"), kind)
        traffic[key] = traffic.get(key, 0) + nbytes

    # ZeRO-3 gathers these once per step, not twice: the embedding (not needed in backward), and
    # the head and the last block (kept gathered after forward).
    kept = sum(p.numel() * 4 for m in (module.embed, module.head, module.blocks[-1]) for p in m.parameters())
    return {"psi": psi, "traffic": traffic, **held_bytes(module, trainer.optimizers[0]),
            "breakdown": strategy.memory_breakdown(), "kept_gathered": kept}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_bytes_per_rank_and_across_replicas(pools, zero):
    """ZeRO formula with N = dp_shard; 2 psi / dp_shard bytes per step cross dp_replicate, parameters never."""
    dp_shard = HSDP["dp_shard"]
    # ZeRO-1/2 on NCCL's path (a real reduce-scatter; gloo's is an all-reduce inside): the paper's accounting.
    for r in pools.get(4).run(nccl_reduce_scatter_path, _hsdp_bytes_job, {**HSDP, "zero": zero}):
        psi, traffic, breakdown = r["psi"], r["traffic"], r["breakdown"]
        # --- model states per rank: the ZeRO paper's formula with N = dp_shard (AdamW: 2 fp32 states)
        assert r["optimizer"] == pytest.approx(2 * psi / dp_shard, rel=0.05)
        assert r["params"] == pytest.approx(psi / dp_shard if zero == 3 else psi, rel=0.05)
        if zero >= 2:
            assert r["grads"] <= 1.05 * psi / dp_shard
        for key in ("params", "optimizer"):  # the library's own numbers and formula agree
            assert getattr(breakdown, key) == r[key]
            assert r[key] == pytest.approx(getattr(breakdown.expected, key), rel=0.05)
        assert (breakdown.dp, breakdown.dp_replicate) == (dp_shard, 2)
        # --- traffic: only gradient shards cross the replicate dimension (all-reduce counts 2x)
        across = {kind: b for (dim, kind), b in traffic.items() if dim == "dp_replicate"}
        assert set(across) == {"all_reduce"}, across
        assert across["all_reduce"] == pytest.approx(2 * psi / dp_shard, rel=0.05)
        within = {kind: b for (dim, kind), b in traffic.items() if dim == "dp_shard"}
        if zero == 3:  # forward and backward gathers, one reduce-scatter (ZeRO paper Sec. 7.2.2): 3 psi,
            # less one gather of what ZeRO-3 keeps gathered for backward (parallel/data/fsdp.py)
            assert within["all_gather"] == pytest.approx(2 * psi - r["kept_gathered"], rel=0.01)
        else:  # reduce-scatter, then the updated shards all-gathered: 2 psi
            assert within["all_gather"] == pytest.approx(psi, rel=0.05)
        assert within["reduce_scatter"] == pytest.approx(psi, rel=0.05)
        # The planner's model of the same layout: shard-group ("dp") and replicate-group bytes.
        planned = planned_comm_bytes(4, GLOBAL_BATCH // 4, dp=4, dp_replicate=2, zero=zero)
        assert across["all_reduce"] == pytest.approx(planned["dp_replicate"], rel=0.05)
        assert sum(within.values()) == pytest.approx(planned["dp"], rel=0.05)


# ----------------------------------------------------------------------------- profiler labels
@pytest.mark.parametrize(
    "strategy_kwargs, dims",
    # cp x tp: ring K/V under cp, gradient averaging over the cp ranks under dp_shard_cp (ZeRO's group).
    [({"cp": 2, "tp": 2}, {"cp", "tp", "dp_shard_cp"}), ({**HSDP, "zero": 1}, {"dp_shard", "dp_replicate"})],
    ids=["cp2-tp2", "hsdp-zero1"],
)
def test_profiler_labels_traffic_per_new_dimension(pools, strategy_kwargs, dims):
    """comm/cp/... and comm/dp_replicate/..., comm/dp_shard/...: every byte attributed, equal to the counter's."""
    from tests.distributed.test_profiling_comm import comm_job

    for result in pools.get(4).run(comm_job, strategy_kwargs):
        tracer, counter = result["tracer"], result["counter"]
        by_kind: dict[str, float] = {}
        seen = set()
        for key, entry in tracer.items():
            dim, kind = key.split("/")
            seen.add(dim)
            by_kind[kind] = by_kind.get(kind, 0) + entry["bytes"]
        # "world": gradient clipping's one-float norm and the `train_loss` logging's sync_dist. When
        # dp_replicate x dp_shard spans the world, the default group *is* the flattened "dp" group:
        # then "dp" may carry those scalars, and nothing else.
        if "dp" in seen and "dp" not in dims:
            assert tracer["dp/all_reduce"]["bytes"] < 1024 and not any(k.startswith("dp/") and k != "dp/all_reduce" for k in tracer), tracer
            seen.discard("dp")
        assert dims <= seen <= dims | {"world"}, seen
        assert by_kind == {k: float(v) for k, v in counter.items()}


# ----------------------------------------------------------------------------- checkpoints move between layouts
def gpt_constant_lr():
    """The recipe with a constant learning rate: a run cut at step 5 and resumed equals one run of 10."""
    from lightning_para.recipes.gpt import GPT

    return GPT(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, sample_tokens=0, warmup_steps=0,
               min_lr_ratio=1.0, init_std=0.3)  # sharp: tests/sharpness.py


def test_checkpoint_from_hsdp_resumes_under_cp_and_tp(pools, tmp_path):
    """Saved by dp_replicate=2 x dp_shard=2 (ZeRO-1), resumed by cp=2 x tp=2: the loss curve continues."""
    pool = pools.get(4)
    saved = pool.run(fit_job, gpt_constant_lr, {**HSDP, "zero": 1}, token_dataset, GLOBAL_BATCH, 5, None,
                     ("losses", "saved"), ckpt_dir=str(tmp_path))[0]["saved"]
    resumed = pool.run(fit_job, gpt_constant_lr, {"cp": 2, "tp": 2}, token_dataset, GLOBAL_BATCH, 10, None,
                       ("losses",), resume=saved[-1], model_seed=1)
    ref = fit_reference(gpt_constant_lr, token_dataset, GLOBAL_BATCH, 10)
    assert_losses_close(mean_over_dp([r["losses"] for r in resumed], [[0, 1, 2, 3]]), ref["losses"][5:])
