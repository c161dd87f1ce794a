"""The default tier's multi-process checks: one parity run per dimension and per composition family.

``pytest -q`` (the default, <= 5 minutes on 2 cores) runs the unit tests plus this module; every
other multi-process module is marked ``slow`` by ``tests/conftest.py`` and runs in the full suite
(``pytest -q -m ""``, CI). Each check below *calls* the full suite's test of that layout, so the
assertions (losses within 1e-5 relative of one device, parameters, and what else that test checks)
are exactly the full suite's, with no second copy to drift.

The world-2 checks come first, then the world-4 ones: the pool manager keeps one pool alive, so
grouping by world size spawns each size once.
"""

from __future__ import annotations

from tests.distributed.test_context_parallel_any_model import test_cp2_ring_plain_hf_llama_matches_one_device as _cp_hf
from tests.distributed.test_context_parallel_training import LAYOUTS_4, gpt
from tests.distributed.test_context_parallel_training import test_cp2_composes_parity as _cp_composed
from tests.distributed.test_context_parallel_training import test_cp2_parity_gpt_recipe as _cp
from tests.distributed.test_data_parallel import test_parity_two_processes as _dp
from tests.distributed.test_document_masks import GPT_LAYOUTS
from tests.distributed.test_document_masks import test_gpt_recipe_with_documents_matches_one_device as _documents
from tests.distributed.test_expert_parallel import test_ep2_dp4_parity_and_expert_data_parallel_groups as _ep_dp
from tests.distributed.test_fabric import test_fabric_loop_matches_one_device as _fabric
from tests.distributed.test_expert_parallel import test_ep2_parity_memory_and_communication as _ep
from tests.distributed.test_hybrid_sharding import test_hsdp_parity as _hsdp
from tests.distributed.test_pipeline_parallel import test_pp2_dp2_zero1_matches_single_device as _pp_dp
from tests.distributed.test_planted_bugs import test_cp_positions_shifted_by_one_fail_parity as _planted
from tests.distributed.test_pipeline_parallel import test_pp2_schedules_match_single_device as _pp
from tests.distributed.test_pipeline_parallel import test_pp2_tp2_matches_single_device as _pp_tp
from tests.distributed.test_tensor_parallel import test_dp2_tp2_parity_with_clipping_and_memory as _dp_tp
from tests.distributed.test_tensor_parallel import test_tp2_sequence_parallel_parity_with_clipping as _tp_sp
from tests.distributed.test_transformers import test_llama_two_ranks as _hf

# Read by tests/conftest.py: this module is not marked slow.
DEFAULT_TIER = True


# ----------------------------------------------------------------------------- one dimension (2 processes)
def test_data_parallel_zero1_with_accumulation(pools):
    _dp(pools, zero=1, accumulate=2)


def test_data_parallel_zero3(pools):
    _dp(pools, zero=3, accumulate=1)


def test_tensor_parallel_with_sequence_parallel(pools):
    _tp_sp(pools)


def test_pipeline_parallel_1f1b(pools):
    _pp(pools, layout={"schedule": "1f1b"}, variant="accumulate")


def test_expert_parallel(pools):
    _ep(pools)


def test_context_parallel_ring(pools):
    _cp(pools, method="ring", model=gpt)


def test_context_parallel_transformers_llama_without_hook(pools):
    _cp_hf(pools)


def test_transformers_llama_tensor_parallel(pools):
    _hf(pools, kwargs={"tp": 2, "sequence_parallel": True})


def test_litgpt_gqa_tensor_and_sequence_parallel(pools):
    """A LitGPT grouped-query model under tp=2 + SP: the fused qkv blocks and the per-module head counts."""
    import pytest

    pytest.importorskip("litgpt")
    from tests.distributed.test_litgpt import test_litgpt_gqa_two_ranks

    test_litgpt_gqa_two_ranks(pools, "tp2-sp")


def test_context_parallel_ring_with_document_masks(pools):
    """Packed documents: ring attention masks each K/V block by the global document ids (losses and logits)."""
    _documents(pools, *GPT_LAYOUTS[2])


def test_planted_position_bug_fails_parity(pools):
    """The parity check can fail: cp positions shifted by one (tests/distributed/test_planted_bugs.py)."""
    _planted(pools)


def test_fabric_front_end_tp2_sequence_parallel(pools):
    """Fabric's ParaStrategy: the LitGPT-style loop (accumulation, clipping) under tp2 + SP."""
    _fabric(pools, "recipe", {"tp": 2, "sequence_parallel": True})


# ----------------------------------------------------------------------------- compositions (4 processes)
def test_dp2_tp2_zero3(pools):
    _dp_tp(pools, zero=3)


def test_pp2_tp2(pools):
    _pp_tp(pools, variant="plain")


def test_pp2_dp2_zero1(pools):
    _pp_dp(pools, variant="accumulate")


def test_cp2_tp2(pools):
    kwargs, dp_groups, params = LAYOUTS_4[0]
    _cp_composed(pools, kwargs, dp_groups, params)


def test_hybrid_sharding_zero3(pools):
    _hsdp(pools, zero=3)


def test_ep2_dp4(pools):
    _ep_dp(pools, zero=1)
