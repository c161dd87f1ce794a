"""recipes/gpt.py: presets, shapes, the declared TP plan, generation, accounting (no communication)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_para.parallel.pipeline.spec import PipelineStageModule
from lightning_para.parallel.tensor.validate import check_plan
from lightning_para.parallel.tensor.plan import resolve_plan
from lightning_para.describe import describe_module
from lightning_para.recipes.gpt import GPT, PRESETS, GPTConfig, apply_rope


def expected_params(c: GPTConfig) -> int:
    """Parameters of the default (Llama-style) block layout, from the shapes alone."""
    d, h, v = c.n_embd, c.mlp_hidden, c.vocab_size
    mlp = (3 if c.mlp == "swiglu" else 2) * d * h
    block = 4 * d * d + mlp + 2 * d  # q, k, v, proj + MLP + two RMSNorm weights
    return c.n_layer * block + v * d + (v * d + d)  # embedding, head + final norm


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_the_named_shapes(name):
    with torch.device("meta"):  # the 7B shape without 26 GB of memory
        model = GPT(preset=name)
    c = model.config
    assert model.num_params() == expected_params(c)
    assert len(model.blocks) == c.n_layer and c.n_embd % c.n_head == 0
    assert model.blocks[0].attn.n_head == c.n_head and model.blocks[0].attn.head_dim == c.head_dim
    assert model.blocks[0].mlp.c_fc.out_features == c.mlp_hidden


def test_preset_sizes_and_overrides():
    billions = {n: GPTConfig.from_preset(n) for n in PRESETS}
    assert (billions["gpt-7b"].n_layer, billions["gpt-7b"].n_embd, billions["gpt-7b"].mlp_hidden) == (32, 4096, 11008)
    c = GPTConfig.from_preset("tiny", n_layer=2, mlp="gelu")
    assert c.n_layer == 2 and c.mlp_hidden == 4 * c.n_embd  # the GELU width is recomputed
    with pytest.raises(ValueError, match="preset='huge'"):
        GPTConfig.from_preset("huge")
    with pytest.raises(ValueError, match=r"`n_embd=100` must be divisible by `n_head=3`"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="norm='batchnorm'"):
        GPTConfig(norm="batchnorm")


@pytest.mark.parametrize(
    "style",
    [
        {},  # RMSNorm, RoPE, SwiGLU, untied
        {"norm": "layernorm", "pos": "learned", "mlp": "gelu", "bias": True, "tie_weights": True},  # GPT-2
    ],
)
def test_forward_shapes_causality_and_loss(style):
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=16, **style)
    x = torch.randint(0, 256, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 256)
    # causal: changing a later token leaves earlier logits unchanged
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    torch.testing.assert_close(model(x2)[:, :10], logits[:, :10])
    assert not torch.allclose(model(x2)[:, 10:], logits[:, 10:])
    loss = model.loss_fn(logits, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init
    if style.get("tie_weights"):
        assert model.head.lm_head.weight is model.embed.wte.weight
    with pytest.raises(ValueError, match="longer than the model's block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rope_rotates_pairs_and_keeps_norms():
    x = torch.randn(2, 5, 3, 8)
    y = apply_rope(x, 10000.0)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # relative: <R_m q, R_n k> depends only on m - n
    q, k = torch.randn(1, 1, 1, 8).expand(1, 5, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 5, 1, 8)
    rq, rk = apply_rope(q.contiguous(), 10000.0), apply_rope(k.contiguous(), 10000.0)
    torch.testing.assert_close((rq[0, 3] * rk[0, 1]).sum(), (rq[0, 4] * rk[0, 2]).sum())


def test_attention_runs_with_a_tensor_parallel_share_of_heads():
    """Under tp the q/k/v outputs hold n_head/tp heads; attention must infer the local count."""
    model = GPT(n_layer=1, n_embd=32, n_head=4, block_size=8)
    attn = model.blocks[0].attn
    half = nn.Linear(32, 16, bias=False)
    for name in ("c_q", "c_k", "c_v"):
        setattr(attn, name, half)
    attn.c_proj = nn.Linear(16, 32, bias=False)
    assert attn(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_tensor_parallel_plan():
    model = GPT(n_layer=2, n_embd=32, n_head=4)
    block = {
        "ln_1": "norm", "attn": "attention", "attn.c_q": "colwise", "attn.c_k": "colwise", "attn.c_v": "colwise",
        "attn.c_proj": "rowwise", "ln_2": "norm", "mlp": "mlp", "mlp.c_fc": "colwise", "mlp.c_gate": "colwise",
        "mlp.c_proj": "rowwise",
    }
    expected = {"embed.wte": "vocab_parallel", "head.ln_f": "norm", "head.lm_head": "lm_head"}
    expected.update({f"blocks.{i}.{k}": v for i in range(2) for k, v in block.items()})
    plan, source = resolve_plan(model)
    assert source == "declared" and plan == expected
    for style in ({}, {"mlp": "gelu", "pos": "learned", "norm": "layernorm", "bias": True}):
        model = GPT(n_layer=3, n_embd=32, n_head=4, **style)
        plan, _ = resolve_plan(model)
        # the library's own check: every Linear planned, heads/widths/vocabulary divisible by tp
        for tp in (2, 4):
            assert check_plan(model, plan, tp, sequence_parallel=True)["blocks.0.attn"]["n_head"] == 4
        with pytest.raises(ValueError, match="tp=3"):
            check_plan(model, plan, 3, sequence_parallel=False)
        if style:
            assert plan["embed.wpe"] == "sequence_slice" and "blocks.0.mlp.c_gate" not in plan


def test_tensor_parallel_plan_of_each_pipeline_stage():
    """Under pp the plan is applied to a stage holding some layers: each layer brings its own."""
    model = GPT(n_layer=4, n_embd=32, n_head=4)
    layers = [("embed", model.embed), *[(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], ("head", model.head)]
    for stage_layers in (layers[:3], layers[3:]):
        stage = PipelineStageModule(0, stage_layers, model)
        plan, source = resolve_plan(stage)
        assert source == "declared"
        check_plan(stage, plan, 2, sequence_parallel=False)  # raises on any unplanned nn.Linear
        assert all(name.split(".")[0] in {n.split(".")[0] for n, _ in stage_layers} for name in plan)


def test_flops_per_token_is_6n_plus_attention():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=16)
    n = model.num_params() - model.embed.wte.weight.numel()  # the embedding is a lookup, not a matmul
    assert model.num_params(matmul_only=True) == n
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 32 * 16


def test_generation_is_seeded_and_respects_the_window():
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_embd=32, n_head=4, block_size=8, sample_tokens=4)
    a = model.generate_text("def ", 12)
    b = model.generate_text("def ", 12)
    assert a == b and a.startswith("def ")
    ids = model.generate(torch.tensor([[1, 2, 3]]), 10, temperature=0)
    assert ids.shape == (1, 13) and ids[0, :3].tolist() == [1, 2, 3]
    # greedy next token from the padded fixed window equals the unpadded forward
    x = torch.tensor([[5, 6, 7]])
    assert model.generate(x, 1, temperature=0)[0, -1] == model(x)[0, -1].argmax()


def test_loss_fp32_takes_the_cross_entropy_of_fp32_logits():
    """``GPT(loss_fp32=True)`` (torchtitan's and transformers' loss): under bf16 weights the cross-entropy runs on
    the logits cast to fp32, so it equals fp32 arithmetic on the same logits and differs from the bf16 one; the
    planner's model description reads it as ``loss_upcast``."""
    torch.manual_seed(0)
    model = GPT(loss_fp32=True, sample_tokens=0, init_std=0.3).to(torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    loss = model.loss_fn(logits, tokens)
    reference = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(0, 1))
    assert loss.dtype == torch.float32 and torch.equal(loss, reference)
    model.loss_fp32 = False
    assert model.loss_fn(logits, tokens).dtype == torch.bfloat16
    assert describe_module(GPT(loss_fp32=True, sample_tokens=0)).loss_upcast
    assert not describe_module(GPT(sample_tokens=0)).loss_upcast
