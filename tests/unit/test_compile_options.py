"""``compile=`` (issue 25) without processes: validation, the planner's factor, the recompile watch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_para import ParaStrategy
from lightning_para.config import ParallelConfig
from lightning_para.parallel.compile import CompileWatch, apply_compile
from lightning_para.spec.options import compile_options
from lightning_para.plan import Cluster, Layout, Training, estimate, preset
from lightning_para.plan.cost import COMPILE_FP8_SPEEDUP, COMPILE_SPEEDUP


def test_compile_options_and_errors_name_compile():
    assert compile_options(True) == {} and compile_options(False) is None
    assert compile_options({"backend": "aot_eager", "fullgraph": True}) == {"backend": "aot_eager", "fullgraph": True}
    with pytest.raises(ValueError, match=r"`compile=.*\['speed'\] are not torch.compile options"):
        ParaStrategy(compile={"speed": 2})
    with pytest.raises(ValueError, match="`compile='yes'` must be True, False or a dict"):
        ParallelConfig(compile="yes")


@pytest.mark.parametrize("schedule, virtual", [("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2)])
def test_split_backward_schedules_are_rejected_under_compile(schedule, virtual):
    with pytest.raises(ValueError, match=rf"`compile=True` with `schedule='{schedule}'` is not supported"):
        ParallelConfig(pp=2, schedule=schedule, virtual_stages=virtual, compile=True)
    ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2, compile=True)  # a loop schedule is fine


def test_layout_keeps_compile_and_the_user_dict():
    config = ParallelConfig(dp=2, compile={"backend": "aot_eager"})
    layout = Layout.from_config(config, config.resolve_dims(2))
    assert layout.compile is True and "compile" in layout.label()
    assert ParallelConfig(compile={"mode": "max-autotune"}).with_layout(layout).compile == {"mode": "max-autotune"}


def test_planner_prices_compile_with_torchtitans_speedup():
    assert COMPILE_SPEEDUP == pytest.approx(6667 / 5762) and COMPILE_FP8_SPEEDUP == pytest.approx(8532 / 5762)
    model, cluster = preset("gpt-125m"), Cluster.of("h100", nodes=1)
    training = Training(seq_len=1024, global_batch=16, precision="bf16-true")
    eager = estimate(model, cluster, training, Layout(dp=8, zero=1))
    compiled = estimate(model, cluster, training, Layout(dp=8, zero=1, compile=True))
    assert compiled.ranks[0].compute_seconds == pytest.approx(eager.ranks[0].compute_seconds / COMPILE_SPEEDUP)
    assert compiled.step_seconds < eager.step_seconds
    assert compiled.memory == eager.memory  # compile is priced as no memory change


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.proj(x)) + x


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_share_a_graph_and_a_recompile_storm_warns_with_dynamos_reason():
    torch._dynamo.reset()
    model = _Blocks()
    info = apply_compile(model, options={"backend": "eager", "dynamic": False})
    assert info.block_types == ["_Block"] and len(info.blocks) == 3
    watch = CompileWatch(info.block_types)
    model(torch.randn(2, 4, requires_grad=True))  # every block sees an input that requires grad
    assert watch.graphs() == 1 and watch.check() is None  # three blocks, one graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in range(3, 9):  # a new batch size each call, dynamic=False: a recompile each
            model(torch.randn(batch, 4, requires_grad=True))
        message = watch.check()
    assert message is not None and "recompile storm" in message and "size" in message, message
    assert any("recompile storm" in str(w.message) for w in caught)
    assert sum(watch.recompiles().values()) >= 5
    with pytest.raises(ValueError, match="`compile=True`: Linear has no blocks"):
        apply_compile(nn.Linear(2, 2), options={})
    # A pipeline stage may hold only the embedding or the head: nothing to compile there, no error.
    assert apply_compile(nn.Linear(2, 2), options={}, require_blocks=False).blocks == []
