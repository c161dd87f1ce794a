"""``fp8=`` (issue 25) without processes: validation, which linears are converted and which are skipped."""

from __future__ import annotations

import pytest
import torch

from lightning_para.config import ParallelConfig
from lightning_para.parallel.fp8 import apply_float8
from lightning_para.recipes.gpt import GPT


def test_fp8_errors_name_the_argument():
    with pytest.raises(ValueError, match="`fp8='e4m3'` is unknown"):
        ParallelConfig(fp8="e4m3")
    with pytest.raises(ValueError, match="`fp8='rowwise'` with `tp=2` is not supported"):
        ParallelConfig(fp8="rowwise", tp=2)
    ParallelConfig(fp8="tensorwise", tp=2)  # torchao's float8 tensor-parallel styles


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_head_and_odd_widths_are_skipped_and_named(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = GPT(n_layer=1, n_embd=32, n_head=4, block_size=8, vocab_size=64, sample_tokens=0, mlp_hidden=40)
    info = apply_float8(model, recipe=recipe, emulate=True)
    assert "head.lm_head" in info.skipped or any(k.startswith("head") for k in info.skipped), info.skipped
    assert any("multiples of 16" in v for v in info.skipped.values())  # the 32 -> 40 MLP
    assert len(info.converted) >= 4  # q, k, v and the output projection (32 -> 32)
    for name in info.converted:
        assert isinstance(model.get_submodule(name), Float8Linear)
    for name in info.skipped:
        assert not isinstance(model.get_submodule(name), Float8Linear)
    loss = model(torch.randint(0, 64, (2, 8))).float().mean()
    loss.backward()  # forward and backward run on this CPU


def test_float8_tensor_parallel_styles_are_torchaos_and_tensorwise_only():
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from lightning_para.parallel.fp8 import float8_tensor_parallel_styles
    from lightning_para.parallel.tensor.styles import make_style

    assert float8_tensor_parallel_styles("rowwise") is None and float8_tensor_parallel_styles(None) is None
    styles = float8_tensor_parallel_styles("tensorwise")
    assert isinstance(make_style("colwise", sequence_parallel=True, loss_parallel=True, float8=styles), Float8ColwiseParallel)
    assert type(make_style("rowwise", sequence_parallel=True, loss_parallel=True, float8=styles)) is Float8RowwiseParallel
    gloo = float8_tensor_parallel_styles("tensorwise", float8_collectives=False)  # casts after the gather
    assert issubclass(gloo.rowwise, Float8RowwiseParallel) and gloo.rowwise is not Float8RowwiseParallel
    with pytest.raises(ValueError, match="planned 'fused_qkv' is not supported"):
        make_style("fused_qkv", sequence_parallel=False, loss_parallel=True, float8=styles)
