"""Context-parallel attention on real gloo groups: parity with one-process SDPA, methods, mode, errors.

Every rank builds the same full q, k, v (same seed), keeps its sequence shard
(``shard_sequence``, dim 2), runs context-parallel attention and backward with its shard of one
random output gradient, and all-gathers output and input gradients back to natural order.
They must equal ``F.scaled_dot_product_attention`` on the whole sequence in one process.

Tolerance: 1e-5 relative to the largest reference magnitude (the brief's bound). fp32 with the
same math in a different summation order measures ~1e-7 (see the error values returned).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_para.parallel.context import (
    ContextParallelSDPA,
    context_parallel_attention,
    position_ids_for_rank,
    shard_sequence,
    unshard_sequence,
)
from tests.comm_counter import CollectiveCounter
from tests.sharpness import SHARP_STD, reinit_normal

RTOL = 1e-5  # relative to max |reference|; fp32 reorderings give ~1e-7

# --------------------------------------------------------------------------- helpers (run on ranks)
_GROUPS: dict[tuple, Optional[dist.ProcessGroup]] = {}


def _cp_group(layout: Optional[tuple[tuple[int, ...], ...]]) -> Optional[dist.ProcessGroup]:
    """``None``: the whole world is the cp group; otherwise this rank's group in ``layout``.

    ``new_group`` is collective over the world, so every rank creates every group, once per pool.
    """
    if layout is None:
        return None
    if layout not in _GROUPS:
        for ranks in layout:
            group = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                _GROUPS[layout] = group
    return _GROUPS[layout]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def _inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g)
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=g)
    return q, k, v, grad_out


def attention_parity_job(
    method: str,
    is_causal: bool,
    load_balance: bool,
    heads: int = 4,
    kv_heads: int = 4,
    seq: int = 16,
    scale: Optional[float] = None,
    layout: Optional[tuple] = None,
    count: bool = False,
    tile_bytes: Optional[int] = None,
) -> dict:
    if tile_bytes is not None:  # ring attention's score tiles, made small enough to split every chunk pair
        from lightning_para.spec import tiles  # the one source the ring reads its tiles from

        previous, tiles.SCORE_TILE_BYTES = tiles.SCORE_TILE_BYTES, tile_bytes
        try:
            return attention_parity_job(method, is_causal, load_balance, heads, kv_heads, seq, scale, layout, count)
        finally:
            tiles.SCORE_TILE_BYTES = previous
    group = _cp_group(layout)
    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad_out = _inputs(2, heads, kv_heads, seq, 8)

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    gqa = heads != kv_heads
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    ref.backward(grad_out)

    local = [shard_sequence(t, cp_rank, cp, dim=2, load_balance=load_balance).requires_grad_() for t in (q, k, v)]
    counter = CollectiveCounter()
    with counter:
        out = context_parallel_attention(
            *local, group=group, method=method, is_causal=is_causal, scale=scale, load_balance=load_balance
        )
    forward_calls = [kind for kind, _, _ in counter.calls]
    counter = CollectiveCounter()
    with counter:
        out.backward(shard_sequence(grad_out, cp_rank, cp, dim=2, load_balance=load_balance))
    backward_calls = [kind for kind, _, _ in counter.calls]

    def full(t):
        return unshard_sequence(t, group, dim=2, load_balance=load_balance)

    errors = {
        "out": _rel(full(out), ref),
        "dq": _rel(full(local[0].grad), ref_q.grad),
        "dk": _rel(full(local[1].grad), ref_k.grad),
        "dv": _rel(full(local[2].grad), ref_v.grad),
    }
    result = {"cp": cp, "errors": errors, "local_seq": out.shape[2]}
    if count:
        result["forward"] = {kind: forward_calls.count(kind) for kind in set(forward_calls)}
        result["backward"] = {kind: backward_calls.count(kind) for kind in set(backward_calls)}
    return result


def methods_agree_job(is_causal: bool, load_balance: bool) -> float:
    cp, cp_rank = dist.get_world_size(), dist.get_rank()
    q, k, v, _ = _inputs(1, 4, 4, 16, 8, seed=1)
    local = [shard_sequence(t, cp_rank, cp, dim=2, load_balance=load_balance) for t in (q, k, v)]
    outs = [
        context_parallel_attention(*local, method=m, is_causal=is_causal, load_balance=load_balance)
        for m in ("ring", "all_to_all")
    ]
    return _rel(outs[0], outs[1])


class TinyAttention(nn.Module):
    """A GPT-style attention block that knows nothing of context parallelism: it calls SDPA."""

    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2, max_len: int = 32) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.pos = nn.Embedding(max_len, dim)  # learned positions: needs global position ids
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        # Sharp (tests/sharpness.py): PyTorch's default init attends ~uniformly; with head_dim 4, std 0.3
        # still leaves the attention entropy at 0.77 of uniform, 0.5 brings it to 0.39.
        reinit_normal(self, 0.5)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = x + self.pos(position_ids)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def mode_parity_job(method: str) -> dict:
    cp, cp_rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = TinyAttention()
    x, target = torch.randn(2, 16, 16), torch.randn(2, 16, 16)

    ref_out = model(x, torch.arange(16).expand(2, 16))
    (ref_out * target).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    positions = position_ids_for_rank(16, cp_rank, cp).expand(2, -1)
    with ContextParallelSDPA(method=method) as mode:
        out = model(shard_sequence(x, cp_rank, cp), positions)
    (out * shard_sequence(target, cp_rank, cp)).sum().backward()
    errors = {"out": _rel(unshard_sequence(out), ref_out.detach())}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # each rank's loss covers its tokens: the sum over cp is the full gradient
        errors[name] = _rel(p.grad, ref_grads[name])
    return {"calls": mode.calls, "errors": errors}


def llama_parity_job(method: str) -> dict:
    """A tiny HF Llama (attn_implementation="sdpa", GQA, RoPE) run unchanged under the mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cp, cp_rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
        initializer_range=SHARP_STD,  # sharp (tests/sharpness.py): at 0.02 wrong positions barely show
    )
    model = LlamaForCausalLM(config)
    ids, weight = torch.randint(0, 64, (2, 16)), torch.randn(2, 16, 64)

    ref = model(ids, use_cache=False).logits
    (ref * weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # RoPE needs global positions: HF would otherwise number the local tokens 0..7 on every rank.
    # Head-tail positions jump (0,1,2,3,12,...), which HF reads as packed sequences and answers
    # with an explicit block mask unless a 2-D attention_mask is given: all ones, no padding,
    # lets HF drop the mask and call SDPA with is_causal=True.
    local_ids = shard_sequence(ids, cp_rank, cp)
    positions = position_ids_for_rank(16, cp_rank, cp).expand(2, -1)
    with ContextParallelSDPA(method=method) as mode:
        logits = model(
            local_ids, position_ids=positions, attention_mask=torch.ones_like(local_ids), use_cache=False
        ).logits
    (logits * shard_sequence(weight, cp_rank, cp)).sum().backward()
    errors = {"logits": _rel(unshard_sequence(logits), ref)}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        errors[name] = _rel(p.grad, ref_grads[name])
    return {"calls": mode.calls, "errors": errors}


def bad_inputs_job() -> dict:
    """Each case must raise ValueError before any collective, identically on every rank."""
    cp = dist.get_world_size()
    good = torch.randn(1, 4, 4, 8)
    cases = {
        "method": lambda: context_parallel_attention(good, good, good, method="flash"),
        "gqa": lambda: context_parallel_attention(good, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)),
        "odd_local_seq": lambda: context_parallel_attention(*(torch.randn(1, 4, 3, 8),) * 3, is_causal=True),
        "ulysses_heads": lambda: context_parallel_attention(*(torch.randn(1, 3, 4, 8),) * 3, method="all_to_all"),
        "ulysses_kv_heads": lambda: context_parallel_attention(
            good, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), method="all_to_all"
        ),
        "cross_attention": lambda: context_parallel_attention(good, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)),
        "three_d": lambda: context_parallel_attention(good[0], good[0], good[0]),
        "shard_length": lambda: shard_sequence(torch.randn(1, 6), dist.get_rank(), cp),
    }
    with ContextParallelSDPA():
        mask = torch.ones(4, 4, dtype=torch.bool)
        cases["mode_mask"] = lambda: F.scaled_dot_product_attention(good, good, good, attn_mask=mask)
        cases["mode_dropout"] = lambda: F.scaled_dot_product_attention(good, good, good, dropout_p=0.1)
        results = {}
        for name, case in cases.items():
            try:
                case()
                results[name] = "no error"
            except ValueError as err:
                results[name] = f"ValueError: {err}"
            except Exception as err:  # noqa: BLE001 - report, the test fails on it
                results[name] = f"{type(err).__name__}: {err}"
    dist.barrier()  # nothing half-started: the group still works
    return results


# --------------------------------------------------------------------------- tests (world size 2 first, then 4)
def _check(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name, err in result["errors"].items():
            assert err < RTOL, f"rank {rank}: {name} relative error {err:.2e} >= {RTOL}"


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize(
    "is_causal,load_balance,heads,kv_heads",
    [(True, True, 4, 4), (True, False, 4, 4), (False, True, 4, 4), (True, True, 4, 2), (False, False, 8, 2)],
    ids=["causal-balanced", "causal-contiguous", "full-balanced", "causal-balanced-gqa", "full-contiguous-gqa"],
)
def test_cp2_matches_full_sdpa(pools, method, is_causal, load_balance, heads, kv_heads):
    results = pools.get(2).run(attention_parity_job, method, is_causal, load_balance, heads, kv_heads)
    _check(results)


@pytest.mark.parametrize("is_causal,load_balance,heads,kv_heads", [(True, True, 4, 4), (True, False, 4, 2), (False, True, 4, 2)])
def test_cp2_ring_in_row_tiles_matches_full_sdpa(pools, is_causal, load_balance, heads, kv_heads):
    """Ring attention computes each chunk pair's scores in tiles of query rows (`spec.tiles.SCORE_TILE_BYTES`): with
    3-row tiles of 8-row chunks (32 tokens over cp=2, load-balanced; 16-row chunks contiguous) the diagonal's
    mask, the tiles' concatenation and the dK/dV sums over tiles still give full SDPA."""
    from lightning_para.spec.tiles import score_tile_rows

    chunk = 32 // 2 // (2 if load_balance else 1)
    tile_bytes = 3 * 4 * 2 * heads * chunk  # three rows of [batch 2, heads, rows, chunk] fp32 scores
    assert score_tile_rows(2, heads, chunk) == chunk  # whole chunks by default: the budget is 256 MiB
    results = pools.get(2).run(attention_parity_job, "ring", is_causal, load_balance, heads, kv_heads, 32,
                               tile_bytes=tile_bytes)
    _check(results)


def test_cp2_custom_scale(pools):
    for method in ("ring", "all_to_all"):
        _check(pools.get(2).run(attention_parity_job, method, True, True, scale=0.3))


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_cp1_groups_are_plain_attention(pools, method):
    """A cp group of one rank (each rank its own group): no communication, same result."""
    results = pools.get(2).run(attention_parity_job, method, True, True, 4, 2, 16, None, ((0,), (1,)), True)
    assert {r["cp"] for r in results} == {1}
    _check(results)
    for r in results:
        assert sum(r["forward"].values()) == 0 and sum(r["backward"].values()) == 0


@pytest.mark.parametrize("is_causal", [True, False])
def test_cp2_ring_and_all_to_all_agree(pools, is_causal):
    assert max(pools.get(2).run(methods_agree_job, is_causal, True)) < RTOL


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_sdpa_mode_runs_an_unchanged_module(pools, method):
    results = pools.get(2).run(mode_parity_job, method)
    assert [r["calls"] for r in results] == [1, 1]
    _check(results)


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_sdpa_mode_runs_hf_llama_unchanged(pools, method):
    pytest.importorskip("transformers")
    results = pools.get(2).run(llama_parity_job, method)
    assert [r["calls"] for r in results] == [2, 2]  # one SDPA call per layer
    _check(results)


def test_bad_inputs_raise_value_error_on_every_rank(pools):
    results = pools.get(2).run(bad_inputs_job)
    assert results[0] == results[1]
    expected = {
        "method": "choose one of ['all_to_all', 'ring']",
        "gqa": "choose num_kv_heads in [1, 2, 4]",
        "odd_local_seq": "2*cp=4 does not divide the sequence length 6",
        "ulysses_heads": "num_heads=3 is not divisible by cp=2; choose cp in [1, 3]",
        "ulysses_kv_heads": "num_kv_heads=1 is not divisible by cp=2; choose cp in [1]",
        "cross_attention": "same local sequence length",
        "three_d": "must be 4-D",
        "shard_length": "choose cp in [1, 3]",
        "mode_mask": "attn_mask=None",
        "mode_dropout": "dropout_p=0.1",
    }
    for name, fragment in expected.items():
        assert results[0][name].startswith("ValueError") and fragment in results[0][name], (name, results[0][name])


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("is_causal,load_balance", [(True, True), (True, False), (False, True)])
def test_cp4_matches_full_sdpa_and_counts_collectives(pools, method, is_causal, load_balance):
    results = pools.get(4).run(attention_parity_job, method, is_causal, load_balance, 4, 4, 16, None, None, True)
    _check(results)
    c = 4
    for r in results:
        if method == "ring":
            # Forward: 2(c-1) K/V receives (c-1 K, c-1 V). Backward: 2(c-1) K/V + 2c dK/dV receives.
            assert r["forward"] == {"send": 2 * (c - 1), "recv": 2 * (c - 1)}
            assert r["backward"] == {"send": 4 * c - 2, "recv": 4 * c - 2}
        else:
            # Ulysses: q, k, v and out forward; their reverses backward.
            assert r["forward"] == {"all_to_all": 4}
            assert r["backward"] == {"all_to_all": 4}


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_cp2_subgroups_of_world4_with_gqa(pools, method):
    """Two cp groups {0, 2} and {1, 3}: ring neighbours and all-to-all peers are group ranks."""
    results = pools.get(4).run(attention_parity_job, method, True, True, 4, 2, 16, None, ((0, 2), (1, 3)))
    assert {r["cp"] for r in results} == {2}
    _check(results)
