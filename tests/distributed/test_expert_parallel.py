"""Expert parallelism on real gloo groups: parity with one device, memory, communication, skew.

Every layout trains the same small MoE transformer (below, written for this test; it uses
only the public ``lightning_para.moe`` layer) for 10 steps and is compared with a
single-process run on the global batch with the same seed, hence the same experts.
The logged loss includes the MoE aux losses (``aux_loss(self)``), and the aux gradients are
part of every step, so a wrong dispatch, a wrong expert-gradient scale or a wrong aux loss
each shows up in the per-step losses and the final parameters.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import TensorDataset

from lightning_para.moe import MoE, MoEAuxLossScale, MoEBiasUpdate, MoEMetrics, aux_loss
from tests.comm_counter import CollectiveCounter, nccl_reduce_scatter_path
from tests.parity import (
    FP32_RTOL,
    LossRecorder,
    ShardedData,
    assert_losses_close,
    assert_params_close,
    fit_reference,
    full_parameters,
    trainer_kwargs,
)

STEPS = 10
GLOBAL_BATCH = 8
VOCAB, SEQ = 64, 16


# ----------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, **moe: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, 2 * dim, **moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))  # dropped tokens pass through this residual


class ForcedRouterMoE(MoE):
    """Every token's first choice is expert 0 (a large logit bias): the most skewed load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bias = torch.zeros(self.num_experts)
        bias[0] = 30.0
        self.register_buffer("forced_bias", bias, persistent=False)
        router_forward = self.router.forward
        self.router.forward = lambda t: router_forward(t) + self.forced_bias  # type: ignore[method-assign]


class TinyMoETransformer(L.LightningModule):
    def __init__(
        self,
        dim: int = 32,
        heads: int = 4,
        depth: int = 2,
        num_experts: int = 4,
        top_k: int = 2,
        lr: float = 3e-3,
        forced: bool = False,
        init_std: float = 0.3,
        **moe: Any,
    ) -> None:
        super().__init__()
        moe = {"balance_loss_weight": 0.1, "z_loss_weight": 0.01, **moe}
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, heads, num_experts=num_experts, top_k=top_k, **moe) for _ in range(depth))
        if forced:
            for block in self.blocks:
                state = block.moe
                block.moe = ForcedRouterMoE(dim, 2 * dim, num_experts, top_k, **moe)
                block.moe.load_state_dict(state.state_dict())
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.lr = lr
        # Sharp (tests/sharpness.py): PyTorch's default init (std ~0.1) attends and predicts ~uniformly.
        # Expert weights are initialised by the MoE layer itself.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, init_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return loss + aux_loss(self)  # the aux value; its gradient is applied by the MoE layers

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)  # eval forwards record no aux losses

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_pipeline(self):
        """The pipeline contract (pp > 1): layers in order, batch split, task loss. The MoE aux losses
        are not part of it: their gradients flow from each stage's MoE layers, and the pipeline adds
        their values to the reported loss."""
        from lightning_para import PipelineSpec

        return PipelineSpec(
            layers=[self.embed, *self.blocks, self.norm, self.head],
            split_batch=lambda batch: (batch[0], batch[1]),
            loss_fn=lambda logits, targets: F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)),
        )

    def configure_optimizers(self):
        # eps=1e-6, not 1e-8: Adam's first step is lr*g/(|g|+eps); a gradient element that cancels to
        # ~1e-9 (seen: 5 orders below the median) turns fp32 summation-order noise (ep sums tokens
        # per expert in another order) into a 1e-5-relative parameter difference at eps=1e-8.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eps=1e-6)


def token_dataset(n: int = GLOBAL_BATCH * STEPS, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    # A learnable rule (next = (3 * current + 1) mod V, with noise) so the loss moves.
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        nxt = (3 * seq[-1] + 1) % VOCAB
        noise = torch.randint(0, VOCAB, (n, 1), generator=g)
        seq.append(torch.where(torch.rand(n, 1, generator=g) < 0.2, noise, nxt))
    tokens = torch.cat(seq, dim=1)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# ----------------------------------------------------------------------------- worker jobs
class PhaseCounter(Callback):
    """Counts collectives of one training step separately in forward and in backward (+ grad sync)."""

    def __init__(self, step: int = 1) -> None:
        self.step, self.forward, self.backward = step, CollectiveCounter(), CollectiveCounter()
        self._active: Optional[CollectiveCounter] = None

    def _switch(self, counter: Optional[CollectiveCounter]) -> None:
        if self._active is not None:
            self._active.__exit__(None, None, None)
        self._active = counter
        if counter is not None:
            counter.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            self._switch(self.forward)

    def on_before_backward(self, trainer, pl_module, loss):
        if self._active is self.forward:
            self._switch(self.backward)

    def on_after_backward(self, trainer, pl_module):
        if self._active is self.backward:
            self._switch(None)


class LoggedAuxLoss(Callback):
    """``train_aux_loss`` as logged after each step (the pipeline runner logs it under pp > 1)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train_aux_loss")
        if value is not None:
            self.values.append(float(value))


def moe_fit_job(
    model_factory,
    strategy_kwargs: dict[str, Any],
    dataset_factory=token_dataset,
    global_batch: int = GLOBAL_BATCH,
    max_steps: int = STEPS,
    overrides: Optional[dict[str, Any]] = None,
    count_step: Optional[int] = None,
    metrics: bool = False,
) -> dict[str, Any]:
    from lightning_para import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = model_factory()
    recorder, aux_values = LossRecorder(), LoggedAuxLoss()
    callbacks: list[Callback] = [recorder, aux_values]
    counter = PhaseCounter(count_step) if count_step is not None else None
    if counter is not None:
        callbacks.append(counter)
    if metrics:
        callbacks.append(MoEMetrics(per_expert=True))
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps, callbacks=callbacks,
        use_distributed_sampler=False, **trainer_kwargs(**{"limit_val_batches": 0, **(overrides or {})}),
    )
    dims = strategy.parallel_dims
    trainer.fit(module, datamodule=ShardedData(dataset_factory, global_batch // dims.dp))
    params = full_parameters(module)
    is_expert = strategy.parallel_model.expert_predicate()
    losses = recorder.losses
    if dims.pp > 1:
        # Under pp the runner returns the LM loss and logs the aux losses apart (`train_aux_loss`, the mean
        # over dp); this model's own training_step (pp=1) returns their sum, which the reference sees.
        losses = [loss + aux for loss, aux in zip(losses, aux_values.values)]
    out: dict[str, Any] = {
        "losses": losses,
        "params": params,  # every rank: under pp each holds only its stage's layers
        "memory": strategy.memory_breakdown(),
        "dp_rank": dims.local_rank("dp"),
        "expert_local_bytes": sum(
            p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
            for p in module.parameters() if is_expert(p)
        ),
        "groups": {name: dims.group(name).group_name for name in ("dp", "edp", "ep")},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("moe/")},
        "ep_rank": dims.local_rank("ep"),
        "biases": expert_biases(module),
        "edp_peers": dist.get_process_group_ranks(dims.group("edp")),
        "expert_meshes": sorted({
            tuple(p.device_mesh.mesh_dim_names) for p in module.parameters()
            if is_expert(p) and hasattr(p, "device_mesh")
        }),
    }
    if counter is not None:
        out["forward_calls"] = counter.forward.calls
        out["backward_calls"] = counter.backward.calls
    return out


def expert_biases(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")}


def mean_loss(results: list[dict[str, Any]]) -> list[float]:
    """Mean over the distinct data-parallel ranks (tp/pp peers of one dp rank report the same loss)."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    steps = len(next(iter(by_dp.values())))
    return [sum(l[i] for l in by_dp.values()) / len(by_dp) for i in range(steps)]


@functools.lru_cache(maxsize=None)
def reference(factory, steps: int = STEPS, overrides: tuple = ()) -> dict[str, Any]:
    return fit_reference(factory, token_dataset, GLOBAL_BATCH, steps, dict(overrides))


def merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["params"])
    return merged


# Parameters after 10 AdamW steps of the sharp model: on one device, a 1e-7 relative perturbation of the
# initial weights (a reordered fp32 sum) moves some parameters by up to 2.1e-5 absolute
# (tests.sharpness.perturbation_param_drift; AdamW's m / sqrt(v) turns tiny gradient differences into O(lr)
# updates). The blunt model met atol 1e-6 only by luck; 3e-5 is 0.1% of the ~3e-2 the weights travel. The
# losses (1e-5) are unchanged.
PARAM_ATOL = 3e-5


def check_parity(results, factory, overrides: tuple = ()) -> None:
    ref = reference(factory, STEPS, overrides)
    assert_losses_close(mean_loss(results), ref["losses"])
    assert_params_close(merged_params(results), ref["params"], atol=PARAM_ATOL)


def expert_bytes(params: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for n, t in params.items() if ".experts." in n)


MODEL = functools.partial(TinyMoETransformer)
MODEL_K1_GELU_SHARED = functools.partial(TinyMoETransformer, top_k=1, activation="gelu", shared_hidden_dim=16)


# ----------------------------------------------------------------------------- tests: 2 processes
def test_ep2_parity_memory_and_communication(pools):
    """ep=2 on 2 ranks (dp=2, edp=1): parity, expert bytes = full/ep, 2+2 all-to-all per layer."""
    results = pools.get(2).run(moe_fit_job, MODEL, {"ep": 2}, count_step=1)
    check_parity(results, MODEL)
    full = expert_bytes(results[0]["params"])
    for r in results:
        assert abs(r["expert_local_bytes"] - full / 2) <= 0.01 * full / 2
        mem = r["memory"]
        assert mem.expert.params == r["expert_local_bytes"]
        assert mem.num_expert_params * 4 == full / 2
    depth = 2
    for r in results:
        fwd = [c for c in r["forward_calls"] if c[0] == "all_to_all"]
        bwd = [c for c in r["backward_calls"] if c[0] == "all_to_all"]
        # Forward per layer: split sizes (E int64 counts), dispatch, combine. Backward: 2.
        assert len(fwd) == 3 * depth and len(bwd) == 2 * depth, (fwd, bwd)
        assert [c[1] for c in fwd[::3]] == [4 * 8] * depth  # the split-size exchange: E=4 int64
        assert all(c[2] == r["groups"]["ep"] for c in fwd + bwd)
        # Gradient sync: dense over dp; expert gradients only over edp, which has size 1 here: nobody
        # shares them, so no collective runs for them at all (a size-1 dimension costs nothing).
        reductions = [c for c in r["backward_calls"] if c[0] in ("all_reduce", "reduce_scatter")]
        assert {c[2] for c in reductions} == {r["groups"]["dp"]}
        dense_bytes = 4 * sum(t.numel() for n, t in results[0]["params"].items() if ".experts." not in n)
        assert sum(c[1] for c in reductions) == 2 * dense_bytes  # all-reduce counts 2x its bytes


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_ep2_zero_stages_with_clipping(pools, zero):
    """ZeRO 1/2/3 with experts, k=1 GELU experts plus a shared expert, global-norm clipping."""
    overrides = (("gradient_clip_val", 0.5),)
    results = pools.get(2).run(moe_fit_job, MODEL_K1_GELU_SHARED, {"ep": 2, "zero": zero}, overrides=dict(overrides))
    check_parity(results, MODEL_K1_GELU_SHARED, overrides)


def test_bad_layouts_raise_on_every_rank(pools):
    """Raised in `setup` by every rank alike (no rank is left waiting in a collective)."""
    from tests.harness import WorkerError

    pool = pools.get(2)
    three = functools.partial(TinyMoETransformer, num_experts=3, top_k=1)
    with pytest.raises(WorkerError, match=r"`ep=2` must divide num_experts=3") as info:
        pool.run(moe_fit_job, three, {"ep": 2}, max_steps=1, keep_alive_on_error=True)
    assert len(info.value.errors) == 2 and not info.value.pending
    with pytest.raises(WorkerError, match="no `lightning_para.moe.MoE` module") as info:
        pool.run(moe_fit_job, _DenseOnly, {"ep": 2}, max_steps=1, keep_alive_on_error=True)
    assert len(info.value.errors) == 2 and not info.value.pending


class _DenseOnly(TinyMoETransformer):
    def __init__(self) -> None:
        super().__init__(depth=1)
        self.blocks[0].moe = nn.Identity()


def test_ep2_gradient_accumulation(pools):
    """accumulate_grad_batches=2: ParaStrategy scales the attached aux gradient by 1/2 like the loss
    (the one-device reference gets the same from the MoEAuxLossScale callback)."""
    overrides = {"accumulate_grad_batches": 2}
    results = pools.get(2).run(moe_fit_job, MODEL, {"ep": 2, "zero": 1}, max_steps=5, overrides=overrides)
    ref = fit_reference(MODEL, token_dataset, GLOBAL_BATCH, 5, overrides, callbacks=(MoEAuxLossScale(),))
    assert len(ref["losses"]) == 10  # micro-steps
    assert_losses_close(mean_loss(results), ref["losses"])
    assert_params_close(merged_params(results), ref["params"])


def evaluate_job(strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    from lightning_para import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = MODEL()
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, use_distributed_sampler=False, **trainer_kwargs())
    data = ShardedData(token_dataset, GLOBAL_BATCH // strategy.parallel_dims.dp)
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    predictions = torch.cat(trainer.predict(module, datamodule=data))
    return {"val_loss": val, "predictions": predictions, "dp_rank": strategy.parallel_dims.local_rank("dp")}


def test_ep2_validate_and_predict(pools):
    """Forward-only passes (no_grad, eval) dispatch the same way: validation loss and predictions match."""
    results = pools.get(2).run(evaluate_job, {"ep": 2})
    L.seed_everything(0, verbose=False)
    module = MODEL()
    from torch.utils.data import DataLoader

    trainer = L.Trainer(devices=1, **trainer_kwargs())
    loader = DataLoader(token_dataset(), batch_size=GLOBAL_BATCH)
    expected = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    assert results[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    predictions = torch.cat(trainer.predict(module, loader))
    for r in results:  # DistributedSampler(shuffle=False) gives dp rank r the samples r, r+2, r+4, ...
        assert torch.equal(r["predictions"], predictions[r["dp_rank"] :: 2])


@pytest.mark.parametrize(
    "precision, rtol",
    [
        # Against the fp32 reference. CPU autocast turns few ops of this model to fp16: with the sharp model
        # (init 0.3) that is 4.3e-5 at step 0 (the forward alone) and 6.2e-5 over 4 steps (4.6e-6 at the old
        # blunt init). The point is the aux gradient: without the loss scale S on it (unscaled by 1/S with
        # the rest) the sharp model's loss differs by 1.0e-3 (measured on one device with the aux-gradient
        # scale set to 1/65536); 2e-4 lies between the two.
        ("16-mixed", 2e-4),
        # bf16 weights and bf16 tokens through the all-to-all (8-bit mantissa, ~4e-3 per op): measured 7e-3.
        ("bf16-true", 2e-2),
    ],
)
def test_ep2_mixed_precision(pools, precision, rtol):
    results = pools.get(2).run(moe_fit_job, MODEL, {"ep": 2, "zero": 1, "precision": precision}, max_steps=4)
    assert_losses_close(mean_loss(results), reference(MODEL, 4)["losses"], rtol=rtol)


@pytest.mark.parametrize("zero", [1, 3])
def test_ep2_dp4_parity_and_expert_data_parallel_groups(pools, zero):
    """dp=4, ep=2 (edp=2): experts replicated over the 2 ranks of their edp group, clipping over all."""
    overrides = (("gradient_clip_val", 0.5),)
    results = pools.get(4).run(  # NCCL's reduce-scatter path, whose bytes the checks below count
        nccl_reduce_scatter_path, moe_fit_job, MODEL, {"dp": 4, "ep": 2, "zero": zero}, overrides=dict(overrides),
        count_step=1,
    )
    check_parity(results, MODEL, overrides)
    by_rank = {i: r for i, r in enumerate(results)}
    for i, r in by_rank.items():
        # The edp group is exactly the ranks holding this rank's experts (same ep coordinate).
        assert len(r["edp_peers"]) == 2 and all(by_rank[p]["ep_rank"] == r["ep_rank"] for p in r["edp_peers"])
        expected_mesh = [("edp", "ep")] if zero == 3 else [("ep",)]
        assert r["expert_meshes"] == expected_mesh
        reductions = [c for c in r["backward_calls"] if c[0] in ("all_reduce", "reduce_scatter")]
        assert {c[2] for c in reductions} <= {r["groups"]["dp"], r["groups"]["edp"]}
        expert_volume = sum(c[1] for c in reductions if c[2] == r["groups"]["edp"])
        if zero == 1:  # reduce-scatter of the expert gradients (counts its input: the local expert bytes)
            assert expert_volume == r["expert_local_bytes"]
        else:  # FSDP2 reduce-scatters the unsharded expert gradients over edp
            assert expert_volume == r["expert_local_bytes"] * 2  # all-gathered (E/ep) x reduce-scattered
        mem = r["memory"]
        # (ZeRO-1 grads are left out: ZeroDataParallel frees the full gradients after the
        # reduce-scatter, so after a step it holds psi/N, below the formula's psi.)
        for key in ("params", "optimizer") + (("grads",) if zero >= 2 else ()):
            assert getattr(mem.expert, key) == pytest.approx(getattr(mem.expected_expert, key), rel=0.01), key


# ----------------------------------------------------------------------------- skewed routing
FORCED_K1 = functools.partial(TinyMoETransformer, top_k=1, forced=True)
FORCED_K1_CAPACITY = functools.partial(TinyMoETransformer, top_k=1, forced=True, capacity_factor=1.0)


def test_forced_router_sends_every_token_to_one_expert(pools):
    """All tokens pick expert 0: ep rank 1 receives no tokens at all; ZeRO-2 must not hang."""
    results = pools.get(2).run(moe_fit_job, FORCED_K1, {"ep": 2, "zero": 2}, metrics=True)
    check_parity(results, FORCED_K1)
    for r in results:
        tokens = [r["metrics"][f"moe/blocks.0.moe/tokens_expert_{i}"] for i in range(4)]
        assert tokens == [GLOBAL_BATCH // 2 * SEQ, 0, 0, 0]


def test_forced_router_with_capacity_drops_and_reports(pools):
    """Capacity mode: each rank keeps ceil(T/E * 1.0) tokens of expert 0; the rest are dropped and reported.

    Capacity is per routing group (this rank's micro-batch), so the reference is the same layout
    without expert parallelism (dp=2, ep=1), which drops exactly the same tokens.
    """
    pool = pools.get(2)
    with_ep = pool.run(moe_fit_job, FORCED_K1_CAPACITY, {"ep": 2}, metrics=True)
    without_ep = pool.run(moe_fit_job, FORCED_K1_CAPACITY, {"ep": 1}, metrics=True)
    assert_losses_close(mean_loss(with_ep), mean_loss(without_ep))
    assert_params_close(merged_params(with_ep), merged_params(without_ep))
    tokens = GLOBAL_BATCH // 2 * SEQ
    capacity = math.ceil(tokens / 4 * 1.0 * 1)
    for r in with_ep:
        for layer in ("blocks.0.moe", "blocks.1.moe"):
            assert r["metrics"][f"moe/{layer}/dropped_fraction"] == pytest.approx((tokens - capacity) / tokens)
    assert all(math.isfinite(x) for x in with_ep[0]["losses"])


# ----------------------------------------------------------------------------- checkpoints
CKPT_DATA = functools.partial(token_dataset, GLOBAL_BATCH * 5)  # 5 steps per epoch: the resume crosses an epoch
# With the selection bias on: it is state (a buffer), so a resume that lost it would route differently.
CKPT_MODEL = functools.partial(TinyMoETransformer, bias_update_rate=0.1)


def checkpoint_job(strategy_kwargs: dict[str, Any], directory: str, resume_from: Optional[str]) -> dict[str, Any]:
    """Train 10 steps saving a checkpoint at step 5, or resume from ``resume_from`` and train steps 6-10."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_para import ParaStrategy

    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = CKPT_MODEL()
    recorder = LossRecorder()
    callbacks: list[Callback] = [recorder]
    if resume_from is None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1))
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=10, callbacks=callbacks,
        use_distributed_sampler=False,
        **trainer_kwargs(enable_checkpointing=resume_from is None, limit_val_batches=0),
    )
    data = ShardedData(CKPT_DATA, GLOBAL_BATCH // strategy.parallel_dims.dp)
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    params = full_parameters(module)
    return {
        "losses": recorder.losses,
        "dp_rank": strategy.parallel_dims.local_rank("dp"),
        "params": params if dist.get_rank() == 0 else None,
        "biases": expert_biases(module),
    }


def test_checkpoint_save_resume_and_consolidate_experts(pools, tmp_path):
    """ep=2 ZeRO-1 saves expert shards and the selection biases at step 5; resuming (same layout, and ep=1 ZeRO-3)
    continues the run exactly, biases included; consolidation gives the full [E, ...] expert stacks and their
    optimizer state."""
    from lightning_para import consolidate_checkpoint

    pool = pools.get(2)
    saved = pool.run(checkpoint_job, {"ep": 2, "zero": 1}, str(tmp_path), None)
    path = str(tmp_path / "epoch=0-step=5.ckpt")
    resumed = pool.run(checkpoint_job, {"ep": 2, "zero": 1}, str(tmp_path), path)
    resharded = pool.run(checkpoint_job, {"ep": 1, "zero": 3}, str(tmp_path), path)
    keep, keep5 = KeepBiases(), KeepBiases()
    ref = fit_reference(CKPT_MODEL, CKPT_DATA, GLOBAL_BATCH, 10, callbacks=(MoEBiasUpdate(), keep))
    assert_losses_close(mean_loss(saved), ref["losses"])
    for run in (resumed, resharded):
        assert_losses_close(mean_loss(run), ref["losses"][5:])
        assert_params_close(run[0]["params"], ref["params"])
        assert all(torch.equal(r["biases"][n], b) for r in run for n, b in keep.biases.items())

    # Consolidation: full expert stacks equal to a run stopped at step 5 (the reference's first 5 steps).
    at_step5 = fit_reference(CKPT_MODEL, CKPT_DATA, GLOBAL_BATCH, 5, callbacks=(MoEBiasUpdate(), keep5))["params"]
    full = consolidate_checkpoint(path)
    assert all(b.abs().sum() > 0 and torch.equal(full["state_dict"][n], b) for n, b in keep5.biases.items())
    for name in ("blocks.0.moe.experts.w1", "blocks.1.moe.experts.w2"):
        assert full["state_dict"][name].shape[0] == 4  # all experts, from both ep ranks' shards
        torch.testing.assert_close(full["state_dict"][name], at_step5[name], rtol=1e-5, atol=1e-6)
    names = [n for n, _ in CKPT_MODEL().named_parameters()]
    exp_avg = full["optimizer_states"][0]["state"][names.index("blocks.0.moe.experts.w1")]["exp_avg"]
    assert tuple(exp_avg.shape) == tuple(at_step5["blocks.0.moe.experts.w1"].shape)
    assert exp_avg[:2].abs().sum() > 0 and exp_avg[2:].abs().sum() > 0  # both ep ranks' halves written


# ----------------------------------------------------------------------------- with pipeline parallel
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_ep2_with_pp2(pools, schedule):
    """ep=2 x pp=2 (dp=2, 2 microbatches): one MoE block per stage; each stage's ep peers exchange tokens
    per microbatch; the pipeline logs every stage's aux losses (summed in its loss all-reduce) as
    ``train_aux_loss`` beside the LM loss it returns."""
    overrides = (("gradient_clip_val", 0.5),)
    results = pools.get(4).run(
        moe_fit_job, MODEL, {"ep": 2, "pp": 2, "schedule": schedule}, overrides=dict(overrides), count_step=1
    )
    check_parity(results, MODEL, overrides)
    for r in results:
        # The schedule runs forward and backward inside training_step: 1 MoE layer per stage and
        # 2 microbatches, each 3 all-to-all forward (split sizes, dispatch, combine) and 2 backward.
        a2a = [c for c in r["forward_calls"] if c[0] == "all_to_all"]
        assert len(a2a) == 2 * (3 + 2) and all(c[2] == r["groups"]["ep"] for c in a2a)
        assert r["expert_local_bytes"] == expert_bytes(merged_params(results)) // 2 // 2  # its stage's experts / ep


# ----------------------------------------------------------------------------- with tensor parallel
@pytest.mark.parametrize("sequence_parallel, zero", [(False, 0), (True, 0), (False, 3)])
def test_ep2_with_tp2(pools, sequence_parallel, zero):
    """ep=2 x tp=2 (dp=2), TP's automatic plan: attention, embedding and head tensor-parallel; the MoE layer
    runs whole on each tp rank (on the full sequence under SP) and exchanges tokens with the same tp rank
    of its ep peer. ZeRO-3: FSDP2 shards the TP DTensors over dp and the expert stacks over edp."""
    overrides = (("gradient_clip_val", 0.5),)
    strategy = {"ep": 2, "tp": 2, "sequence_parallel": sequence_parallel, "zero": zero}
    results = pools.get(4).run(moe_fit_job, MODEL, strategy, overrides=dict(overrides), count_step=1)
    check_parity(results, MODEL, overrides)
    for r in results:
        fwd = [c for c in r["forward_calls"] if c[0] == "all_to_all"]
        bwd = [c for c in r["backward_calls"] if c[0] == "all_to_all"]
        assert len(fwd) == 3 * 2 and len(bwd) == 2 * 2
        assert all(c[2] == r["groups"]["ep"] for c in fwd + bwd)


# ----------------------------------------------------------------------------- auxiliary-loss-free balancing
# A rate far above DeepSeek-V3's 1e-3, so that the bias changes the routing within a few steps.
BIASED = functools.partial(TinyMoETransformer, depth=1, top_k=1, bias_update_rate=0.1)
BIAS_STEPS = 5  # odd: each bias entry sums 5 steps of +-rate, so it is not back at 0


class KeepBiases(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.biases = expert_biases(pl_module)


def bias_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    keep = KeepBiases()
    ref = fit_reference(BIASED, token_dataset, GLOBAL_BATCH, BIAS_STEPS, callbacks=(MoEBiasUpdate(), keep))
    return ref["losses"], keep.biases


def planted_bias_job(plant: Optional[str], strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``moe_fit_job`` of the biased model, with one bug planted in this rank's library code."""
    import lightning_para.core.engine as engine
    import lightning_para.moe.layer as layer
    from lightning_para.moe.routing import select_experts

    original = engine.update_expert_bias
    plants = {  # the bias from this rank's load only; the bias also in the combine weights
        "local_load": (engine, "update_expert_bias", lambda modules, groups: original(modules, ())),
        "biased_gates": (layer, "select_experts", lambda probs, bias, k: (
            (probs + bias).gather(-1, select_experts(probs, bias, k)[1]), select_experts(probs, bias, k)[1])),
    }
    owner, name, replacement = plants[plant] if plant else (None, None, None)
    kept = getattr(owner, name) if owner else None
    if owner:
        setattr(owner, name, replacement)
    try:
        return moe_fit_job(BIASED, strategy_kwargs, max_steps=BIAS_STEPS)
    finally:
        if owner:
            setattr(owner, name, kept)


def check_bias_parity(results: list[dict[str, Any]], losses: list[float], biases: dict[str, torch.Tensor]) -> None:
    assert_losses_close(mean_loss(results), losses)
    assert any(b.abs().sum() > 0 for b in biases.values())
    for r in results:  # the same update on every rank, equal to one device's (exactly: counts are integers)
        assert r["biases"].keys() == biases.keys()
        for name, bias in biases.items():
            assert torch.equal(r["biases"][name], bias), (name, r["biases"][name], bias)


def test_ep2_expert_bias_parity_and_planted_bugs(pools):
    """ep=2 with the selection bias on: per-step losses match one device and the bias is identical on every
    rank and to one device's; planting either bug moves some step's loss by far more than the tolerance."""
    losses, biases = bias_reference()
    pool = pools.get(2)
    check_bias_parity(pool.run(planted_bias_job, None, {"ep": 2}), losses, biases)
    for plant in ("local_load", "biased_gates"):
        planted = mean_loss(pool.run(planted_bias_job, plant, {"ep": 2}))
        worst = max(abs(a - e) / abs(e) for a, e in zip(planted, losses))
        assert worst > 10 * FP32_RTOL, (plant, worst)


def test_dp4_ep2_expert_bias_parity(pools):
    """dp=4 x ep=2 (edp=2) with ZeRO-1: the load is summed over all four ranks, not one ep group."""
    losses, biases = bias_reference()
    check_bias_parity(pools.get(4).run(planted_bias_job, None, {"dp": 4, "ep": 2, "zero": 1}), losses, biases)
