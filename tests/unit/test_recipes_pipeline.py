"""The GPT recipe's pipeline contract, checked without communication."""

from __future__ import annotations

import pytest
import torch

from lightning_para import PipelineSpec
from lightning_para.parallel.pipeline.spec import named_layers_of
from lightning_para.spec.split import balanced_split
from lightning_para.recipes.gpt import GPT


def test_pipeline_contract_reproduces_the_forward():
    torch.manual_seed(0)
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=16)
    spec = model.configure_pipeline()
    assert isinstance(spec, PipelineSpec)
    names = [name for name, _ in named_layers_of(model, spec.layers)]  # every parameter in exactly one layer
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    inputs, targets = spec.split_batch(batch)
    x = inputs
    for layer in spec.layers:  # each layer maps x -> x
        x = layer(x)
    torch.testing.assert_close(x, model(inputs))
    torch.testing.assert_close(spec.loss_fn(x, targets), model.loss_fn(model(inputs), targets))
    # two stages split by parameter count put the embedding with the first blocks
    costs = [sum(p.numel() for p in layer.parameters()) for layer in spec.layers]
    assert balanced_split(costs, 2)[0] == 0


def test_tied_weights_cannot_be_pipelined():
    with pytest.raises(ValueError, match="tie_weights=True"):
        GPT(n_layer=2, n_embd=32, n_head=4, tie_weights=True).configure_pipeline()
