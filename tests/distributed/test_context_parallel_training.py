"""Context parallel under ParaStrategy: parity with one device, memory, communication, bad input.

Every parity check trains the GPT recipe (or a tiny Hugging Face Llama) for 10 steps under
``ParaStrategy(cp=...)`` in real gloo processes and compares each step's loss with one process
on the same global batch (``tests/parity.py``; fp32, 1e-5 relative: the cp ranks sum the same
terms in a different order). Because cross-entropy covers the whole sequence under cp, *every*
rank's loss must equal the reference (averaged over dp only), not just their mean.
"""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import Dataset

from lightning_para.recipes.gpt import GPT
from tests.comm_counter import CollectiveCounter
from tests.harness import WorkerError
from tests.sharpness import SHARP_STD
from tests.parity import (
    ShardedData,
    assert_losses_close,
    assert_params_close,
    fit_job,
    fit_reference,
    mean_over_dp,
    trainer_kwargs,
)
from tests.tp_models import TokenDataset, odd_length_dataset, token_dataset

GLOBAL_BATCH = 8
STEPS = 10
SEQ = 16  # token_dataset's sequence length; load-balanced cp=2 splits it into 4 chunks of 4
CLIP = {"gradient_clip_val": 1.0}
# Parameters after 10 steps. The GPT models use SGD: with sharp weights (init 0.3) the recipe's AdamW turns
# a 1e-7 relative perturbation of the initial weights (a reordered fp32 sum) into parameter differences of
# 2e-4 after 10 steps on one device, 5e-3 in the key bias, whose gradient is analytically zero (Adam's
# m / sqrt(v) makes O(lr) steps out of noise); SGD keeps them at 2e-7 and the loss drift at 2.3e-7
# (tests.sharpness.perturbation_param_drift / perturbation_growth). The HF Llama uses SGD too.
PARAM_ATOL = 1e-5


class SGDGPT(GPT):
    """The GPT recipe with SGD + momentum instead of AdamW (see PARAM_ATOL)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def gpt() -> GPT:
    """Llama-style GPT recipe: RoPE, RMSNorm, SwiGLU (RoPE needs the global positions under cp)."""
    return SGDGPT(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=64, sample_tokens=0, warmup_steps=2,
                  init_std=SHARP_STD)


def gpt2_style() -> GPT:
    """GPT-2 style recipe: learned positions (``wpe`` needs the global positions), LayerNorm, GELU, biases."""
    return SGDGPT(
        n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=64, sample_tokens=0, warmup_steps=2,
        norm="layernorm", pos="learned", mlp="gelu", bias=True, init_std=SHARP_STD,
    )


_references: dict = {}


def reference(model=gpt, **overrides) -> dict:
    key = (model, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = fit_reference(model, token_dataset, GLOBAL_BATCH, STEPS, overrides)
    return _references[key]


def check_every_rank(results: list[dict], ref: dict, dp_groups: list[list[int]], params: bool = True) -> None:
    """Each dp group's mean loss equals one device's; cp peers report the very same loss."""
    for group in dp_groups:  # ranks holding the same dp slice of the batch (cp and tp peers)
        for r in group[1:]:
            assert results[r]["losses"] == results[group[0]]["losses"], (group, r)
    assert_losses_close(mean_over_dp([r["losses"] for r in results], [[g[0] for g in dp_groups]]), ref["losses"])
    if params:
        assert_params_close(results[0]["params"], ref["params"], atol=PARAM_ATOL)


# ============================================================================ 2 processes
@pytest.mark.parametrize("method, model", [("ring", gpt), ("all_to_all", gpt2_style)], ids=["ring-rope", "ulysses-learned"])
def test_cp2_parity_gpt_recipe(pools, method, model):
    results = pools.get(2).run(fit_job, model, {"cp": 2, "cp_method": method}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check_every_rank(results, reference(model, **CLIP), [[0, 1]])


@pytest.mark.parametrize(
    "kwargs, overrides",
    [
        ({"cp": 2, "activation_checkpointing": "full"}, {}),  # recomputed attention runs across cp again
        ({"cp": 2, "cp_method": "all_to_all", "activation_checkpointing": "full"}, {}),
        ({"cp": 2, "zero": 2}, {"accumulate_grad_batches": 2}),
        ({"cp": 2, "cp_load_balance": False}, {}),  # contiguous slices
    ],
    ids=["ring-recompute", "ulysses-recompute", "zero2-accumulate", "contiguous"],
)
def test_cp2_options_parity(pools, kwargs, overrides):
    results = pools.get(2).run(fit_job, gpt, kwargs, token_dataset, GLOBAL_BATCH, STEPS, overrides, ("losses",))
    check_every_rank(results, reference(**overrides), [[0, 1]], params=False)


# ---------------------------------------------------------------------------- Hugging Face Llama
class LabelledTokens(Dataset):
    """``{"input_ids", "labels"}`` with next-token labels, a fifth of them ``-100`` (ignored, unevenly per chunk)."""

    def __init__(self) -> None:
        self.tokens = TokenDataset()
        g = torch.Generator().manual_seed(3)
        self.ignored = torch.rand(len(self.tokens), SEQ, generator=g) < 0.2

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        x, y = self.tokens[i]
        return {"input_ids": x, "labels": y.masked_fill(self.ignored[i], -100)}


def labelled_tokens() -> LabelledTokens:
    return LabelledTokens()


class HFLlama(L.LightningModule):
    """A tiny ``LlamaForCausalLM`` (SDPA attention, GQA, RoPE) trained with its own loss.

    Labels are already next-token labels (``shift_labels``): under cp a rank's chunks are not
    contiguous, so HF must not shift inside them. The cp hook supplies what HF needs besides
    the split: global ``position_ids`` and an all-ones ``attention_mask`` (without it HF reads
    the jumps in head-tail positions as packed sequences and builds a block mask).
    """

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
            initializer_range=SHARP_STD,
        )
        self.model = LlamaForCausalLM(config)

    def context_parallel_batch(self, batch: dict, shard) -> dict:
        ids = batch["input_ids"]
        local = shard.split(ids)
        return {
            "input_ids": local,
            "labels": shard.split(batch["labels"]),
            "position_ids": shard.position_ids(ids.shape[1], batch_size=ids.shape[0], device=ids.device),
            "attention_mask": torch.ones_like(local),
        }

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        labels = batch["labels"]
        out = self.model(
            input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"), labels=labels, shift_labels=labels, use_cache=False,
        )
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        # SGD (see PARAM_ATOL): with sharp weights AdamW left one q_proj element 3.3e-5 from one device
        # after 10 steps under cp=2 (the losses matched), where every other element agreed within 1e-5.
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def test_cp2_parity_hf_llama_with_ignored_labels(pools):
    pytest.importorskip("transformers")
    results = pools.get(2).run(fit_job, HFLlama, {"cp": 2}, labelled_tokens, GLOBAL_BATCH, STEPS, CLIP)
    ref = fit_reference(HFLlama, labelled_tokens, GLOBAL_BATCH, STEPS, CLIP)
    check_every_rank(results, ref, [[0, 1]])


# ---------------------------------------------------------------------------- activation memory
class _SavedBytes(Callback):
    """Peak bytes autograd keeps for backward during the first training step (parameters excluded)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_para.instrument.saved_activations import SavedActivationMeter

        self.meter = SavedActivationMeter(exclude=list(pl_module.parameters()))
        self.meter.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self.meter.__exit__(None, None, None)
        self.peak = self.meter.peak_bytes


def _saved_bytes_job(strategy_kwargs: dict, per_rank_batch: int) -> int:
    from lightning_para import ParaStrategy

    meter = _SavedBytes()
    L.seed_everything(0, verbose=False)
    strategy = ParaStrategy(**strategy_kwargs)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=1, callbacks=[meter],
                        use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(gpt(), datamodule=ShardedData(token_dataset, per_rank_batch))
    return meter.peak


def test_cp2_halves_saved_activations(pools):
    """Same sequence length and samples per rank: cp=1 (dp=2) keeps the whole sequence, cp=2 half."""
    pool = pools.get(2)
    full = pool.run(_saved_bytes_job, {"dp": 2}, 4)
    split = pool.run(_saved_bytes_job, {"cp": 2}, 4)
    for cp1, cp2 in zip(full, split):
        assert cp2 <= 0.55 * cp1, (cp2, cp1, cp2 / cp1)


# ---------------------------------------------------------------------------- communication
class _PhaseCounter(Callback):
    """Collectives of the second training step, forward (training_step) and backward apart."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.active = batch_idx == 1
        if self.active:
            self.forward = CollectiveCounter()
            self.forward.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self.active:
            self.forward.__exit__(None, None, None)
            self.backward = CollectiveCounter()
            self.backward.__enter__()

    def on_after_backward(self, trainer, pl_module):
        if self.active:
            self.backward.__exit__(None, None, None)
            self.active = False


def planned_comm_bytes(world: int, per_rank_batch: int, **layout) -> dict[str, float]:
    """The planner's bytes per step and mesh dimension for the test GPT (fp32, one microbatch per step)."""
    from lightning_para.describe import describe_module
    from lightning_para.plan import Cluster, Layout, Training, estimate

    lay = Layout(**layout)
    cluster = Cluster.of("h100", nodes=1, gpus_per_node=world)
    training = Training(seq_len=SEQ, global_batch=per_rank_batch * lay.dp, micro_batch=per_rank_batch,
                        precision="32-true")
    return estimate(describe_module(gpt()), cluster, training, lay).comm_bytes()


def _cp_comm_job(method: str) -> dict:
    from lightning_para import ParaStrategy

    counter = _PhaseCounter()
    L.seed_everything(0, verbose=False)
    strategy = ParaStrategy(cp=dist.get_world_size(), cp_method=method)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2, callbacks=[counter],
                        use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(gpt(), datamodule=ShardedData(token_dataset, GLOBAL_BATCH))
    cp_group = strategy.parallel_dims.group("cp").group_name

    def on_cp(c: CollectiveCounter) -> dict:
        out: dict = {}
        for kind, nbytes, group in c.calls:
            if group == cp_group:
                calls, total = out.get(kind, (0, 0))
                out[kind] = (calls + 1, total + nbytes)
        return out

    return {"forward": on_cp(counter.forward), "backward": on_cp(counter.backward)}


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_cp_communication_per_layer_matches_the_formulas(pools, method):
    """Ring: 2(c-1) K/V block receives per layer forward; backward 2(c-1) K/V + 2c fp32 dK/dV.
    Ulysses: 4 all-to-alls per layer forward (q, k, v, out), 4 backward. Bytes within 5%."""
    c, layers, b, heads, head_dim = 2, 2, GLOBAL_BATCH, 4, 8
    block = b * (SEQ // c) * heads * head_dim * 4  # one K (or V, q, out) shard in fp32 bytes
    for r in pools.get(c).run(_cp_comm_job, method):
        fwd, bwd = r["forward"], r["backward"]
        if method == "ring":
            assert fwd["recv"][0] == 2 * (c - 1) * layers and fwd["send"][0] == 2 * (c - 1) * layers
            assert fwd["recv"][1] == pytest.approx(2 * (c - 1) * block * layers, rel=0.05)
            assert bwd["recv"][0] == (2 * (c - 1) + 2 * c) * layers
            assert bwd["recv"][1] == pytest.approx((2 * (c - 1) + 2 * c) * block * layers, rel=0.05)
        else:
            assert fwd["all_to_all"] == (4 * layers, pytest.approx(4 * block * layers, rel=0.05))
            assert bwd["all_to_all"] == (4 * layers, pytest.approx(4 * block * layers, rel=0.05))
        # The only other cp traffic: one all-reduce of (loss sum, token count) per cross-entropy, and
        # the `train_loss` logging's sync_dist (issue 14), which reduces over the world: here the cp group.
        assert fwd.get("all_reduce", (0, 0))[0] == 2 and set(fwd) <= {"send", "recv", "all_to_all", "all_reduce"}
        # The planner prices the same traffic (send + receive, or all-to-all input bytes).
        attention = sum(b for phase in (fwd, bwd) for kind, (_, b) in phase.items() if kind != "all_reduce")
        planned = planned_comm_bytes(c, GLOBAL_BATCH, cp=c, cp_method=method)["cp"]
        assert attention == pytest.approx(planned, rel=0.05)


# ---------------------------------------------------------------------------- bad input
class ManualAttention(L.LightningModule):
    """Attention written out as matmul + softmax: no SDPA call, so cp cannot reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill(torch.ones(x.shape[1], x.shape[1]).triu(1).bool(), -1e9)
        logits = self.head(torch.softmax(scores / 4, dim=-1) @ v)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def three_heads() -> GPT:
    return GPT(n_layer=1, n_embd=24, n_head=3, block_size=SEQ, vocab_size=64, sample_tokens=0)


def _bad_fit_job(model_factory, strategy_kwargs: dict, dataset_factory=token_dataset) -> None:
    from lightning_para import ParaStrategy

    trainer = L.Trainer(devices=2, strategy=ParaStrategy(**strategy_kwargs), max_steps=2,
                        use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(model_factory(), datamodule=ShardedData(dataset_factory, GLOBAL_BATCH))


@pytest.mark.parametrize(
    "model, kwargs, dataset, message",
    [
        (gpt, {"cp": 2}, odd_length_dataset,
         r"ParaStrategy\(cp=2\) splits every sequence .* into 2\*cp=4 equal chunks .* a sequence has 15 tokens\."
         r" Choose cp in \[1\]"),
        (three_heads, {"cp": 2, "cp_method": "all_to_all"}, token_dataset,
         r"cp_method='all_to_all' .* num_heads=3 and num_kv_heads=3 must both be divisible by cp x tp = 2\."
         r" Choose cp in \[1, 3\], or use cp_method='ring'"),
        (ManualAttention, {"cp": 2}, token_dataset,
         r"never called torch.nn.functional.scaled_dot_product_attention.*attn_mask=None"),
    ],
    ids=["sequence-length", "ulysses-heads", "attention-not-sdpa"],
)
def test_bad_input_fails_on_every_rank_without_hanging(pools, model, kwargs, dataset, message):
    with pytest.raises(WorkerError) as info:
        pools.get(2).run(_bad_fit_job, model, kwargs, dataset, timeout=60, keep_alive_on_error=True)
    assert set(info.value.errors) == {0, 1} and not info.value.pending
    for text in info.value.errors.values():
        assert "ValueError" in text and re.search(message, text), text


# ============================================================================ 4 processes
LAYOUTS_4 = [
    ({"cp": 2, "tp": 2}, [[0, 1, 2, 3]], True),  # mesh (.., cp, tp): one dp slice
    ({"cp": 2, "tp": 2, "cp_method": "all_to_all", "sequence_parallel": True}, [[0, 1, 2, 3]], True),
    ({"cp": 2, "dp": 2, "zero": 1}, [[0, 1], [2, 3]], True),  # rank = dp * cp + cp_rank
    ({"cp": 2, "dp": 2, "zero": 3}, [[0, 1], [2, 3]], True),
    ({"cp": 2, "pp": 2}, [[0, 1, 2, 3]], False),  # rank 0 holds only the first stage's parameters
]


@pytest.mark.parametrize("kwargs, dp_groups, params", LAYOUTS_4, ids=["cp2-tp2", "cp2-tp2-sp-ulysses", "cp2-dp2-zero1",
                                                                       "cp2-dp2-zero3", "cp2-pp2"])
def test_cp2_composes_parity(pools, kwargs, dp_groups, params):
    results = pools.get(4).run(fit_job, gpt, kwargs, token_dataset, GLOBAL_BATCH, STEPS, CLIP,
                               ("losses", "params") if params else ("losses",))
    check_every_rank(results, reference(**CLIP), dp_groups, params=params)
