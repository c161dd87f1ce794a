"""Tensor parallel with sequence parallel: parity, activation memory, communication, checkpoints.

The models (``tests/tp_models.py``) are ordinary LightningModules with nanoGPT names (fused
``c_attn``, tied ``wte``/``lm_head``, learned positions) and Hugging Face names (GQA,
keyword calls, RMSNorm); their plan is found automatically. Every layout is compared with one
process on the same global batch: per-step loss within 1e-5 relative, final parameters
(gathered) within 1e-5. Tests run 2-process layouts first, then 4-process ones, so each pool
is spawned once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_para import consolidate_checkpoint
from tests.comm_counter import CollectiveCounter, batches_counter
from tests.harness import WorkerError
from tests.parity import (
    ShardedData,
    assert_losses_close,
    assert_params_close,
    fit_job,
    fit_reference,
    full_parameters,
    mean_over_dp,
    trainer_kwargs,
)
from tests.tp_models import (
    Block,
    LlamaLike,
    NanoGPT,
    NanoGPTThreeHeads,
    NanoGPTWithMoE,
    NanoGPTWithGate,
    odd_length_dataset,
    token_dataset,
)

GLOBAL_BATCH = 8
STEPS = 10
# Small enough to be active on every step (the gradient norm is ~1-3), so clipping parity
# shows the norm is reduced over tp (and dp) exactly once per distinct gradient element.
CLIP = {"gradient_clip_val": 0.1}

_references: dict[Any, dict] = {}
_uninterrupted: dict[int, list[dict]] = {}


def reference(model=NanoGPT, steps: int = STEPS, **overrides) -> dict:
    key = (model, steps, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = fit_reference(model, token_dataset, GLOBAL_BATCH, steps, overrides)
    return _references[key]


def check_parity(results: list[dict], ref: dict, dp: int = 1) -> None:
    world = len(results)
    # ranks of one tp group hold the same data; the first rank of each dp replica is enough
    losses = mean_over_dp([r["losses"] for r in results], [list(range(0, world, world // dp))])
    assert_losses_close(losses, ref["losses"])
    assert_params_close(results[0]["params"], ref["params"])


def _sharded_by_tp(name: str) -> bool:
    """NanoGPT parameters split over tp (the others are replicated), written out by hand."""
    return name.endswith(("wte.weight", "c_attn.weight", "c_proj.weight", "c_fc.weight", "c_fc.bias"))


def _expected_param_bytes(tp: int, dp_shards: int = 1) -> float:
    model = NanoGPT()
    return sum(p.numel() * 4 / (tp if _sharded_by_tp(n) else 1) / dp_shards for n, p in model.named_parameters())


# ============================================================================ 2 processes
def test_tp2_parity_nanogpt_names_and_memory_breakdown(pools):
    results = pools.get(2).run(
        fit_job, NanoGPT, {"tp": 2}, token_dataset, GLOBAL_BATCH, STEPS, None, ("losses", "params", "memory")
    )
    check_parity(results, reference())
    memory = results[0]["memory"]
    assert memory.params == _expected_param_bytes(tp=2)
    assert memory.params < 0.6 * _expected_param_bytes(tp=1)


def _size_one_dp_job() -> dict:
    """tp=2 over the whole world, so dp=1: count every collective of a few steps, by group."""
    from lightning_para import ParaStrategy

    strategy, count = ParaStrategy(tp=2), batches_counter(1, 3)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=4, callbacks=[count],
                        use_distributed_sampler=False, **trainer_kwargs(**CLIP))
    trainer.fit(NanoGPT(), datamodule=ShardedData(token_dataset, GLOBAL_BATCH))
    dims = strategy.parallel_dims
    return {
        "groups": [group for _, _, group in count.counter.calls],
        "dp_group": dims.group("dp").group_name,
        "tp_group": dims.group("tp").group_name,
        "buckets": len(strategy.parallel_model.data_parallel.engine.buckets),
    }


def test_size_one_data_parallel_issues_no_collective(pools):
    """A dimension of size 1 costs nothing: with dp=1 ZeRO keeps no bucket and no collective runs
    on the data-parallel group; tensor parallelism's own collectives still run on tp."""
    for result in pools.get(2).run(_size_one_dp_job):
        assert result["buckets"] == 0
        assert result["dp_group"] not in result["groups"], result["groups"]
        assert result["tp_group"] in result["groups"]


def test_tp2_sequence_parallel_parity_with_clipping(pools):
    results = pools.get(2).run(
        fit_job, NanoGPT, {"tp": 2, "sequence_parallel": True}, token_dataset, GLOBAL_BATCH, STEPS, CLIP
    )
    check_parity(results, reference(**CLIP))


def test_tp2_sequence_parallel_parity_hf_names_gqa_accumulation(pools):
    """HF names, grouped-query attention, keyword calls, RMSNorm; partial norm gradients accumulate."""
    accumulate = {"accumulate_grad_batches": 2}
    results = pools.get(2).run(
        fit_job, LlamaLike, {"tp": 2, "sequence_parallel": True}, token_dataset, GLOBAL_BATCH, STEPS, accumulate
    )
    check_parity(results, reference(LlamaLike, **accumulate))


def test_tp2_sequence_parallel_parity_with_moe_layer(pools):
    """An MoE layer runs whole on every tp rank: gathered along the sequence, then re-sliced."""
    results = pools.get(2).run(
        fit_job, NanoGPTWithMoE, {"tp": 2, "sequence_parallel": True}, token_dataset, GLOBAL_BATCH, STEPS
    )
    check_parity(results, reference(NanoGPTWithMoE))


# The automatic plan of NanoGPT, written as patterns (passed as `ParaStrategy(tp_plan=...)`).
NANOGPT_PLAN = {
    "transformer.wte": "vocab_parallel", "transformer.wpe": "sequence_slice", "lm_head": "lm_head",
    "transformer.h.*.attn": "attention", "transformer.h.*.attn.c_attn": "fused_qkv",
    "transformer.h.*.mlp": "mlp", "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.*.c_proj": "rowwise",
    "**.ln_*": "norm",
}


@pytest.mark.parametrize("mode, sequence_parallel", [("full", False), ("selective", True), ("selective_op", True)])
def test_tp2_activation_recomputation_parity(pools, mode, sequence_parallel):
    kwargs = {"tp": 2, "sequence_parallel": sequence_parallel, "activation_checkpointing": mode}
    if mode == "full":
        kwargs["tp_plan"] = NANOGPT_PLAN  # and the plan through the strategy argument
    results = pools.get(2).run(fit_job, NanoGPT, kwargs, token_dataset, GLOBAL_BATCH, STEPS)
    check_parity(results, reference())


# ----------------------------------------------------------------------------- bf16-true
def _adamw_gpt() -> NanoGPT:
    # AdamW moves every weight by ~lr on its first steps: above bf16's spacing, so a weight whose
    # gradient never reached the optimizer is seen unchanged.
    return NanoGPT(optimizer="adamw", lr=0.02)


@pytest.mark.slow
def test_bf16_true_trains_tp_sp_and_zero_like_one_device(pools):
    """Issue 24 (bf16-true hooks): the cast to bf16 must not drop gradient hooks. A cast after tensor
    parallelism swapped the DTensor parameters' tensors, so the sequence-parallel norms' gradients
    stayed Partial and ZeRO's hooks on tp shards never fired. tp2+SP (ZeRO's fp32 masters on tp
    shards) and ZeRO-1 over dp=2 train like Lightning's single-device bf16-true run."""
    steps, bf16 = 2, {"precision": "bf16-true"}
    ref = fit_reference(_adamw_gpt, token_dataset, GLOBAL_BATCH, steps, bf16)
    L.seed_everything(0, verbose=False)
    initial = {n: t.to(torch.bfloat16).float() for n, t in full_parameters(_adamw_gpt()).items()}
    for layout, dp_ranks in (({"tp": 2, "sequence_parallel": True}, [[0]]), ({"zero": 1}, [[0, 1]])):
        results = pools.get(2).run(fit_job, _adamw_gpt, {**layout, **bf16}, token_dataset, GLOBAL_BATCH, steps)
        losses = mean_over_dp([r["losses"] for r in results], dp_ranks)
        assert all(torch.isfinite(torch.tensor(losses))), (layout, losses)
        # bf16 has 8 bits of mantissa, and the reference steps bf16 weights without fp32 masters.
        assert_losses_close(losses, ref["losses"], rtol=2e-2)
        params = results[0]["params"]
        changed = {name: (params[name] != before).float().mean().item() for name, before in initial.items()}
        print(f"bf16-true {layout}: losses {losses} vs one device {ref['losses']}; least changed "
              f"{min(changed.values()):.0%} of a parameter's elements")
        for name, fraction in changed.items():
            assert fraction > 0.5, f"{layout}: {name} barely moved ({fraction:.0%} of its elements changed)"


# ----------------------------------------------------------------------------- one block
B, S, H, A = 2, 32, 64, 4  # batch, sequence, hidden, heads (Megatron's b, s, h, a)
PSI = B * S * H * 4  # bytes of one fp32 activation [b, s, h]


class _OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Block(H, A, S)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h[0](x)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _block_job() -> dict:
    """Per layout: bytes saved for backward by one block's forward (activations only, each
    storage once) and the collectives of its forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_para.config import ParallelConfig
    from lightning_para.parallel.activation_checkpoint import apply_activation_checkpointing
    from lightning_para.parallel.tensor import apply_tensor_parallel

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    layouts = {
        "tp1": {}, "tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True},
        "tp2_sp_keep_gathered": {"tp": 2, "sequence_parallel": True, "sp_save_input_shard": False},
        "tp2_sp_full_recompute": {"tp": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
    }
    out: dict[str, Any] = {}
    for name, kwargs in layouts.items():
        torch.manual_seed(0)
        block = _OneBlock()
        if kwargs:
            config = ParallelConfig(**kwargs)
            apply_tensor_parallel(
                block, mesh, sequence_parallel=config.sequence_parallel, loss_parallel=config.loss_parallel,
                keep_sequence_shard=config.sp_save_input_shard and config.activation_checkpointing is None,
            )
            apply_activation_checkpointing(block, config.activation_checkpointing)
        torch.manual_seed(1)
        x = torch.randn(B, S, H)
        if kwargs.get("sequence_parallel"):
            x = x[:, rank * S // 2 : (rank + 1) * S // 2].clone()  # its own storage: bytes count exactly
        x.requires_grad_()
        params = {_local(p).untyped_storage().data_ptr() for p in block.parameters()}
        seen: set[int] = set()
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen and storage.data_ptr() not in params:
                seen.add(storage.data_ptr())
                saved[0] += storage.nbytes()
            return t

        with CollectiveCounter() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x)
        with CollectiveCounter() as backward:
            y.sum().backward()
        norm_bytes = sum(_local(p).numel() * 4 for n, p in block.named_parameters() if ".ln_" in n)
        out[name] = {
            "saved": saved[0], "forward": dict(forward.bytes_by_kind), "backward": dict(backward.bytes_by_kind),
            "calls": len(forward.calls) + len(backward.calls), "norm_bytes": norm_bytes,
        }
    return out


def _megatron_ratio(t: int, sequence_parallel: bool) -> float:
    """Korthikanti et al. 2022, Eq. 1-4: activations per layer relative to no TP."""
    attention = 5 * A * S / H
    base = 34 + attention
    if sequence_parallel:
        return (34 / t + attention / t) / base
    return (10 + 24 / t + attention / t) / base


def test_activation_memory_per_block(pools):
    result = pools.get(2).run(_block_job)[0]
    saved = {name: r["saved"] / result["tp1"]["saved"] for name, r in result.items()}
    # TP splits everything but the LayerNorm/dropout/residual terms (10 sbh of 34): matches Megatron's formula.
    assert saved["tp2"] == pytest.approx(_megatron_ratio(2, False), abs=0.03), saved
    # TP+SP splits those too and saves only the sequence shard of each sublayer input.
    assert saved["tp2_sp"] <= 0.55, saved
    assert saved["tp2_sp"] == pytest.approx(_megatron_ratio(2, True), abs=0.04), saved
    assert saved["tp2"] >= saved["tp2_sp"] + 0.05, saved
    # Keeping the gathered sublayer inputs (torch's plain SequenceParallel) costs 2 x psi/2 more.
    keep = result["tp2_sp_keep_gathered"]["saved"] - result["tp2_sp"]["saved"]
    assert keep == pytest.approx(PSI, rel=0.05), (keep, PSI)
    # Full recomputation keeps only the block input (this rank's sequence shard).
    assert result["tp2_sp_full_recompute"]["saved"] == PSI // 2


def test_communication_per_block(pools):
    result = pools.get(2).run(_block_job)[0]
    tp, sp, sp_plain = result["tp2"], result["tp2_sp"], result["tp2_sp_keep_gathered"]
    assert result["tp1"]["calls"] == 0
    # TP: one all-reduce of [b, s, h] per sublayer, forward and backward (counted 2 psi each).
    assert tp["forward"] == {"all_reduce": 2 * 2 * PSI} and tp["backward"] == {"all_reduce": 2 * 2 * PSI}
    tp_volume = sum(tp["forward"].values()) + sum(tp["backward"].values())
    # TP+SP: each all-reduce becomes an all-gather + a reduce-scatter of the same total volume.
    assert sp_plain["forward"] == {"all_gather": 2 * PSI, "reduce_scatter": 2 * PSI}
    sp_plain_volume = sum(sp_plain["forward"].values()) + sp_plain["backward"]["all_gather"] + sp_plain["backward"]["reduce_scatter"]
    assert sp_plain_volume == tp_volume
    # ... plus the all-reduce of the sequence-parallel norm weights' gradients (tiny: 4 x h floats).
    assert sp_plain["backward"]["all_reduce"] == 2 * sp_plain["norm_bytes"]
    # Keeping only the input shard re-gathers it once per sublayer in backward (Megatron-SP, Sec. 4.2.2).
    assert sp["forward"] == sp_plain["forward"]
    assert sp["backward"]["all_gather"] == sp_plain["backward"]["all_gather"] + 2 * PSI
    assert sp["backward"]["reduce_scatter"] == sp_plain["backward"]["reduce_scatter"]


# ----------------------------------------------------------------------------- bad input
def _bad_fit_job(model_factory, strategy_kwargs: dict, dataset_factory=token_dataset) -> None:
    from lightning_para import ParaStrategy

    trainer = L.Trainer(devices=2, strategy=ParaStrategy(**strategy_kwargs), max_steps=2, **trainer_kwargs())
    trainer.fit(model_factory(), datamodule=ShardedData(dataset_factory, GLOBAL_BATCH))


@pytest.mark.parametrize(
    "model, kwargs, dataset, message",
    [
        (NanoGPTWithGate, {"tp": 2}, token_dataset, r"nn.Linear modules are not in the plan[\s\S]*transformer.h.0.gate \(Linear 64 -> 64\)[\s\S]*transformer.h.1.gate"),
        (NanoGPTThreeHeads, {"tp": 2}, token_dataset, r"tp=2 does not divide[\s\S]*attention heads `n_head` of 'transformer.h.0.attn' \(and 1 more\) = 3[\s\S]*Choose tp in \[1\]"),
        (NanoGPT, {"tp": 2, "sequence_parallel": True}, odd_length_dataset, r"splits the sequence over tp=2, but the sequence length is 15 \(the token ids\)"),
    ],
    ids=["unplanned-linear", "heads-divisibility", "sequence-length"],
)
def test_bad_input_fails_on_every_rank_without_hanging(pools, model, kwargs, dataset, message):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_bad_fit_job, model, kwargs, dataset, timeout=60, keep_alive_on_error=True)
    assert set(info.value.errors) == {0, 1} and not info.value.pending
    for text in info.value.errors.values():
        assert "ValueError" in text
        assert __import__("re").search(message, text), text


# ============================================================================ 4 processes
def _uninterrupted_run(pools, zero: int) -> list[dict]:
    if zero not in _uninterrupted:
        _uninterrupted[zero] = pools.get(4).run(
            fit_job, NanoGPT, {"dp": 2, "tp": 2, "zero": zero}, token_dataset, GLOBAL_BATCH, STEPS, CLIP,
            ("losses", "params", "memory"),
        )
    return _uninterrupted[zero]


@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_tp2_parity_with_clipping_and_memory(pools, zero):
    results = _uninterrupted_run(pools, zero)
    check_parity(results, reference(**CLIP), dp=2)
    memory = results[0]["memory"]
    # Parameters: tp shards (ZeRO-3 also shards them over dp); momentum: always over dp too.
    assert memory.params == pytest.approx(_expected_param_bytes(tp=2, dp_shards=2 if zero == 3 else 1), rel=0.01)
    assert memory.optimizer == pytest.approx(_expected_param_bytes(tp=2, dp_shards=2), rel=0.01)
    assert memory.optimizer == pytest.approx(memory.expected.optimizer, rel=0.01)


def _train(strategy_kwargs: dict, max_steps: int, ckpt_dir: str | None = None, resume: str | None = None) -> dict:
    """Inside a worker: train NanoGPT to ``max_steps``, saving at each epoch end or resuming."""
    return fit_job(NanoGPT, strategy_kwargs, token_dataset, GLOBAL_BATCH, max_steps, CLIP, ckpt_dir=ckpt_dir,
                   resume=resume)


def _reference_state(steps: int) -> dict:
    """One device: parameters and SGD momentum buffers after ``steps`` (for consolidation)."""
    L.seed_everything(0, verbose=False)
    module = NanoGPT()
    trainer = L.Trainer(devices=1, max_steps=steps, **trainer_kwargs(**CLIP))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(token_dataset(), batch_size=GLOBAL_BATCH))
    state = trainer.optimizers[0].state_dict()["state"]
    return {"params": full_parameters(module), "momentum": [state[i]["momentum_buffer"] for i in sorted(state)]}


@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_tp2_checkpoint_resume_and_consolidate(pools, tmp_path, zero):
    """Save at the end of epoch 0 (step 5), resume to 10: the same losses and parameters as
    without stopping. The sharded checkpoint consolidates into ordinary full tensors (fused
    q|k|v weights included) equal to one device's parameters and momentum buffers."""
    kwargs = {"dp": 2, "tp": 2, "zero": zero}
    pool = pools.get(4)
    pool.run(_train, kwargs, 5, ckpt_dir=str(tmp_path))
    path = str(tmp_path / "epoch=0-step=5.ckpt")  # a directory of DCP shards

    consolidated = consolidate_checkpoint(Path(path))
    ref = _reference_state(5)
    state = consolidated["state_dict"]
    assert all(type(v) is torch.Tensor for v in state.values())
    assert_params_close({k: v.float() for k, v in state.items() if k in ref["params"]}, ref["params"])
    names = list(ref["params"])
    momentum = [consolidated["optimizer_states"][0]["state"][i]["momentum_buffer"] for i in range(len(names))]
    for name, ours, theirs in zip(names, momentum, ref["momentum"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"momentum of {n}: {m}")

    resumed = pool.run(_train, kwargs, STEPS, resume=path)
    full = _uninterrupted_run(pools, zero)
    assert_losses_close(resumed[0]["losses"], full[0]["losses"][5:], rtol=1e-6)
    assert_params_close(resumed[0]["params"], full[0]["params"], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- a GPU's optimizer defaults
def _fit_with_foreach_default(*args: Any) -> dict:
    """`fit_job` with torch's optimizers deciding as on a GPU: `foreach=None` (the default) picks the multi-tensor
    step when every parameter is on a device with foreach kernels (CUDA; here CPU is made one)."""
    from torch.optim import optimizer as optim_base

    devices = optim_base._get_foreach_kernels_supported_devices
    optim_base._get_foreach_kernels_supported_devices = lambda: ["cpu", "cuda"]
    try:
        return fit_job(*args)
    finally:  # the pool's later jobs decide as on CPU again
        optim_base._get_foreach_kernels_supported_devices = devices


def test_tp2_without_sequence_parallelism_steps_adamw_as_on_a_gpu(pools):
    """Without sequence parallelism the norms stay plain tensors beside the DTensor projections; on a GPU AdamW's
    default (`foreach=None`), as SGD's, then steps them in one multi-tensor group and raises ("aten._foreach_mul_.Scalar got
    mixed torch.Tensor and DTensor"), at the first step of any tp run without SP. ParaStrategy steps such a group
    one tensor at a time (`foreach=False`); found by the dry run (issue 23), whose AdamW ran the GPU's step."""
    results = pools.get(2).run(_fit_with_foreach_default, NanoGPT, {"tp": 2}, token_dataset, GLOBAL_BATCH, STEPS)
    check_parity(results, reference())  # SGD with momentum (its multi-tensor step raised the same way)
