"""The LitGPT tensor-parallel plan and the fused-blocks row arithmetic, without communication."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litgpt")

from lightning_para.integrations.litgpt.checkpoint import to_litgpt_state  # noqa: E402
from lightning_para.parallel.tensor import plan_tensor_parallel  # noqa: E402
from lightning_para.parallel.tensor.columns import BlockRows, FusedBlocksColwise  # noqa: E402
from tests.litgpt_models import litgpt_config  # noqa: E402


def _gpt(**overrides):
    from litgpt.model import GPT

    return GPT(litgpt_config(**overrides))


def test_automatic_plan_gives_the_grouped_query_blocks():
    plan = plan_tensor_parallel(_gpt(), 2).by_name
    qkv = plan["transformer.h.0.attn.qkv"]
    assert isinstance(qkv, FusedBlocksColwise)
    # n_embd 64, 4 heads of 16, 2 query groups: [q 64 | k 32 | v 32], contiguous, whole heads per rank.
    assert qkv.rows == BlockRows((64, 32, 32), "contiguous") and qkv.unit == 16
    assert plan["transformer.h.0.attn"] == "attention" and plan["transformer.h.0.attn.proj"] == "rowwise"
    assert plan["transformer.h.0.mlp.fc_1"] == plan["transformer.h.0.mlp.fc_2"] == "colwise"
    assert plan["transformer.h.0.mlp.proj"] == "rowwise"
    assert plan["transformer.wte"] == "vocab_parallel" and plan["lm_head"] == "lm_head"


def test_tp_that_does_not_divide_the_query_groups_is_refused():
    with pytest.raises(ValueError, match=r"(?s)tp=4 does not divide.*config.n_query_groups.*= 2.*Choose tp in \[1, 2\]"):
        plan_tensor_parallel(_gpt(), 4)


def test_block_rows_rank_major_order():
    rows = BlockRows((4, 2, 2))
    assert rows.rank_ranges(1, 2) == [(2, 2), (5, 1), (7, 1)]
    assert rows.rank_major_order(2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    interleaved = BlockRows((2, 1, 1), "interleaved", groups=2)
    assert interleaved.rank_ranges(1, 2) == [(4, 4)]


def test_fused_blocks_check_names_the_problem():
    with pytest.raises(ValueError, match="add up to 96"):
        FusedBlocksColwise((64, 16, 16)).check("qkv", 128, 2)
    with pytest.raises(ValueError, match="whole units of 16"):
        FusedBlocksColwise((64, 16, 16), unit=16).check("qkv", 96, 2)
    with pytest.raises(ValueError, match="layout"):
        FusedBlocksColwise((1, 1), layout="strided")


def test_the_row_permutation_pair_and_consolidation_give_the_models_row_order():
    """Rank-major rows (rank 0's q, k, v slices, then rank 1's) and back; consolidation puts a sharded
    checkpoint's recorded parameters -- weights, fp32 masters, optimizer state -- in the model's order."""
    from lightning_para.checkpoint.consolidate import trainer_format
    from lightning_para.checkpoint.format import MASTER_KEY, ROW_ORDER_KEY
    from lightning_para.parallel.tensor.columns import reorder_rows

    order = ((8, 4, 4), 2)
    original = torch.arange(16.0).unsqueeze(1).repeat(1, 3)
    stored = reorder_rows(original, order, to_model=False)
    assert stored[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(reorder_rows(stored, order, to_model=True), original)
    entry = {"exp_avg": stored.reshape(-1), "step": torch.tensor(3.0), MASTER_KEY: 2 * stored.reshape(-1)}
    out = trainer_format({
        "state_dict": {"qkv.weight": stored, "proj.weight": stored}, ROW_ORDER_KEY: {"qkv.weight": order},
        "optimizer_0": {"state": {"qkv.weight": entry}, "param_groups": [{"lr": 1.0, "params": ["qkv.weight"]}]},
    })
    assert torch.equal(out["state_dict"]["qkv.weight"], 2 * original)  # the fp32 master, in the model's order
    assert torch.equal(out["state_dict"]["proj.weight"], stored)  # not recorded: left as it is
    assert torch.equal(out["optimizer_states"][0]["state"][0]["exp_avg"], original) and ROW_ORDER_KEY not in out
    with pytest.raises(ValueError, match="cannot be put back in the model's order"):
        reorder_rows(torch.zeros(12, 3), order, to_model=True)


def test_export_unstacks_experts():
    stack = torch.randn(4, 5, 3)
    out = to_litgpt_state({"transformer.h.0.mlp.experts.fc_1": stack})
    assert torch.equal(out["transformer.h.0.mlp.experts.2.fc_1.weight"], stack[2])
    assert "transformer.h.0.mlp.experts.fc_1" not in out


def test_the_shared_config_is_never_divided():
    from torch import nn

    from lightning_para.integrations.litgpt.tensor import adapt_attention

    model = _gpt()
    attention = model.transformer.h[0].attn
    adapt_attention(attention, 2)
    assert (attention.config.n_head, attention.config.n_query_groups) == (2, 1)
    assert (model.config.n_head, model.config.n_query_groups) == (4, 2)
    assert model.transformer.h[1].attn.config is model.config and isinstance(attention, nn.Module)


def test_a_checkpoint_from_before_the_row_record_loads_at_its_own_tp_only():
    """Old sharded checkpoints kept LitGPT's grouped-query tp in ``litgpt_models``: at another tp their rows would
    land in the wrong places, so they are refused naming the tp to resume with; at their own tp they load."""
    from lightning_para.checkpoint.io import _check_unrecorded_rows

    legacy = {"litgpt_models": {"": {"config": {}, "qkv_rank_major_tp": 2}}}
    _check_unrecorded_rows(legacy, {"model.attn.qkv.weight": ((64, 16, 16), 2)})  # the same tp: as stored
    with pytest.raises(ValueError, match=r"Resume with tp=2"):
        _check_unrecorded_rows(legacy, {})  # one device
    with pytest.raises(ValueError, match=r"Resume with tp=1"):
        _check_unrecorded_rows({"litgpt_models": {"": {"qkv_rank_major_tp": 0}}}, {"w": ((64, 16, 16), 2)})
    _check_unrecorded_rows({}, {"w": ((64, 16, 16), 2)})  # no LitGPT record: nothing to say
