"""MoE layer without communication: routing math, capacity, aux-loss formulas, gradients, bad input."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_para import ParallelConfig, ParallelDims
from lightning_para.moe import (
    MoE,
    aux_loss,
    capacity_keep_mask,
    expert_capacity,
    load_balancing_loss,
    moe_stats_paused,
    router_z_loss,
    set_aux_loss_grad_scale,
    update_expert_bias,
)
from lightning_para.parallel.expert import check_expert_layout


def naive_moe(layer: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token, expert by expert: the definition the batched layer must equal (a selection bias
    picks the experts; the gates are the unbiased probabilities)."""
    tokens = x.reshape(-1, layer.dim)
    probs = (tokens @ layer.router.weight.t()).softmax(-1)
    top_i = (probs + getattr(layer, "expert_bias", 0.0)).topk(layer.top_k, -1).indices
    top_p = probs.gather(-1, top_i)
    gates = top_p / top_p.sum(-1, keepdim=True) if layer.normalize_top_k else top_p
    ex = layer.experts
    rows = []
    for t in range(tokens.shape[0]):
        acc = layer.shared_expert(tokens[t]) if layer.shared_expert is not None else torch.zeros(layer.dim)
        for j in range(layer.top_k):
            if keep is not None and not keep[t, j]:
                continue
            e = top_i[t, j]
            h = tokens[t] @ ex.w1[e]
            h = F.silu(h) * (tokens[t] @ ex.w3[e]) if ex.w3 is not None else F.gelu(h)
            acc = acc + gates[t, j] * (h @ ex.w2[e])
        rows.append(acc)
    return torch.stack(rows).view_as(x)


def naive_aux(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """alpha * E * sum_i f_i P_i per sequence (averaged) + beta * mean logsumexp^2, written out."""
    b, s, _ = x.shape
    logits = x @ layer.router.weight.t()
    probs = logits.softmax(-1)
    top_i = probs.topk(layer.top_k, -1).indices
    E, k = layer.num_experts, layer.top_k
    per_seq = []
    for i in range(b):
        f = torch.stack([(top_i[i] == e).sum() for e in range(E)]).float() / (s * k)
        p = probs[i].mean(0)
        per_seq.append(E * (f * p).sum())
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return layer.balance_loss_weight * torch.stack(per_seq).mean() + layer.z_loss_weight * z


# ----------------------------------------------------------------------------- formulas
def test_expert_capacity_formula():
    assert expert_capacity(10, 4, 1.0, 2) == math.ceil(10 / 4 * 1.0 * 2) == 5
    assert expert_capacity(8, 4, 1.25, 1) == 3  # ceil(2.5)
    assert expert_capacity(64, 8, 1.0, 1) == 8


def test_capacity_keeps_first_choices_before_second_choices():
    # Two tokens, k=2, capacity 1: both first choices fit, both second choices find their expert full.
    keep = capacity_keep_mask(torch.tensor([[1, 0], [0, 1]]), num_experts=2, capacity=1)
    assert keep.tolist() == [[True, False], [True, False]]
    # Within one slot, earlier tokens win.
    keep = capacity_keep_mask(torch.tensor([[0], [0], [0], [1]]), num_experts=2, capacity=2)
    assert keep.view(-1).tolist() == [True, True, False, True]


def test_load_balancing_loss_matches_switch_formula():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2], [0.1, 0.9]])
    idx = torch.tensor([[0], [0], [0], [1]])
    f = torch.tensor([3 / 4, 1 / 4])
    p = probs.mean(0)
    assert torch.allclose(load_balancing_loss(probs, idx, 2), 2 * (f * p).sum())
    # Perfectly balanced routing with uniform probabilities gives exactly 1 (so alpha*1 = alpha).
    uniform = torch.full((4, 2), 0.5)
    assert torch.allclose(load_balancing_loss(uniform, torch.tensor([[0], [1], [0], [1]]), 2), torch.tensor(1.0))
    # Groups: each group its own f and P, then the mean.
    two = load_balancing_loss(probs, idx, 2, groups=2)
    first = load_balancing_loss(probs[:2], idx[:2], 2)
    second = load_balancing_loss(probs[2:], idx[2:], 2)
    assert torch.allclose(two, (first + second) / 2)


def test_router_z_loss_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    expected = (torch.logsumexp(logits[0], 0) ** 2 + math.log(3) ** 2) / 2
    assert torch.allclose(router_z_loss(logits), expected)


# ----------------------------------------------------------------------------- the layer
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=1, activation="gelu"),
        dict(top_k=2, activation="swiglu"),
        dict(top_k=2, activation="swiglu", shared_hidden_dim=8),
        dict(top_k=3, activation="gelu", normalize_top_k=False),
    ],
)
def test_layer_equals_token_by_token_definition_forward_and_backward(kwargs):
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, balance_loss_weight=0.1, z_loss_weight=0.01, **kwargs)
    x = torch.randn(3, 5, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(xa)
    out.pow(2).sum().backward()  # the aux gradient is attached automatically
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    ref = naive_moe(layer, xb)
    assert torch.allclose(out, ref, atol=1e-6)
    (ref.pow(2).sum() + naive_aux(layer, xb)).backward()  # the explicit objective
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)


def test_aux_loss_value_and_grad_scale():
    torch.manual_seed(0)
    model = nn.Sequential(MoE(8, 16, 4, z_loss_weight=0.01), MoE(8, 16, 4))
    x = torch.randn(2, 6, 8)
    a0, a1 = naive_aux(model[0], x), naive_aux(model[1], model[0](x).detach())
    model[0].pop_aux_loss(), model[1].pop_aux_loss()  # drop the extra forward just made
    model(x)
    value = aux_loss(model)
    assert not value.requires_grad
    assert torch.allclose(value, (a0 + a1).detach(), atol=1e-6)
    assert aux_loss(model).item() == 0.0  # consumed
    # Two forwards (microbatches) -> each layer contributes its mean.
    model(x[:1]), model(x[1:])
    half = naive_aux(model[0], x[:1]) + naive_aux(model[0], x[1:])
    value = aux_loss(model[0])
    assert torch.allclose(value, half.detach() / 2, atol=1e-6)
    # The attached gradient follows `aux_loss_grad_scale` (ParaStrategy: loss scale / accumulation).
    layer = MoE(8, 16, 4, balance_loss_weight=0.5)
    for scale in (1.0, 4.0):
        layer.zero_grad()
        set_aux_loss_grad_scale(layer, scale)
        layer(x).sum().backward()
        g_scaled = layer.router.weight.grad.clone()
        layer.zero_grad()
        set_aux_loss_grad_scale(layer, 0.0)
        layer(x).sum().backward()
        g_task = layer.router.weight.grad.clone()
        layer.zero_grad()
        naive_aux(layer, x).backward()
        torch.testing.assert_close(g_scaled - g_task, scale * layer.router.weight.grad, rtol=1e-4, atol=1e-7)


def test_sequence_scope_is_invariant_to_splitting_the_batch():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    for scope, invariant in (("sequence", True), ("batch", False)):
        layer = MoE(8, 16, 4, top_k=1, balance_scope=scope)
        layer(x)
        whole = layer.pop_stats().balance_loss
        layer(x[:2]), layer(x[2:])
        halves = layer.pop_stats().balance_loss  # mean over the two forwards
        assert math.isclose(whole, halves, rel_tol=1e-6) is invariant


def test_capacity_drops_overflow_and_reports_fraction():
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, top_k=1, capacity_factor=1.0, shared_hidden_dim=8)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 50.0  # every token with x[0] > 0 picks expert 0
    x = torch.randn(2, 8, 8)
    x[..., 0] = x[..., 0].abs() + 0.1
    out = layer(x)
    tokens = 16
    capacity = expert_capacity(tokens, 4, 1.0, 1)  # 4
    stats = layer.pop_stats()
    assert stats.tokens_per_expert == [16, 0, 0, 0]
    assert stats.dropped_fraction == pytest.approx((tokens - capacity) / tokens)
    keep = capacity_keep_mask(torch.zeros(tokens, 1, dtype=torch.long), 4, capacity)
    assert torch.allclose(out, naive_moe(layer, x, keep), atol=1e-6)
    # A dropped token gets only the shared expert here; the block's residual carries it on.
    flat_out, flat_x = out.reshape(-1, 8), x.reshape(-1, 8)
    assert torch.allclose(flat_out[capacity:], layer.shared_expert(flat_x[capacity:]), atol=1e-6)


def test_activation_checkpoint_recompute_is_not_counted_twice():
    torch.manual_seed(0)
    layer = MoE(8, 16, 4)
    x = torch.randn(2, 4, 8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    g_ckpt = layer.router.weight.grad.clone()
    stats_ckpt = layer.pop_stats()
    layer.zero_grad()
    layer(x).sum().backward()
    assert torch.allclose(g_ckpt, layer.router.weight.grad, atol=1e-7)
    assert sum(stats_ckpt.tokens_per_expert) == 2 * 4 * 2  # one forward's assignments, not two


def test_paused_forward_records_nothing():
    layer = MoE(8, 16, 4)
    with moe_stats_paused(nn.Sequential(layer)):
        layer(torch.randn(2, 3, 8))  # e.g. a pipeline's shape inference
    assert layer.pop_stats() is None
    layer(torch.randn(2, 3, 8))
    assert layer.pop_stats() is not None


def test_eval_forward_records_nothing():
    layer = MoE(8, 16, 4).eval()
    with torch.no_grad():
        layer(torch.randn(2, 3, 8))
    assert layer.pop_stats() is None and aux_loss(layer).item() == 0.0


# ----------------------------------------------------------------------------- bad input
def test_expert_bias_selects_experts_but_leaves_the_gates():
    """Forward and backward equal the definition with a bias that forces expert 0 in and expert 3 out."""
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, top_k=2, bias_update_rate=0.01)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([2.0, 0.0, 0.0, -2.0]))
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = layer(x)
    torch.testing.assert_close(out, naive_moe(layer, x), rtol=1e-5, atol=1e-6)
    assert layer.expert_load[0] == 10 and layer.expert_load[3] == 0
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()  # the bias is checkpointed


def test_expert_bias_evens_a_skewed_load_without_an_aux_loss():
    """The trend, on one device: 40 updates (rate 0.01) take a skewed router's max/mean load on a fixed batch
    from 1.79 to an oscillation between 1.09 and 1.17 (sign updates overshoot by one step); nothing but the
    bias changes."""
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, top_k=2, balance_loss_weight=0.0, bias_update_rate=0.01)
    with torch.no_grad():
        layer.router.weight[0] += 0.5
    x = torch.randn(8, 64, 8) + 0.5

    def imbalance() -> float:
        with torch.no_grad():
            layer(x)
        stats = layer.pop_stats()
        update_expert_bias([layer])
        return stats.load_imbalance

    loads = [imbalance() for _ in range(40)]
    assert loads[0] >= 1.5 and max(loads[-10:]) <= 1.2 and min(loads[-10:]) <= 1.1, loads


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=4, top_k=5), "top_k=5"),
        (dict(num_experts=4, top_k=0), "top_k=0"),
        (dict(num_experts=4, capacity_factor=0.0), "capacity_factor=0.0"),
        (dict(num_experts=4, capacity_factor=-1), "capacity_factor=-1"),
        (dict(num_experts=0), "num_experts=0"),
        (dict(num_experts=4, activation="relu"), "activation='relu'"),
        (dict(num_experts=4, balance_scope="global"), "balance_scope"),
        (dict(num_experts=4, bias_update_rate=-0.1), "bias_update_rate=-0.1"),
    ],
)
def test_bad_layer_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(8, 16, **kwargs)


class _Lit(L.LightningModule):
    def __init__(self, experts: int):
        super().__init__()
        self.block = MoE(8, 16, experts) if experts else nn.Linear(8, 8)


def test_bad_expert_parallel_layouts():
    dims = ParallelDims(pp=1, dp=4, tp=1, ep=4, world_size=4)  # no mesh: errors come before any collective
    with pytest.raises(ValueError, match=r"ep=4.*num_experts=6.*Choose ep in \[1, 2\]"):
        check_expert_layout(_Lit(6), dims.ep, dims.dp)
    with pytest.raises(ValueError, match="no `lightning_para.moe.MoE`"):
        check_expert_layout(_Lit(0), dims.ep, dims.dp)
    with pytest.raises(ValueError, match="ep=3.*must divide.*dp=4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ValueError, match="ep=4.*must divide.*dp=2"):
        ParallelConfig(tp=2, ep=4).resolve_dp(4)


# ----------------------------------------------------------------------------- grouped experts
def _expert_outputs(layer: MoE, x: torch.Tensor, implementation: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layer.experts.implementation = implementation
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a contiguous, non-uniform grad
    return out.detach(), [x.grad, *(p.grad.clone() for p in layer.parameters())]


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_experts_equal_the_loop(capacity_factor, activation):
    """One grouped kernel per weight (grouped_mm, or padded bmm) gives the loop's outputs and
    gradients within 1e-6, with capacity drops and with experts that receive no rows."""
    torch.manual_seed(0)
    layer = MoE(16, 32, 6, top_k=2, activation=activation, capacity_factor=capacity_factor)
    with torch.no_grad():
        layer.router.weight[3:].mul_(-50)  # experts 3..5 get (almost) no tokens: uneven and empty groups
    x = torch.randn(2, 9, 16)
    loop_out, loop_grads = _expert_outputs(layer, x, "loop")
    for implementation in ("grouped_mm", "bmm", "auto"):
        out, grads = _expert_outputs(layer, x, implementation)
        torch.testing.assert_close(out, loop_out, rtol=1e-6, atol=1e-6)
        for g, ref in zip(grads, loop_grads):
            torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)


def test_grouped_linear_bad_input():
    from lightning_para.moe.grouped import grouped_linear

    with pytest.raises(ValueError, match="implementation='fast'.*Choose one of"):
        grouped_linear(torch.zeros(2, 4), torch.zeros(2, 4, 4), [1, 1], "fast")
    with pytest.raises(ValueError, match="3 row counts for 2 experts"):
        grouped_linear(torch.zeros(2, 4), torch.zeros(2, 4, 4), [1, 1, 0])
    with pytest.raises(ValueError, match="implementation='fast'"):
        MoE(8, 16, 4).experts.__class__(8, 16, 4, implementation="fast")
    with pytest.raises(ValueError, match=r"needs the expert widths \(6 -> 4\) to be whole multiples of 16 bytes"):
        grouped_linear(torch.zeros(2, 6), torch.zeros(2, 6, 4), [1, 1], "grouped_mm")


@pytest.mark.parametrize("implementation", ["grouped_mm", "bmm", "loop", "auto"])
def test_grouped_experts_without_rows_stay_in_the_graph(implementation):
    """A rank whose experts receive no token must still run backward through them: expert
    parallelism's backward all-to-all hangs behind the experts' input on every rank."""
    from lightning_para.moe.grouped import grouped_linear

    x = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(3, 8, 4, requires_grad=True)
    out = grouped_linear(x, weight, [0, 0, 0], implementation)
    assert out.shape == (0, 4) and out.grad_fn is not None
    out.backward(torch.zeros_like(out))
    assert x.grad is not None and x.grad.shape == (0, 8)
    assert weight.grad is not None and not weight.grad.any()


def test_grouped_mm_is_used_where_it_runs():
    from lightning_para.moe.grouped import grouped_mm_supported

    if hasattr(torch.nn.functional, "grouped_mm"):  # torch >= 2.13 runs it on CPU in fp32
        assert grouped_mm_supported(torch.device("cpu"), torch.float32)
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64)


@pytest.mark.parametrize("first_call", ["checkpointed", "no_grad"])
def test_grouped_mm_probe_inside_checkpoint_or_no_grad(monkeypatch, first_call):
    """The one-time grouped_mm probe runs a tiny backward. Its first call inside a block under torch's
    composable activation checkpoint (`activation_checkpointing="full"`) turned that backward into a
    recomputation of the block (a bare AssertionError); under no_grad (validation first) it failed and
    marked grouped_mm unsupported for good. Issue 23 (the DeepSeek-V3 dry run with full recomputation)."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    from lightning_para.moe import grouped

    monkeypatch.setattr(grouped, "_SUPPORT", {})
    torch.manual_seed(0)
    block = nn.Sequential(MoE(16, 32, 4, 2))
    x = torch.randn(2, 4, 16, requires_grad=True)
    if first_call == "no_grad":
        with torch.no_grad():
            block(x)
    else:
        composable_checkpoint(block[0])
        block(x).sum().backward()
        assert x.grad is not None
    if hasattr(F, "grouped_mm"):
        assert grouped._SUPPORT[("cpu", torch.float32)]


def test_balanced_routing_is_a_scoped_switch():
    """The dry run's balanced routing (issue 23): token t's j-th choice is expert (t k + j) mod E, every expert
    gets T k / E rows, the real experts run on those rows, and the switch is off again outside the context."""
    from lightning_para.moe import balanced_assignment, balanced_routing

    indices, counts = balanced_assignment(5, 2, 4, torch.device("cpu"))
    assert indices.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]] and counts == [3, 3, 2, 2]
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, 2)
    x = torch.randn(1, 5, 8)
    with balanced_routing(layer):
        assert layer.balanced_routing
        out = layer(x)
    assert not layer.balanced_routing and layer.pop_stats() is None  # fixed routing records no statistics
    # The definition: gate-weighted experts (t k + j) mod E, the gates the router's renormalized probabilities.
    tokens = x.reshape(-1, 8)
    probs = layer.router(tokens).softmax(-1).gather(-1, indices)
    gates = probs / probs.sum(-1, keepdim=True)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    expected = torch.stack([
        sum(gates[t, j] * ((F.silu(tokens[t] @ w1[e]) * (tokens[t] @ w3[e])) @ w2[e]) for j, e in enumerate(indices[t].tolist()))
        for t in range(5)
    ])
    torch.testing.assert_close(out.reshape(5, 8), expected, rtol=1e-5, atol=1e-6)


def test_balance_experts_on_litgpt_llama_moe():
    """LitGPT's ``LLaMAMoE`` with a zero bias routes exactly as LitGPT's own forward; a bias that forces expert 0
    in changes the selection only (its gate is the softmax over the chosen experts' unbiased logits)."""
    litgpt = pytest.importorskip("litgpt")
    from lightning_para.parallel.expert import balance_experts

    torch.manual_seed(0)
    config = litgpt.Config(n_embd=16, n_expert=4, n_expert_per_token=2, moe_intermediate_size=24, bias=False,
                           mlp_class_name="LLaMAMoE", intermediate_size=24, padded_vocab_size=32, n_layer=1, n_head=2)
    block = litgpt.model.LLaMAMoE(config)
    x = torch.randn(2, 5, 16)
    expected = block(x)
    assert balance_experts(block, 0.01) == 1
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        block.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
    block.expert_load.zero_()
    out = block(x)
    assert block.expert_load[0] == 10 and block.expert_load.sum() == 20
    logits = block.gate(x.reshape(-1, 16))
    chosen = torch.cat([torch.zeros(10, 1, dtype=torch.long), (logits[:, 1:]).topk(1).indices + 1], 1)
    gates = logits.gather(1, chosen).softmax(1)
    manual = sum(gates[:, j:j + 1] * torch.stack([block.experts[e](r) for e, r in zip(chosen[:, j], x.reshape(-1, 16))])
                 for j in range(2))
    torch.testing.assert_close(out.reshape(-1, 16), manual, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="balance_experts"):
        balance_experts(nn.Linear(2, 2), 0.01)
