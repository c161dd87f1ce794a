"""Every parity model is sharp: a wrong position, mask, shard or label pairing can move its loss.

One forward pass per model (a few seconds in all). A new parity model goes into ``PARITY_MODELS``;
tests/sharpness.py explains the measure and the thresholds (issue 24).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.sharpness import MAX_ATTENTION_ENTROPY, MAX_OUTPUT_ENTROPY, SHARP_STD, measure
from tests.tp_models import TokenDataset

TOKENS = TokenDataset(n=8).x  # 8 sequences of 16 ids < 64


def _call(model):
    return model(TOKENS)


def _hf(model):
    return model.model(input_ids=TOKENS).logits


def _pp_tokens(model):
    from tests.distributed.pp_models import token_dataset

    return model(token_dataset(n=8).tensors[0])


def _tiny_attention(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 16, generator=g)
    model(x, torch.arange(16).expand(2, 16))
    return None  # no vocabulary


def _models() -> list:
    from tests import cp_models, hf_models, tp_models
    from tests.distributed import pp_models, test_context_parallel_core as cp_core
    from tests.distributed import test_context_parallel_training as cp_training
    from tests.distributed import test_data_parallel as dp
    from tests.distributed import test_expert_parallel as ep
    from tests.distributed import test_hybrid_sharding as hsdp

    return [
        ("tp_models.NanoGPT", tp_models.NanoGPT, _call),
        ("tp_models.LlamaLike", tp_models.LlamaLike, _call),
        ("tp_models.NanoGPTWithMoE", tp_models.NanoGPTWithMoE, _call),
        ("hf_models.llama", hf_models.llama, _hf),
        ("hf_models.mixtral", hf_models.mixtral, _hf),
        ("hf_models.LlamaUserPipeline", hf_models.LlamaUserPipeline, _hf),
        ("hf_models.GPT2Module", hf_models.GPT2Module, _hf),
        ("pp_models.TinyTokenModel", pp_models.TinyTokenModel, _pp_tokens),
        ("test_expert_parallel.TinyMoETransformer", ep.TinyMoETransformer, _call),
        ("cp_models.PlainHFLlama", cp_models.PlainHFLlama, _hf),
        ("cp_models.PaddedHFLlama", cp_models.PaddedHFLlama, _hf),
        ("cp_models.OwnLossHFLlama", cp_models.OwnLossHFLlama, _hf),
        ("test_context_parallel_training.gpt", cp_training.gpt, _call),
        ("test_context_parallel_training.gpt2_style", cp_training.gpt2_style, _call),
        ("test_context_parallel_training.HFLlama", cp_training.HFLlama, _hf),
        ("test_context_parallel_core.TinyAttention", cp_core.TinyAttention, _tiny_attention),
        ("test_data_parallel._tiny_gpt", dp._tiny_gpt, _call),
        ("test_data_parallel._tiny_gpt(tie)", functools.partial(dp._tiny_gpt, tie=True), _call),
        ("test_hybrid_sharding.gpt_constant_lr", hsdp.gpt_constant_lr, _call),
    ]


# Parity models that are neither attention models nor language models: an MLP regression (MSE) has
# no position, mask, head order or label pairing for its weights to hide; the bugs its tests look for
# (a missing reduction, a wrong shard of a gradient or optimizer state) change its loss at any init.
EXEMPT = ["tests.models.RegressionNet", "tests.models.SGDRegressionNet"]

_IDS = [name for name, _, _ in _models()]


@pytest.mark.parametrize("index", range(len(_IDS)), ids=_IDS)
def test_parity_model_is_sharp(index):
    pytest.importorskip("transformers")
    name, factory, forward = _models()[index]
    torch.manual_seed(0)
    result = measure(factory(), forward)
    print(f"{name}: attention entropy {result.attention}, output entropy {result.output}")
    assert result.attention is None or result.attention <= MAX_ATTENTION_ENTROPY, (
        f"{name}: attention is almost uniform (mean normalised entropy {result.attention:.3f} >"
        f" {MAX_ATTENTION_ENTROPY}); initialise it with std >= {SHARP_STD} (tests/sharpness.py)"
    )
    assert result.output is None or result.output <= MAX_OUTPUT_ENTROPY, (
        f"{name}: the next-token distribution is almost uniform (normalised entropy {result.output:.3f} >"
        f" {MAX_OUTPUT_ENTROPY}); initialise it with std >= {SHARP_STD} (tests/sharpness.py)"
    )
    assert result.attention is not None or result.output is not None, f"{name}: measured nothing"


def test_blunt_models_fail_the_sharpness_check():
    """The measure separates the old inits from the sharp ones (else the check above proves nothing)."""
    pytest.importorskip("transformers")
    from tests import hf_models, tp_models
    from tests.sharpness import sharp_gpt

    blunt = [
        (functools.partial(tp_models.NanoGPT, init_std=0.05), _call),
        (lambda: hf_models.HFCausalLM(hf_models.llama_config(initializer_range=0.02)), _hf),
        (lambda: sharp_gpt(0.02, n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, sample_tokens=0), _call),
    ]
    for factory, forward in blunt:
        torch.manual_seed(0)
        result = measure(factory(), forward)
        assert result.attention > MAX_ATTENTION_ENTROPY and result.output > MAX_OUTPUT_ENTROPY, result


def test_exempt_models_have_no_attention_and_no_vocabulary():
    from tests.models import RegressionNet, SGDRegressionNet

    for factory in (RegressionNet, SGDRegressionNet):
        result = measure(factory(), lambda m: (m(torch.randn(4, 32)), None)[1])
        assert result.attention_calls == 0 and result.output is None
