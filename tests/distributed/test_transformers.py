"""transformers causal LMs (tiny random configs, no download) under every layout, against one device.

Each layout trains the same LightningModule (``tests/hf_models.py``: ``self.model =
AutoModelForCausalLM.from_config(cfg)``, the model's own loss, the one-line
``configure_pipeline()``) for 10 steps on the same global batch as a single-process run, and
compares per-step losses at FP32_RTOL = 1e-5 relative (different fp32 summation orders:
per-rank partial sums, then collectives; measured ~2e-7). Mixtral runs with
``output_router_logits=True`` except under pp (not supported there, see docs/transformers.md).
World-2 tests come first, then world-4 ones, so each pool starts once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_para.moe import MoEBiasUpdate  # noqa: E402
from tests.comm_counter import CollectiveCounter  # noqa: E402
from tests.harness import WorkerError  # noqa: E402
from tests.hf_models import (  # noqa: E402
    GPT2Module,
    HFCausalLM,
    LlamaUserPipeline,
    hf_tokens,
    hf_tokens_odd,
    llama,
    llama_config,
    mixtral,
    mixtral_biased,
    mixtral_config,
    mixtral_without_router_loss,
)
from tests.parity import FP32_RTOL, assert_losses_close, fit_job, fit_reference, trainer_kwargs  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GLOBAL_BATCH = 8
STEPS = 10
_references: dict[Any, dict] = {}
_created: list = []  # the module built in this worker by the last job


def expert_biases(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")}


class KeepBiases(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.biases = expert_biases(pl_module)


def reference(factory) -> dict:
    if factory not in _references:
        keep = KeepBiases()  # MoEBiasUpdate: the selection biases (`mixtral_biased`) as ParaStrategy updates them
        ref = fit_reference(factory, hf_tokens, GLOBAL_BATCH, STEPS, callbacks=(MoEBiasUpdate(), keep))
        _references[factory] = {**ref, "biases": keep.biases}
    return _references[factory]


def _remember(factory):
    module = factory()
    _created[:] = [module]
    return module


def hf_job(factory, strategy_kwargs: dict, ckpt_dir: str | None = None) -> dict:
    """Inside a worker: train, then report losses, this rank's mesh coordinates and expert shares."""
    import functools

    from lightning_para.integrations.transformers import transformers_experts

    from tests.parity import full_parameters

    result = fit_job(functools.partial(_remember, factory), strategy_kwargs, hf_tokens, GLOBAL_BATCH, STEPS,
                     collect=("losses",), ckpt_dir=ckpt_dir)
    module = _created[0]
    dims = module.trainer.strategy.parallel_dims
    result["coords"] = {name: dims.local_rank(name) for name in ("pp", "dp", "tp")}
    # Every pipeline stage's trained parameters (gathering DTensors is collective: every rank calls it).
    params = full_parameters(module)
    result["params"] = params if dims.local_rank("tp") == 0 and dims.local_rank("dp") == 0 else None
    shares = []
    for _, experts in transformers_experts(module):
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in experts.parameters(recurse=False))
        full = sum(p.numel() for p in experts.parameters(recurse=False))  # a DTensor's numel is the global one
        shares.append(local / full)
    result["expert_shares"] = shares
    result["biases"] = expert_biases(module)
    return result


def biased_gates_job(factory, strategy_kwargs: dict) -> dict:
    """``hf_job`` with a bug planted in this rank's library code: the bias also in the combine weights."""
    import lightning_para.integrations.transformers.balance as balance

    original = balance.select_experts
    balance.select_experts = lambda probs, bias, k: original(probs, bias, k) if bias is None else (
        (probs + bias).gather(-1, original(probs, bias, k)[1]), original(probs, bias, k)[1])
    try:
        return hf_job(factory, strategy_kwargs)
    finally:
        balance.select_experts = original


def losses_over_dp(results: list[dict]) -> list[float]:
    """Every rank reports its pipeline's loss; average one rank per data-parallel coordinate."""
    chosen = {r["coords"]["dp"]: r["losses"] for r in results if r["coords"]["tp"] == 0 and r["coords"]["pp"] == 0}
    return [sum(step) / len(chosen) for step in zip(*chosen.values())]


def trained_parameters(results: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model's trained parameters, merged from the pipeline stages."""
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["params"] or {})
    return merged


def run_and_compare(pools, world: int, factory, kwargs: dict, ckpt_dir: str | None = None) -> list[dict]:
    results = pools.get(world).run(hf_job, factory, kwargs, ckpt_dir)
    assert_losses_close(losses_over_dp(results), reference(factory)["losses"], rtol=FP32_RTOL)
    return results


# ============================================================================ 2 processes
@pytest.mark.parametrize("kwargs", [{"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2}], ids=["tp2", "tp2-sp", "pp2"])
def test_llama_two_ranks(pools, kwargs):
    """GQA Llama under tp=2, tp=2 with SP (positions/RoPE from the global-shaped stream), and pp=2 with
    the one-line pipeline_spec."""
    run_and_compare(pools, 2, llama, kwargs)


@pytest.mark.parametrize("zero", [0, 3])
def test_mixtral_ep2_with_router_loss_and_expert_bias(pools, zero):
    """ep=2 (= dp=2): experts sharded, tokens by all-to-all, the router aux loss over the whole batch and the
    auxiliary-loss-free selection bias (`balance_experts`) updated from both ranks' load: the bias is identical on
    both ranks and to one device's (exactly: integer counts); with ZeRO-3 the experts are FSDP2 units of their own.
    The bias planted in the combine weights moves the loss far beyond the tolerance."""
    results = run_and_compare(pools, 2, mixtral_biased, {"ep": 2, "zero": zero})
    assert all(share == 0.5 for r in results for share in r["expert_shares"]) and results[0]["expert_shares"]
    ref = reference(mixtral_biased)
    assert len(ref["biases"]) == 2 and all(b.abs().sum() > 0 for b in ref["biases"].values())
    for r in results:
        assert r["biases"].keys() == ref["biases"].keys()
        assert all(torch.equal(r["biases"][n], b) for n, b in ref["biases"].items()), (r["biases"], ref["biases"])
    if zero == 0:
        planted = losses_over_dp(pools.get(2).run(biased_gates_job, mixtral_biased, {"ep": 2}))
        worst = max(abs(a - e) / abs(e) for a, e in zip(planted, ref["losses"]))
        assert worst > 10 * FP32_RTOL, worst


@pytest.mark.parametrize("zero3_units", ["blocks", "blocks_and_ends"])
def test_gpt2_tied_embeddings_zero3(pools, zero3_units):
    """GPT-2 ties `lm_head.weight` to `transformer.wte.weight`: ZeRO-3 shards the pair as one grouped
    unit (with the other ends under "blocks"); losses and trained parameters match one device."""
    from tests.parity import assert_params_close

    results = run_and_compare(pools, 2, GPT2Module, {"zero": 3, "zero3_units": zero3_units})
    assert_params_close(trained_parameters(results), reference(GPT2Module)["params"])


def _families_job() -> dict:
    """Qwen3 (q/k norms over head_dim inside attention) and Mistral (sliding-window mask) under tp=2,
    with and without SP: loss and every gradient against the same model on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    from lightning_para.parallel.tensor import apply_tensor_parallel, loss_parallel_backward, loss_parallel_step

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    out = {}
    for name, config in {"qwen3": Qwen3Config(**common, head_dim=8), "mistral": MistralConfig(**common, sliding_window=5)}.items():
        for sp in (False, True):
            torch.manual_seed(0)
            ref = AutoModelForCausalLM.from_config(config)
            for param in ref.parameters():  # norm weights away from 1, so their gradients matter
                torch.nn.init.normal_(param, 1.0 if param.dim() == 1 else 0.0, 0.2)
            model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(ref.state_dict())
            apply_tensor_parallel(model, mesh, sequence_parallel=sp, loss_parallel=True)
            ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
            expected = ref(input_ids=ids, labels=ids).loss
            expected.backward()
            with loss_parallel_step(True):
                loss = model(input_ids=ids, labels=ids).loss
            with loss_parallel_backward(True):
                loss.backward()
            grads = dict(ref.named_parameters())
            worst = max(
                ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n].grad).abs().max().item()
                for n, p in model.named_parameters()
            )
            out[f"{name}-sp" if sp else name] = (abs(loss.item() - expected.item()) / expected.item(), worst)
    return out


def test_qwen3_and_mistral_under_tp_and_sp(pools):
    result = pools.get(2).run(_families_job)[0]
    for name, (loss_rel, grad_abs) in result.items():
        # fp32 reordering only (measured ~1e-7); the q/k-norm weight gradients are summed over tp.
        assert loss_rel <= FP32_RTOL and grad_abs <= 1e-5, (name, loss_rel, grad_abs)


# ----------------------------------------------------------------------------- one decoder layer
B, S, H = 2, 32, 64  # batch, sequence, hidden
PSI = B * S * H * 4  # bytes of one fp32 activation [b, s, h]


def _decoder_layer_job() -> dict:
    """Bytes one transformers LlamaDecoderLayer saves for backward (activations, each storage once) and
    its collectives, with no TP, TP and TP+SP (the stream a global-shaped Shard(1) DTensor)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from lightning_para.parallel.tensor import apply_tensor_parallel

    config = LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=4 * H, num_attention_heads=4,
                         num_key_value_heads=4, attn_implementation="eager")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for name, sp in (("tp1", None), ("tp2", False), ("tp2_sp", True)):
        torch.manual_seed(0)
        holder = nn.Module()
        holder.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        if sp is not None:
            apply_tensor_parallel(holder, mesh, sequence_parallel=sp, loss_parallel=False)
        torch.manual_seed(1)
        x = torch.randn(B, S, H)
        position_ids = torch.arange(S).unsqueeze(0)
        rotary = LlamaRotaryEmbedding(config)(x, position_ids)
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        if sp:
            shard = x[:, rank * S // 2 : (rank + 1) * S // 2].clone().requires_grad_()
            x = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False)  # .shape stays [B, S, H]
        else:
            x.requires_grad_()
        params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in holder.parameters()}
        seen: set[int] = set()
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
            if storage.data_ptr() not in seen and storage.data_ptr() not in params:
                seen.add(storage.data_ptr())
                saved[0] += storage.nbytes()
            return t

        with CollectiveCounter() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = holder.layers[0](x, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        out_shape = tuple(y.shape)
        with CollectiveCounter() as backward:
            (y.to_local() if isinstance(y, DTensor) else y).sum().backward()
        norm_bytes = sum(p.numel() * 4 for n, p in holder.named_parameters() if "layernorm" in n)
        out[name] = {"saved": saved[0], "forward": dict(forward.bytes_by_kind), "backward": dict(backward.bytes_by_kind),
                     "shape": out_shape, "norm_bytes": norm_bytes}
    return out


def test_sequence_parallel_on_a_transformers_decoder_layer(pools):
    """The SP activation saving and the Megatron-SP collectives hold on a transformers decoder layer fed
    the global-shaped stream (its code reads hidden.shape for the attention reshape)."""
    result = pools.get(2).run(_decoder_layer_job)[0]
    saved = {name: r["saved"] / result["tp1"]["saved"] for name, r in result.items()}
    # tp2 ~ 0.61, tp2_sp ~ 0.50 measured (docs/tensor_parallel.md): SP splits the norm inputs and
    # residuals that TP leaves whole, and keeps only the sequence shard of each sublayer input.
    assert saved["tp2_sp"] <= 0.55 and saved["tp2"] >= saved["tp2_sp"] + 0.05, saved
    assert result["tp2_sp"]["shape"] == (B, S, H)
    sp, tp = result["tp2_sp"], result["tp2"]
    assert tp["forward"] == {"all_reduce": 2 * 2 * PSI}
    assert sp["forward"] == {"all_gather": 2 * PSI, "reduce_scatter": 2 * PSI}
    # Backward, as for the GPT block (docs/tensor_parallel.md): per sublayer the output gradient
    # all-gathered and the input gradient reduce-scattered (psi each), the input shard re-gathered
    # (keep-shard default, psi), and the sequence-parallel norm weights' partial gradients all-reduced.
    assert sp["backward"] == {"all_gather": 4 * PSI, "reduce_scatter": 2 * PSI, "all_reduce": 2 * sp["norm_bytes"]}


# ----------------------------------------------------------------------------- bad input
def _bad_job(factory, kwargs: dict, dataset=hf_tokens) -> None:
    import lightning as L

    from lightning_para import ParaStrategy
    from tests.parity import ShardedData

    trainer = L.Trainer(devices=2, strategy=ParaStrategy(**kwargs), max_steps=1, **trainer_kwargs())
    trainer.fit(factory(), datamodule=ShardedData(dataset, GLOBAL_BATCH))


def _one_kv_head():
    return HFCausalLM(llama_config(num_key_value_heads=1))


def _three_experts():
    return HFCausalLM(mixtral_config(num_local_experts=3))


@pytest.mark.parametrize(
    "factory, kwargs, dataset, message",
    [
        (_one_kv_head, {"tp": 2}, hf_tokens,
         r"tp=2 does not divide[\s\S]*`config.num_key_value_heads` of 'model.model.layers.0.self_attn' \(and 1 more\) = 1[\s\S]*Choose tp in \[1\]"),
        (_three_experts, {"ep": 2}, hf_tokens, r"`ep=2` must divide config.num_local_experts=3 .*Choose ep in \[1\]"),
        (llama, {"tp": 2, "sequence_parallel": True}, hf_tokens_odd,
         r"sequence_parallel=True splits the sequence over tp=2, but the sequence length is 15"),
        (GPT2Module, {"pp": 2}, hf_tokens, r"pipeline_spec does not know the architecture `GPT2LMHeadModel`"),
    ],
    ids=["kv-heads", "experts", "sequence-length", "architecture"],
)
def test_bad_input_fails_on_every_rank(pools, factory, kwargs, dataset, message):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_bad_job, factory, kwargs, dataset, timeout=120, keep_alive_on_error=True)
    assert set(info.value.errors) == {0, 1} and not info.value.pending
    for text in info.value.errors.values():
        assert "ValueError" in text and re.search(message, text), text


# ============================================================================ 4 processes
@pytest.mark.parametrize(
    "kwargs",
    [
        {"dp": 2, "tp": 2, "zero": 3},
        {"pp": 2, "tp": 2},
        {"pp": 2, "dp": 2, "zero": 1, "schedule": "interleaved", "virtual_stages": 2},
    ],
    ids=["dp2-tp2-zero3", "pp2-tp2", "pp2-dp2-interleaved-zero1"],
)
def test_llama_four_ranks(pools, kwargs):
    run_and_compare(pools, 4, llama, kwargs)


def test_llama_pp2_tp2_sp_checkpoint_exports_to_from_pretrained(pools, tmp_path):
    """pp=2 x tp=2 with SP, then the sharded checkpoint (model names = save_pretrained names) exported
    to a folder that AutoModelForCausalLM.from_pretrained opens with the trained model's logits."""
    results = run_and_compare(pools, 4, llama, {"pp": 2, "tp": 2, "sequence_parallel": True}, ckpt_dir=str(tmp_path / "ckpt"))
    _check_export(tmp_path, trained_parameters(results), llama)


def test_user_pipeline_wrappers_pp2_tp2(pools):
    """The failing case of the issue: the head registered under the user's wrapper and `model.lm_head`."""
    run_and_compare(pools, 4, LlamaUserPipeline, {"pp": 2, "tp": 2})


@pytest.mark.parametrize(
    "factory, kwargs",
    [
        (mixtral, {"dp": 4, "ep": 2, "zero": 1}),
        (mixtral_without_router_loss, {"ep": 2, "pp": 2}),
    ],
    ids=["dp4-ep2-zero1", "ep2-pp2"],
)
def test_mixtral_four_ranks(pools, factory, kwargs):
    results = run_and_compare(pools, 4, factory, kwargs)
    assert all(share == 0.5 for r in results for share in r["expert_shares"]) and results[0]["expert_shares"]


def test_mixtral_dp2_ep2_tp2_checkpoint_exports(pools, tmp_path):
    results = run_and_compare(pools, 4, mixtral, {"dp": 2, "ep": 2, "tp": 2}, ckpt_dir=str(tmp_path / "ckpt"))
    assert all(share == 0.5 for r in results for share in r["expert_shares"])
    _check_export(tmp_path, trained_parameters(results), mixtral)


def _check_export(tmp_path: Path, trained: dict[str, torch.Tensor], factory) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_para.checkpoint import consolidate_checkpoint
    from lightning_para.integrations.transformers import export

    checkpoint = tmp_path / "ckpt" / f"epoch=1-step={STEPS}.ckpt"
    state = consolidate_checkpoint(checkpoint)["state_dict"]
    module = factory()  # the same architecture, untrained
    assert {k.removeprefix("model.") for k in state} == set(module.model.state_dict())  # save_pretrained names
    assert set(trained) == set(dict(module.named_parameters()))
    module.load_state_dict(trained)  # the trained model, whole on this process
    folder = export(checkpoint, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(folder)
    ids = hf_tokens()[0][0][None]
    module.eval()
    with torch.no_grad():
        expected, got = module.model(input_ids=ids).logits, exported(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # The recipe starts from such a folder too.
    from lightning_para.recipes import HFCausalLM as Recipe

    with torch.no_grad():
        torch.testing.assert_close(Recipe(pretrained=str(folder)).eval()(ids), expected, rtol=0, atol=1e-6)
