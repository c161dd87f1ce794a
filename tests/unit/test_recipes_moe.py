"""recipes/moe.py: MoE blocks, active parameters, TP plan and pipeline contract (no communication)."""

from __future__ import annotations

import pytest
import torch

from lightning_para.parallel.pipeline.spec import named_layers_of
from lightning_para.recipes.moe import MoEGPT
from lightning_para.parallel.tensor.plan import resolve_plan


def test_moe_blocks_and_active_parameters():
    from lightning_para.moe import MoE

    model = MoEGPT(n_layer=4, n_embd=32, n_head=4, num_experts=4, top_k=2, moe_every=2)
    kinds = [isinstance(b.mlp, MoE) for b in model.blocks]
    assert kinds == [False, True, False, True]  # every other block, starting with the second
    experts = sum(p.numel() for b in model.blocks if isinstance(b.mlp, MoE) for p in b.mlp.experts.parameters())
    dense = model.num_params(matmul_only=True)
    assert model.num_params(matmul_only=True, active=True) == dense - experts + experts * 2 // 4
    plan, _ = resolve_plan(model)
    assert plan["blocks.1.mlp"] == plan["blocks.3.mlp"] == "gather_sequence"  # experts: split by ep, not tp
    assert plan["blocks.0.mlp"] == "mlp" and plan["blocks.0.mlp.c_fc"] == "colwise"
    assert not any(k.startswith("blocks.1.mlp.") for k in plan)
    x = torch.randint(0, 256, (2, 16))
    assert model(x).shape == (2, 16, 256)
    with pytest.raises(ValueError, match="top_k"):
        MoEGPT(n_layer=2, n_embd=32, n_head=4, num_experts=2, top_k=3)


def test_moe_pipeline_contract_reproduces_the_forward():
    torch.manual_seed(0)
    model = MoEGPT(n_layer=3, n_embd=32, n_head=4, block_size=16, moe_every=1)
    spec = model.configure_pipeline()
    assert [n for n, _ in named_layers_of(model, spec.layers)] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    model.eval()  # MoE layers record routing statistics only in training
    x = torch.randint(0, 256, (2, 16))
    h = x
    for layer in spec.layers:
        h = layer(h)
    torch.testing.assert_close(h, model(x))
