"""Context parallelism for any model, never silently wrong (issue 24, item 1).

* A Hugging Face ``LlamaForCausalLM`` in an ordinary LightningModule (``self.model(input_ids=x).logits``
  and ``F.cross_entropy``: no position ids, no mask, no hook; ``initializer_range=0.3``, GQA, SDPA)
  matches one device under ``cp=2`` ring, ``cp=2`` all-to-all and ``cp2 x tp2``: every step's loss
  within 1e-5 relative (fp32) and the parameters after training. The transformers adapter gives
  the model its global positions (``integrations/transformers/context.py``).
* The same with right padding (a 2-D ``attention_mask`` with zeros, ``-100`` labels), and with the
  model's own loss (``labels=``: the shift crosses the chunks).
* A model whose positions the strategy cannot supply (learned positions of ``arange(x.shape[1])``,
  no hook) stops at the first step with an error naming the hooks (``parallel/context/check.py``).
* The parity tool reports "match" for the plain module under cp=2 and "mismatch" for a planted
  position bug (positions off by one, with the first-step check turned off).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.cp_models import (
    LearnedPositionsLM,
    OwnLossHFLlama,
    PaddedHFLlama,
    PlainHFLlama,
    own_loss_tokens,
    padded_tokens,
)
from tests.harness import WorkerError
from tests.parity import assert_losses_close, assert_params_close, fit_job, fit_reference, mean_over_dp
from tests.tp_models import token_dataset


GLOBAL_BATCH = 8
STEPS = 5
CLIP = {"gradient_clip_val": 1.0}
# Parameters after SGD steps (tests/cp_models.py): fp32 reordering only; 1e-5 absolute.
PARAM_ATOL = 1e-5

_references: dict = {}


def reference(model, dataset) -> dict:
    key = (model, dataset)
    if key not in _references:
        _references[key] = fit_reference(model, dataset, GLOBAL_BATCH, STEPS, CLIP)
    return _references[key]


def check(results: list[dict], ref: dict, dp_groups: list[list[int]]) -> float:
    """Every cp/tp peer reports the same losses, their dp mean is one device's, and so are the
    parameters. Returns the largest relative loss difference (for the report)."""
    for group in dp_groups:
        for r in group[1:]:
            assert results[r]["losses"] == results[group[0]]["losses"], (group, r)
    losses = mean_over_dp([r["losses"] for r in results], [[g[0] for g in dp_groups]])
    assert_losses_close(losses, ref["losses"])
    assert_params_close(results[0]["params"], ref["params"], atol=PARAM_ATOL)
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    print(f"max relative loss difference over {len(losses)} steps: {diff:.2e}")
    return diff


# ============================================================================ Hugging Face, no hook
def test_cp2_ring_plain_hf_llama_matches_one_device(pools):
    pytest.importorskip("transformers")
    results = pools.get(2).run(fit_job, PlainHFLlama, {"cp": 2}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1]])


@pytest.mark.slow
def test_cp2_all_to_all_plain_hf_llama_matches_one_device(pools):
    pytest.importorskip("transformers")
    kwargs = {"cp": 2, "cp_method": "all_to_all"}
    results = pools.get(2).run(fit_job, PlainHFLlama, kwargs, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1]])


@pytest.mark.slow
def test_cp2_tp2_plain_hf_llama_matches_one_device(pools):
    pytest.importorskip("transformers")
    results = pools.get(4).run(fit_job, PlainHFLlama, {"cp": 2, "tp": 2}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1, 2, 3]])


@pytest.mark.slow
def test_cp2_hf_llama_own_loss_shifts_labels_across_chunks(pools):
    """``labels=input_ids`` with a fifth ``-100``: transformers' shift must cross the chunk boundaries."""
    pytest.importorskip("transformers")
    results = pools.get(2).run(fit_job, OwnLossHFLlama, {"cp": 2}, own_loss_tokens, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(OwnLossHFLlama, own_loss_tokens), [[0, 1]])


# ============================================================================ a model cp cannot fix
@pytest.mark.slow
def test_cp2_learned_positions_without_hook_stop_with_an_error(pools):
    with pytest.raises(WorkerError) as err:
        pools.get(2).run(fit_job, LearnedPositionsLM, {"cp": 2}, token_dataset, GLOBAL_BATCH, 1, None, ("losses",))
    message = str(err.value)
    for rank in (0, 1):  # every rank stops, none hangs
        assert f"rank {rank}" in message.lower() or len(re.findall("would train a different model", message)) == 2
    assert "would train a different model" in message, message
    assert "set_context_parallel(self, shard)" in message and "context_parallel_batch(self, batch, shard)" in message
    # With the check off it trains, but wrong: what the check prevents.
    off = pools.get(2).run(
        fit_job, LearnedPositionsLM, {"cp": 2, "cp_check": False}, token_dataset, GLOBAL_BATCH, 2, None, ("losses",)
    )
    ref = fit_reference(LearnedPositionsLM, token_dataset, GLOBAL_BATCH, 2, None)
    off_by = abs(off[0]["losses"][0] - ref["losses"][0]) / ref["losses"][0]
    print(f"learned positions, cp=2 without the check: step-0 loss off by {off_by:.2e} (relative)")
    assert off_by > 1e-3


# ============================================================================ padding
@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [{"cp": 2}, {"cp": 2, "cp_method": "all_to_all"}, {"cp": 2, "activation_checkpointing": "full"}],
    ids=["ring", "all_to_all", "ring-recompute"],
)
def test_cp2_padded_hf_llama_matches_one_device(pools, kwargs):
    """Right padding: a 2-D ``attention_mask`` with zeros and ``-100`` labels; attention masks the padding keys
    (also when activation checkpointing recomputes attention in backward)."""
    pytest.importorskip("transformers")
    results = pools.get(2).run(fit_job, PaddedHFLlama, kwargs, padded_tokens, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PaddedHFLlama, padded_tokens), [[0, 1]])


def padded_attention_job(method: str) -> dict:
    """cp attention with key padding (left, right and inner padding, a fully padded row) against SDPA
    with the same boolean mask on the whole sequence: outputs and q/k/v gradients."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_para.parallel.context import context_parallel_attention, shard_sequence

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, h, hkv, s, d = 4, 4, 2, 16, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) * 2 for n in (h, hkv, hkv))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, 11:] = False  # right padding
    valid[1, :5] = False  # left padding: queries 0-4 see no key
    valid[2, 6:9] = False  # a hole
    valid[3, :] = False  # all padding
    out_grad = torch.randn(b, h, s, d, generator=g)
    mask = valid[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=True)
    ref.backward(out_grad)
    local = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, method=method, is_causal=True, key_valid=valid)
    out.backward(shard_sequence(out_grad, rank, cp, dim=2))

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    errors = {"out": rel(out.detach(), shard_sequence(ref.detach(), rank, cp, dim=2))}
    for name, t, f in zip("qkv", local, full):
        errors["d" + name] = rel(t.grad, shard_sequence(f.grad, rank, cp, dim=2))
    errors["finite"] = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t.grad).all()) for t in local)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_cp_attention_applies_key_padding_like_sdpa(pools, method):
    for errors in pools.get(2).run(padded_attention_job, method):
        print(method, errors)
        assert errors.pop("finite")
        assert max(errors.values()) < 1e-5, errors


# ============================================================================ the parity tool
REPO = Path(__file__).resolve().parents[2]
HF_DEMO = str(REPO / "recipes" / "hf-llama-cpu-demo.yaml")
# The demo's data (byte text, 64-token windows, global batch 16), a little of it; a plain module around
# the same tiny Llama (vocab 256, initializer_range 0.3) instead of the recipe's HFCausalLM.
PARITY_ARGS = ["--data.init_args.max_bytes", "100000", "--model.init_args.vocab", "256"]
PARITY_STEPS = 3
CP2 = {"cp": 2, "sequence_parallel": False}  # the demo's config has tp2 x pp2 with sequence parallelism


def record_job(layout: dict, extra: list[str]) -> dict:
    from lightning_para.cli.parity import run_layout
    from lightning_para.parity import strategy_arguments

    return run_layout(HF_DEMO, strategy_arguments(layout), steps=PARITY_STEPS, extra_args=extra).as_dict()


def _parity(pools, model: str, extra: list[str] = ()):
    from lightning_para.cli.parity import run_layout
    from lightning_para.parity import RunRecord, compare_records, strategy_arguments

    extra = ["--model", model, *PARITY_ARGS, *extra]
    run = RunRecord.from_dict(pools.get(2).run(record_job, CP2, extra)[0])
    return compare_records(run, run_layout(HF_DEMO, strategy_arguments(None), steps=PARITY_STEPS, extra_args=extra))


@pytest.mark.slow
def test_parity_tool_matches_plain_hf_llama_under_cp2(pools):
    pytest.importorskip("transformers")
    report = _parity(pools, "tests.cp_models.PlainHFLlama")
    print(report.text())
    assert report.verdict == "match", report.text()
    assert len(report.steps) == PARITY_STEPS


@pytest.mark.slow
def test_parity_tool_reports_a_planted_position_bug_under_cp2(pools):
    """Positions off by one under cp: with the first-step check on, training stops; with it off,
    the parity tool reports the mismatch from the first step."""
    pytest.importorskip("transformers")
    with pytest.raises(WorkerError, match="would train a different model"):
        pools.get(2).run(record_job, CP2, ["--model", "tests.cp_models.ShiftedPositionsHFLlama", *PARITY_ARGS])
    report = _parity(pools, "tests.cp_models.ShiftedPositionsHFLlama", ["--trainer.strategy.init_args.cp_check", "false"])
    print(report.text())
    assert report.verdict == "mismatch", report.text()
    assert report.first_mismatch.step == 0
