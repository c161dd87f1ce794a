"""The context-parallel adapter registry, the transformers adapter's pre-hook and the check's prefix (no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_para.parallel.context import (
    ContextParallelRuntime,
    ContextParallelShard,
    context_parallel_adapters,
    position_ids_for_rank,
)
from lightning_para.parallel.context.check import prefix_length

transformers = pytest.importorskip("transformers")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def test_transformers_registers_an_adapter_that_claims_pretrained_models_only():
    import lightning_para  # noqa: F401  (registers the built-in integrations)

    adapter = {a.name: a for a in context_parallel_adapters()}["transformers"]
    model = tiny_llama()
    assert adapter.claims(model) and adapter.claims(model.model)
    assert not adapter.claims(model.model.layers[0]) and not adapter.claims(torch.nn.Linear(2, 2))


def test_the_pre_hook_gives_global_positions_and_an_all_ones_mask_only_inside_cp_steps():
    from lightning_para.integrations.transformers.context import attach

    model = tiny_llama()
    shard = ContextParallelShard(cp_rank=1, cp=2)
    runtime = ContextParallelRuntime(shard, group=None)
    seen: dict = {}
    model.model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    detach = attach(model, runtime)
    x = torch.randint(0, 32, (3, 8))  # rank 1's chunks of a 16-token sequence
    model(input_ids=x)  # outside a cp step: untouched
    assert seen["position_ids"] is None and seen["attention_mask"] is None
    runtime.enter()
    try:
        model(x)  # positional input_ids too
    finally:
        runtime.exit()
    expected = position_ids_for_rank(16, 1, 2)  # chunks 1 and 2 of 4: positions 4-7 and 8-11
    assert torch.equal(seen["position_ids"], expected.expand(3, -1))
    assert torch.equal(seen["attention_mask"], torch.ones(3, 8, dtype=torch.long))
    whole = torch.arange(16).expand(3, -1) * 10  # whole-sequence position_ids are split like the batch
    runtime.enter()
    try:
        model(input_ids=x, position_ids=whole)
    finally:
        runtime.exit()
    assert torch.equal(seen["position_ids"], shard.split(whole))
    detach()
    runtime.enter()
    try:
        model(input_ids=x)
    finally:
        runtime.exit()
    assert seen["position_ids"] is None


def test_the_pre_hook_refuses_a_4d_mask():
    from lightning_para.integrations.transformers.context import attach

    model = tiny_llama()
    runtime = ContextParallelRuntime(ContextParallelShard(0, 2), group=None)
    attach(model, runtime)
    runtime.enter()
    try:
        with pytest.raises(ValueError, match="2-D padding `attention_mask`"):
            model(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 1, 8, 8))
    finally:
        runtime.exit()


@pytest.mark.parametrize(
    "seq, cp, balance, multiple, expected",
    [(16, 2, True, 1, 16), (64, 2, True, 1, 32), (64, 2, True, 2, 64), (12, 3, False, 1, 12), (6, 4, True, 1, 0)],
)
def test_the_check_prefix_is_whole_chunks_of_at_most_eight_tokens(seq, cp, balance, multiple, expected):
    assert prefix_length(seq, ContextParallelShard(0, cp, balance), multiple) == expected


def test_pipeline_spec_refuses_pp_x_cp_for_a_transformers_model():
    from lightning_para.integrations.transformers import pipeline_spec
    from lightning_para.integrations.transformers.context import attach

    model = tiny_llama()
    detach = attach(model, ContextParallelRuntime(ContextParallelShard(0, 2), group=None))
    with pytest.raises(ValueError, match=r"pp x cp \(cp=2\) is not supported"):
        pipeline_spec(model)
    detach()
    assert pipeline_spec(model).layers  # without cp it builds the spec
