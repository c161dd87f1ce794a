"""LitGPT models (``litgpt.Config(...)``, no download) and nanoGPT-style models under every layout.

Each layout trains the same LightningModule (``tests/litgpt_models.py``: ``self.model = GPT(config)``,
sharp std-0.3 weights, next-token cross-entropy, the one-line ``configure_pipeline()``) for 5 steps on
the same global batch as a single-process run, and compares per-step losses at FP32_RTOL = 1e-5
relative (fp32 summation orders only; measured <= 2e-7). Nothing in the modules mentions a layout:
the LitGPT integration (tensor-parallel and context-parallel adapters, ``import lightning_para``)
does the rest. World-2 tests first, then world-4, so each pool starts once.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("litgpt")

import lightning as L  # noqa: E402

from tests import litgpt_models  # noqa: E402
from tests.harness import WorkerError  # noqa: E402
from tests.parity import FP32_RTOL, assert_float8_close, assert_losses_close, fit_job, fit_reference  # noqa: E402
from lightning_para.moe import MoEBiasUpdate  # noqa: E402
from tests.tp_models import make_optimizer, token_dataset  # noqa: E402

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 8
STEPS = 5
_references: dict = {}


def reference(factory) -> list[float]:
    if factory not in _references:
        # MoEBiasUpdate: the selection biases of a balanced MoE model (`moe_biased`) as ParaStrategy updates them.
        _references[factory] = fit_reference(factory, token_dataset, GLOBAL_BATCH, STEPS, callbacks=(MoEBiasUpdate(),))["losses"]
    return _references[factory]


def litgpt_job(factory, strategy_kwargs: dict, planted: bool = False, collect: tuple[str, ...] = ("losses",)) -> dict:
    """Inside a worker: train; ``planted`` swaps the q and k block sizes of the fused-qkv style (a bug that
    must fail parity). Reports the losses and this rank's mesh coordinates."""
    from lightning_para.integrations.litgpt import tensor as litgpt_tensor
    from lightning_para.parallel.tensor.adapters import register_tensor_parallel_adapter
    from lightning_para.parallel.tensor.columns import FusedBlocksColwise

    adapter = litgpt_tensor.ADAPTER
    if planted:
        def swapped_plan(attention):
            plan = adapter.plan(attention)
            q, k, v = plan["qkv"].rows.blocks
            plan["qkv"] = FusedBlocksColwise((k, q, v), unit=attention.config.head_size)
            return plan

        register_tensor_parallel_adapter(type(adapter)(
            name=adapter.name, claims=adapter.claims, plan=swapped_plan, head_counts=adapter.head_counts,
            adapt=adapter.adapt,
        ))
    try:
        modules: list = []

        def remember():
            modules.append(factory())
            return modules[-1]

        result = fit_job(remember, strategy_kwargs, token_dataset, GLOBAL_BATCH, STEPS, collect=collect)
    finally:
        register_tensor_parallel_adapter(adapter)
    dims = modules[0].trainer.strategy.parallel_dims
    result["coords"] = {name: dims.local_rank(name) for name in ("pp", "dp", "tp", "cp")}
    from torch.distributed.tensor import DTensor

    result["expert_shares"] = [  # this rank's share of each stacked expert weight
        p.to_local().numel() / p.numel() for n, p in modules[0].named_parameters()
        if ".mlp.experts." in n and isinstance(p, DTensor) and p.dim() == 3
    ]
    config = getattr(modules[0].model, "config", None)
    result["shared_n_head"] = getattr(config, "n_head", None)  # LitGPT's shared Config stays whole
    return result


def losses_over_dp(results: list[dict]) -> list[float]:
    chosen = {r["coords"]["dp"]: r["losses"] for r in results if r["coords"]["tp"] == 0 and r["coords"]["pp"] == 0}
    return [sum(step) / len(chosen) for step in zip(*chosen.values())]


def run_and_compare(pools, world: int, factory, kwargs: dict) -> list[dict]:
    results = pools.get(world).run(litgpt_job, factory, kwargs)
    assert_losses_close(losses_over_dp(results), reference(factory), rtol=FP32_RTOL)
    n_head = getattr(getattr(factory().model, "config", None), "n_head", None)
    assert all(r["shared_n_head"] == n_head for r in results)
    return results


# ============================================================================ nanoGPT-style models (real code shape)
class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: splits by ``self.n_embd``, views with ``C`` from ``x.size()``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoAttentionOwnSizes(NanoAttention):
    """The same attention reshaping with its own attributes only (``self.n_embd``, ``self.n_head``)."""

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head = self.n_embd // self.n_head
        q, k, v = (t.view(B, T, self.n_head, head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd))


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, attention: type) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = NanoMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, attention: type, vocab: int = 128, block_size: int = 32, n_embd: int = 64, n_head: int = 4, n_layer: int = 2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(NanoBlock(n_embd, n_head, attention) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.3 / math.sqrt(2) if name.endswith("c_proj.weight") else 0.3)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class NanoGPTModule(L.LightningModule):
    def __init__(self, attention: type = NanoAttention) -> None:
        super().__init__()
        self.model = NanoGPT(attention)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), "sgd", litgpt_models.SHARP_LR)


def nanogpt():
    return NanoGPTModule(NanoAttention)


def nanogpt_own_sizes():
    return NanoGPTModule(NanoAttentionOwnSizes)


# ============================================================================ the fused style itself
def _fused_job() -> dict:
    """A fused projection under each block layout, against the whole Linear on one process: this rank's
    output must be its slice of every block; gradients summed over ranks must match."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_para.parallel.tensor.columns import BlockRows, FusedBlocksColwise

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    cases = {
        "gqa-contiguous": (dict(blocks=(32, 16, 16), unit=8), (32, 16, 16)),
        "mha-contiguous": (dict(blocks=(16, 16, 16), unit=8), (16, 16, 16)),
        "gqa-interleaved": (dict(blocks=(16, 8, 8), layout="interleaved", groups=2, unit=8), (16, 8, 8)),
        "planted-swapped": (dict(blocks=(16, 32, 16), unit=8), (32, 16, 16)),
        "planted-missized": (dict(blocks=(40, 12, 12), unit=2), (32, 16, 16)),
    }
    out = {}
    for name, (kwargs, truth) in cases.items():
        torch.manual_seed(0)
        full = nn.Linear(12, sum(truth) if "interleaved" not in name else 2 * sum(truth))
        x = torch.randn(3, 12)
        sharded = nn.Linear(12, full.out_features)
        sharded.load_state_dict(full.state_dict())
        parallelize_module(sharded, mesh, FusedBlocksColwise(**kwargs))
        layout = kwargs.get("layout", "contiguous")
        rows = BlockRows(truth, layout, kwargs.get("groups", 1))
        expected_rows = torch.cat([torch.arange(s, s + n) for s, n in rows.rank_ranges(rank, 2)])
        local = sharded(x)
        local = local.to_local() if isinstance(local, DTensor) else local
        out[name] = (local - full(x)[:, expected_rows]).abs().max().item()
    return out


def test_fused_blocks_style_layouts_and_planted_bugs(pools):
    """Contiguous GQA (unequal blocks), contiguous MHA (equal) and interleaved blocks give every rank its slice
    of each block exactly; swapped or mis-sized blocks (planted bugs) give other rows."""
    result = pools.get(2).run(_fused_job)
    for r in result:
        for name in ("gqa-contiguous", "mha-contiguous", "gqa-interleaved"):
            assert r[name] < 1e-6, (name, r[name])
        assert r["planted-swapped"] > 1e-2 and r["planted-missized"] > 1e-2, r


# ============================================================================ 2 processes
LAYOUTS_2 = {
    "tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2}, "cp2": {"cp": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_litgpt_gqa_two_ranks(pools, name):
    run_and_compare(pools, 2, litgpt_models.gqa, LAYOUTS_2[name])


@pytest.mark.parametrize("kwargs", [{"tp": 2}, {"tp": 2, "sequence_parallel": True}], ids=["tp2", "tp2-sp"])
def test_litgpt_mha_two_ranks(pools, kwargs):
    run_and_compare(pools, 2, litgpt_models.mha, kwargs)


@pytest.mark.parametrize("kwargs", [{"tp": 2, "sequence_parallel": True}, {"cp": 2}], ids=["tp2-sp", "cp2"])
def test_litgpt_neox_shape_two_ranks(pools, kwargs):
    """Pythia / GPT-NeoX shape: parallel residual, LayerNorm, biases (the fused qkv bias), partial rotary."""
    run_and_compare(pools, 2, litgpt_models.neox, kwargs)


def test_litgpt_planted_fused_bug_fails_parity(pools):
    """Swapping the q and k block sizes of the fused qkv style trains, and parity catches it."""
    results = pools.get(2).run(litgpt_job, litgpt_models.gqa, {"tp": 2}, True)
    with pytest.raises(AssertionError, match="per-step loss differs"):
        assert_losses_close(losses_over_dp(results), reference(litgpt_models.gqa), rtol=FP32_RTOL)


def test_nanogpt_global_sizes_fail_in_the_first_step_with_a_named_error(pools):
    """Real nanoGPT attention views with C from x.size() (the global width): under tp=2 its first forward
    raises an error naming the module, what it computed and the fixes, not a bare shape error."""
    with pytest.raises(WorkerError) as caught:
        pools.get(2).run(litgpt_job, nanogpt, {"tp": 2})
    text = str(caught.value)
    assert "GlobalSizeError" in text and "'model.transformer.h.0.attn' (NanoAttention)" in text, text[-3000:]
    assert "is invalid for input of size" in text and "view(B, T, -1)" in text and "tensor_parallel_plan" in text


def test_nanogpt_own_sizes_are_adapted(pools):
    """The same model reshaping with its own `n_head`/`n_embd` (divided per rank by the plan): parity under
    tp=2, with and without SP."""
    run_and_compare(pools, 2, nanogpt_own_sizes, {"tp": 2})
    run_and_compare(pools, 2, nanogpt_own_sizes, {"tp": 2, "sequence_parallel": True})


# ============================================================================ 4 processes
LAYOUTS_4 = {
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero": 3}, "dp2-tp2-zero1": {"dp": 2, "tp": 2, "zero": 1},
    "pp2-tp2": {"pp": 2, "tp": 2}, "cp2-tp2": {"cp": 2, "tp": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_litgpt_gqa_four_ranks(pools, name):
    run_and_compare(pools, 4, litgpt_models.gqa, LAYOUTS_4[name])


# ============================================================================ LLaMAMoE under expert parallelism
def test_litgpt_moe_ep2(pools):
    """ep=2 (= dp=2): each rank keeps 2 of the 4 experts of every LLaMAMoE (stacked fc_1, fc_2, proj); with the
    auxiliary-loss-free selection bias (`balance_experts`), updated from both ranks' load after each step."""
    results = run_and_compare(pools, 2, litgpt_models.moe_biased, {"ep": 2})
    assert all(r["expert_shares"] and all(s == 0.5 for s in r["expert_shares"]) for r in results)


def test_litgpt_moe_dp2_ep2_tp2(pools):
    results = run_and_compare(pools, 4, litgpt_models.moe, {"dp": 2, "ep": 2, "tp": 2})
    assert all(r["expert_shares"] and all(s == 0.5 for s in r["expert_shares"]) for r in results)


# ============================================================================ LitGPT checkpoint folders
def _folder_job(folder: str, out: str, kwargs: dict) -> dict:
    """Load a LitGPT folder into the layout, export it before the first step and after training (live,
    collective), save a ParaStrategy checkpoint; report the in-layout logits of the trained model."""
    import functools

    from lightning_para.integrations.litgpt import export

    modules: list = []

    def build():
        modules.append(litgpt_models.LitGPTFromFolder(folder, export_on_start=f"{out}/start"))
        return modules[-1]

    result = fit_job(functools.partial(build), kwargs, token_dataset, GLOBAL_BATCH, STEPS, collect=("losses", "saved"),
                     ckpt_dir=f"{out}/ckpt")
    module = modules[0]
    export(module, f"{out}/end")
    dims = module.trainer.strategy.parallel_dims
    result["coords"] = {name: dims.local_rank(name) for name in ("pp", "dp", "tp", "cp")}
    result["logits"] = None
    if dims.pp == 1:
        from torch.distributed.tensor import DTensor

        x = token_dataset().x[:2].to(module.device)
        with torch.no_grad():
            logits = module.model(x)
        result["logits"] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).cpu()
    return result


def _litgpt_state(folder) -> dict:
    return torch.load(f"{folder}/lit_model.pth", map_location="cpu", weights_only=True)


def _load_gpt(folder):
    from lightning_para.integrations.litgpt import load_checkpoint

    return load_checkpoint(folder).eval()


@pytest.mark.parametrize("world,kwargs,config", [
    (2, {"tp": 2}, {}),
    (4, {"pp": 2, "tp": 2}, {}),
    (4, {"dp": 2, "ep": 2, "tp": 2, "zero": 3}, dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2,
                                                     moe_intermediate_size=48, n_embd=32)),
], ids=["tp2", "pp2-tp2", "dp2-ep2-tp2-zero3"])
def test_litgpt_folder_round_trip(pools, tmp_path, world, kwargs, config):
    """A LitGPT folder loads into the layout unchanged (exported before the first step: bitwise equal),
    trains as on one device, and exports back -- live or from the ParaStrategy checkpoint, identically --
    to a folder whose logits are the in-layout model's within 1e-5 (relative to the largest logit)."""
    import functools

    from lightning_para.integrations.litgpt import export

    folder = tmp_path / "original"
    litgpt_models.write_litgpt_folder(str(folder), litgpt_models.litgpt_config(**config))
    results = pools.get(world).run(_folder_job, str(folder), str(tmp_path), kwargs)

    original, start = _litgpt_state(folder), _litgpt_state(tmp_path / "start")
    assert original.keys() == start.keys()
    assert all(torch.equal(original[k], start[k]) for k in original), [k for k in original if not torch.equal(original[k], start[k])]

    expected = fit_reference(functools.partial(litgpt_models.LitGPTFromFolder, str(folder)), token_dataset,
                             GLOBAL_BATCH, STEPS)["losses"]
    assert_losses_close(losses_over_dp(results), expected, rtol=FP32_RTOL)

    end = _load_gpt(tmp_path / "end")
    x = token_dataset().x[:2]
    with torch.no_grad():
        exported_logits = end(x)
    if results[0]["logits"] is not None:
        gap = (exported_logits - results[0]["logits"]).abs().max() / results[0]["logits"].abs().max()
        # tp's partial sums and ep's expert outputs add in another order than one device: the fp32 standard
        assert gap <= FP32_RTOL, gap
    export(results[0]["saved"][-1], tmp_path / "from_ckpt")
    from_ckpt, live = _litgpt_state(tmp_path / "from_ckpt"), _litgpt_state(tmp_path / "end")
    assert from_ckpt.keys() == live.keys() == original.keys()
    assert all(torch.equal(from_ckpt[k], live[k]) for k in live)


# ============================================================================ compile and fp8
def test_litgpt_tp2_sp_compiled(pools):
    """compile (per block, aot_eager: the graphs without inductor's C++ build) over tp=2 + SP."""
    run_and_compare(pools, 2, litgpt_models.gqa, {"tp": 2, "sequence_parallel": True, "compile": {"backend": "aot_eager"}})


def litgpt_torchao_fp8():
    """The fp8 reference: torchao's own float8 conversion on one device, the head and the fused qkv in high
    precision (what ParaStrategy(fp8=...) keeps under tp: torchao's float8 styles are column-/row-wise only)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    module = litgpt_models.gqa()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(module, module_filter_fn=lambda m, fqn: "lm_head" not in fqn and "qkv" not in fqn,
                               config=config)
    return module


def test_litgpt_fp8_tp2_sp_matches_torchao_one_device(pools):
    """Float8 rounding flips allowed, measured against float8's own distance from fp32 (``assert_float8_close``)."""
    pytest.importorskip("torchao")
    results = pools.get(2).run(litgpt_job, litgpt_models.gqa, {"tp": 2, "sequence_parallel": True, "fp8": "tensorwise"},
                               collect=("losses", "params"))
    float8, fp32 = (fit_reference(f, token_dataset, GLOBAL_BATCH, STEPS) for f in (litgpt_torchao_fp8, litgpt_models.gqa))
    # The fused qkv's full tensor holds tp=2's rank-major rows (this file's rank-major tests), not one device's.
    params = {n: p for n, p in results[0]["params"].items() if not n.endswith("attn.qkv.weight")}
    assert_float8_close(losses_over_dp(results), params, float8, fp32)


# ============================================================================ the grouped-query qkv rows in checkpoints
# Under tp a grouped-query qkv is stored rank-major (rank 0's q, k, v slices, then rank 1's); every whole-tensor
# form -- one file, consolidation -- holds LitGPT's own rows, and one-device weights load into tp2.
def _whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _gap(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def _one_device_logits(state: dict, config=None) -> torch.Tensor:
    from litgpt.model import GPT

    model = GPT(config if config is not None else litgpt_models.litgpt_config())
    model.load_state_dict(state)
    with torch.no_grad():
        return model(token_dataset().x[:2])


def _rows_trainer_job(kwargs: dict, steps: int, resume: str, out: str, save_full: bool) -> dict:
    """Resume a Trainer run from ``resume`` under ``kwargs`` (a ModelCheckpoint saves sharded at epoch ends);
    ``save_full``: also save one file (``save_distributed_checkpoint=False``) and report the in-layout logits."""
    modules: list = []

    def remember():
        modules.append(litgpt_models.gqa())
        return modules[-1]

    result = fit_job(remember, kwargs, token_dataset, GLOBAL_BATCH, steps, collect=("losses", "saved"),
                     ckpt_dir=f"{out}/ckpt", resume=resume)
    if save_full:
        module = modules[0]
        module.trainer.strategy.save_distributed_checkpoint = False
        module.trainer.save_checkpoint(f"{out}/full.ckpt")
        with torch.no_grad():
            result["logits"] = _whole(module.model(token_dataset().x[:2].to(module.device)))
    return result


def _one_device_resume(ckpt, steps: int) -> list[float]:
    """Lightning's own one-device resume from ``ckpt`` to ``steps``: its losses."""
    from torch.utils.data import DataLoader

    from tests.parity import LossRecorder, trainer_kwargs

    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=[recorder], **trainer_kwargs())
    trainer.fit(litgpt_models.gqa(), DataLoader(token_dataset(), batch_size=GLOBAL_BATCH, shuffle=False), ckpt_path=ckpt)
    return recorder.losses


def test_litgpt_gqa_tp2_trainer_checkpoints_hold_litgpt_rows(pools, tmp_path):
    """One device -> tp2 -> dp2: a one-device checkpoint resumes at tp2 (weights and momentum put in tp2's rows) with
    one device's losses; tp2's one file and its consolidated sharded checkpoint load on one device with the tp2
    model's logits (1e-5 of the largest); that sharded checkpoint resumes at dp2 (tp1) as its consolidated file
    resumes on one device."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_para import consolidate_checkpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "one", filename="{epoch}-{step}", save_top_k=-1)
    fit_reference(litgpt_models.gqa, token_dataset, GLOBAL_BATCH, 5, {"enable_checkpointing": True}, callbacks=(saver,))
    one = tmp_path / "one" / "epoch=0-step=5.ckpt"
    tp2 = pools.get(2).run(_rows_trainer_job, {"tp": 2}, 10, str(one), str(tmp_path / "tp2"), True)
    assert_losses_close(tp2[0]["losses"], _one_device_resume(one, 10), rtol=FP32_RTOL)
    sharded, consolidated = tp2[0]["saved"][-1], tmp_path / "consolidated.ckpt"
    consolidate_checkpoint(sharded, consolidated)
    for where in (tmp_path / "tp2" / "full.ckpt", consolidated):
        state = torch.load(where, weights_only=False)["state_dict"]
        gap = _gap(_one_device_logits({k[len("model."):]: v for k, v in state.items()}), tp2[0]["logits"])
        assert gap <= 1e-5, (where, gap)
    dp2 = pools.get(2).run(_rows_trainer_job, {"dp": 2}, 11, sharded, str(tmp_path / "dp2"), False)
    assert_losses_close([sum(r["losses"][0] for r in dp2) / 2], _one_device_resume(consolidated, 11), rtol=FP32_RTOL)


def _one_step(model, optimizer, x, y, fabric=None) -> None:
    loss = F.cross_entropy(model(x).reshape(-1, litgpt_models.VOCAB), y.reshape(-1))
    fabric.backward(loss) if fabric is not None else loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _rows_fabric_job(config: dict, folder: str, one_device: str, out: str) -> dict:
    """LitGPT's loading flow at tp2 under Fabric: ``fabric.load_raw("lit_model.pth", model)`` after ``setup``
    (meta init), then (``one_device``) ``fabric.load`` of a one-device checkpoint and one SGD step; one file saved.
    Reports the in-layout logits after each."""
    from litgpt.model import GPT

    from lightning_para.fabric import ParaStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ParaStrategy(tp=2, save_distributed_checkpoint=False))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(litgpt_models.litgpt_config(**config))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters(), "sgd", litgpt_models.SHARP_LR))
    data = token_dataset()
    fabric.load_raw(f"{folder}/lit_model.pth", model)
    result = {"raw": _whole(model(data.x[:2]))}
    if one_device:
        fabric.load(one_device, {"model": model, "optimizer": optimizer})
        _one_step(model, optimizer, data.x[:8], data.y[:8], fabric)
        result["stepped"] = _whole(model(data.x[:2]))
    fabric.save(f"{out}/full.ckpt", {"model": model})
    result["saved"] = _whole(model(data.x[:2]))
    return result


@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
def test_litgpt_tp2_fabric_loads_litgpt_rows_and_saves_them(pools, tmp_path, groups):
    """``fabric.load_raw`` of a ``lit_model.pth`` and ``fabric.load`` of a one-device checkpoint (model and momentum,
    then one step) at tp2 give one device's logits; tp2's one file loads on one device with the tp2 model's
    (1e-5 of the largest). Grouped-query (rank-major qkv rows) and multi-head (strided) alike."""
    from litgpt.model import GPT

    config = litgpt_models.litgpt_config(n_query_groups=groups)
    litgpt_models.write_litgpt_folder(str(tmp_path / "lit"), config)
    one_device = ""
    if groups == 2:  # a one-device Fabric checkpoint after one step (momentum), and that run's next step
        fabric = L.Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(1)
        gpt = GPT(config)
        litgpt_models.sharpen(gpt)
        model = fabric.setup(gpt)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters(), "sgd", litgpt_models.SHARP_LR))
        data = token_dataset()
        _one_step(model, optimizer, data.x[8:16], data.y[8:16])
        one_device = str(tmp_path / "one.ckpt")
        fabric.save(one_device, {"model": model, "optimizer": optimizer})
        _one_step(model, optimizer, data.x[:8], data.y[:8])
        with torch.no_grad():
            stepped = model(data.x[:2])
    result = pools.get(2).run(_rows_fabric_job, {"n_query_groups": groups}, str(tmp_path / "lit"), one_device,
                              str(tmp_path))[0]
    lit = torch.load(tmp_path / "lit" / "lit_model.pth", weights_only=True)
    assert _gap(result["raw"], _one_device_logits(lit, config)) <= 1e-5
    if one_device:
        assert _gap(result["stepped"], stepped) <= 1e-5
    saved = torch.load(tmp_path / "full.ckpt", weights_only=False)["model"]
    assert _gap(_one_device_logits(saved, config), result["saved"]) <= 1e-5
