"""Pipeline schedules, validation and the stage split, without any communication.

Action orders come from torch's own schedule code run on recording stub stages
(``schedule_action_order``); the tests check them against the papers' schedules.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_para import ParallelConfig, PipelineSpec
from lightning_para.spec.options import SCHEDULES as PIPELINE_SCHEDULES
from lightning_para.parallel.pipeline.spec import PipelineStageModule, named_layers_of, pipeline_spec_of
from lightning_para.parallel.pipeline.split import apply_pipeline_parallel
from lightning_para.spec.split import balanced_split, explicit_split
from lightning_para.instrument.saved_activations import SavedActivationMeter
from lightning_para.spec.schedules import validate_pipeline_config
from tests.pipeline_orders import schedule_action_order, torch_accepts
from lightning_para.spec.schedules import expected_bubble, schedule_problem, stage_to_rank
from tests.distributed.pp_models import TinyTokenModel

# (schedule, virtual_stages) for every registered name
LAYOUTS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zero_bubble", 2),
           ("looped_bfs", 2), ("zbv", 2), ("dualpipev", 2)]


def parse(action: str) -> tuple[int, str, int]:
    for kind in "FBIW":
        if kind in action:
            stage, mb = action.split(kind)
            return int(stage), kind, int(mb)
    raise AssertionError(action)


# ----------------------------------------------------------------------------- action orders
def test_every_registered_schedule_is_covered():
    assert {name for name, _ in LAYOUTS} == set(PIPELINE_SCHEDULES)


def test_gpipe_order_is_all_forwards_then_all_backwards():
    order = schedule_action_order("gpipe", pp=2, microbatches=4)
    assert order[0] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]
    assert order[1] == ["1F0", "1F1", "1F2", "1F3", "1B0", "1B1", "1B2", "1B3"]


def test_1f1b_order_warms_up_p_minus_rank_forwards_then_alternates():
    # PipeDream-Flush (Narayanan et al. 2021, Fig. 4): stage r runs p - r forwards, then 1B1F.
    order = schedule_action_order("1f1b", pp=2, microbatches=4)
    assert order[0] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert order[1] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]


@pytest.mark.parametrize("schedule,v", LAYOUTS)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_each_rank_runs_its_stages_once_per_microbatch_in_dependency_order(schedule, v, pp, m):
    order = schedule_action_order(schedule, pp, m, v)
    placement = stage_to_rank(schedule, pp, v)
    for rank, actions in order.items():
        parsed = [parse(a) for a in actions]
        own = {s for s, r in placement.items() if r == rank}
        assert {s for s, _, _ in parsed} == own
        counts = Counter((s, k) for s, k, _ in parsed)
        for s in own:
            assert counts[(s, "F")] == m
            assert counts[(s, "B")] + counts[(s, "I")] == m
            assert counts[(s, "I")] == counts[(s, "W")]
        position = {(s, k, mb): i for i, (s, k, mb) in enumerate(parsed)}
        for (s, k, mb), i in position.items():
            if k in "BI":
                assert position[(s, "F", mb)] < i  # backward after its forward
            if k == "W":
                assert position[(s, "I", mb)] < i  # weight grad after input grad
            if k == "F" and s - 1 in own:
                assert position[(s - 1, "F", mb)] < i  # a local previous stage feeds it first
    if SCHEDULE_SPLITS_BACKWARD[schedule]:
        assert any("I" in a for a in order[0])


SCHEDULE_SPLITS_BACKWARD = {"gpipe": False, "1f1b": False, "interleaved": False, "zero_bubble": True,
                            "looped_bfs": False, "zbv": True, "dualpipev": True}


def in_flight_peak(actions: list[str], stage: int) -> int:
    """Most microbatches whose forward ran and whose backward has not released them yet."""
    live = peak = 0
    for s, kind, _ in map(parse, actions):
        if s != stage:
            continue
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind in "BI":
            live -= 1
    return peak


def test_activation_memory_gpipe_holds_m_microbatches_1f1b_at_most_p():
    p, m = 4, 8
    gpipe, one_f_one_b = schedule_action_order("gpipe", p, m), schedule_action_order("1f1b", p, m)
    for rank in range(p):
        assert in_flight_peak(gpipe[rank], rank) == m
        assert in_flight_peak(one_f_one_b[rank], rank) == p - rank


def test_interleaved_places_stages_round_robin_and_v_schedules_in_a_v():
    assert stage_to_rank("interleaved", 2, 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert stage_to_rank("zbv", 2, 2) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert stage_to_rank("dualpipev", 4, 2) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}


def test_looped_bfs_finishes_a_stage_for_all_microbatches_before_the_next():
    order = schedule_action_order("looped_bfs", 2, 4, 2)[0]
    forwards = [a for a in order if "F" in a]
    assert forwards == ["0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2F3"]


def test_bubble_formulas():
    assert expected_bubble("1f1b", 2, 8) == pytest.approx(1 / 9)
    assert expected_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert expected_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert expected_bubble("zero_bubble", 4, 8) == pytest.approx(1 / 9)  # (p-1)/3 / (m + (p-1)/3)
    assert expected_bubble("dualpipev", 2, 8, 2) is None


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"schedule": "gpipe", "virtual_stages": 2}, "virtual_stages=1"),
        ({"schedule": "1f1b", "virtual_stages": 2}, "virtual_stages=1"),
        ({"schedule": "interleaved", "virtual_stages": 1}, "virtual_stages>=2"),
        ({"schedule": "zbv", "virtual_stages": 1}, "virtual_stages=2"),
        ({"schedule": "dualpipev", "virtual_stages": 3}, "virtual_stages=2"),
        ({"schedule": "1f1b", "microbatches": 1}, "microbatches>=2"),
        ({"schedule": "zbv", "virtual_stages": 2, "microbatches": 2}, "microbatches>=3"),
        ({"schedule": "dualpipev", "virtual_stages": 2, "microbatches": 3}, "microbatches>=4"),
        ({"schedule": "interleaved", "virtual_stages": 2, "microbatches": 5}, "microbatches"),
        ({"schedule": "pipedream"}, "Choose one of"),
        ({"zero": 3}, "zero=3"),
    ],
)
def test_bad_pipeline_configs_raise_value_error_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(pp=2, **kwargs)


def test_the_schedule_rules_are_torchs():
    """``validate_pipeline_config`` states the rules torch's schedules apply when built; torch, building every rank's
    schedule on recording stages, accepts exactly the layouts the rules accept (the library's own rules aside: the
    stages per rank each schedule runs, ZB-V's fill ``m >= 2p - 1``). A rule left out (torch's rounds, planted by
    dropping it) fails this."""

    def ours(schedule, pp, m, v, problem=schedule_problem):
        return problem(schedule, pp, m, v, planned=False) is None

    def torchs(schedule, pp, m, v):  # a layout the library's own rules leave to torch
        found = schedule_problem(schedule, pp, m, v, planned=False)
        return found is None or not ("virtual_stages" in found[0] or "2*pp-1" in found[0])

    def without_rounds(schedule, pp, m, v, planned=False):
        found = schedule_problem(schedule, pp, m, v, planned)
        return None if found is not None and "rounds" in found[0] else found

    grid = [(s, pp, m, v) for s in PIPELINE_SCHEDULES for pp in (2, 3, 4) for v in (1, 2, 3) for m in range(1, 13)
            if torchs(s, pp, m, v)]
    differ = [g for g in grid if ours(*g) != torch_accepts(*g)]
    assert not differ, differ
    assert any(ours(*g, problem=without_rounds) != torch_accepts(*g) for g in grid if g[0] == "interleaved")


def test_default_microbatches_is_one_per_stage():
    assert validate_pipeline_config(4, "interleaved", None, 2) == 8
    assert validate_pipeline_config(2, "1f1b", None, 1) == 2


def test_pp1_ignores_pipeline_options():
    ParallelConfig(pp=1, zero=3, microbatches=1)  # no pipeline: nothing to check


# ----------------------------------------------------------------------------- split
def test_balanced_split_minimizes_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([10, 1, 1, 1, 1, 10], 2) == [0, 3]
    assert balanced_split([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1]
    starts = balanced_split([1.0] * 7, 7)
    assert starts == list(range(7))  # every stage gets at least one layer


def test_explicit_split_accepts_starts_with_or_without_zero():
    assert explicit_split([2], 6, 2) == [0, 2]
    assert explicit_split([0, 2, 4], 6, 3) == [0, 2, 4]
    for bad in ([3, 2], [6], [2, 3, 4], [0]):
        with pytest.raises(ValueError, match="pipeline_split"):
            explicit_split(bad, 6, 3 if len(bad) != 1 else 2)


class NoContract(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class WithContract(nn.Module):
    def __init__(self, layers=None, extra_param: bool = False, tie: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        if extra_param:
            self.scale = nn.Parameter(torch.ones(()))
        if tie:
            self.c.weight = self.a.weight
        self._layers = layers

    def configure_pipeline(self):
        layers = self._layers if self._layers is not None else [self.a, self.b, self.c]
        return PipelineSpec(layers=layers, split_batch=lambda b: b, loss_fn=nn.functional.mse_loss)


def test_module_without_contract_gets_an_error_that_explains_it():
    with pytest.raises(ValueError, match=r"configure_pipeline\(self\) -> lightning_para.PipelineSpec"):
        pipeline_spec_of(NoContract())


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: WithContract(layers=[]), "empty"),
        (lambda: WithContract(layers=[nn.Linear(4, 4)]), "not a submodule"),
        (lambda: WithContract(layers="self"), "not a submodule"),
        (lambda: WithContract(extra_param=True), r"outside every pipeline layer: \['scale'\]"),
    ],
)
def test_layer_list_errors(build, match):
    module = build()
    if module._layers == "self":
        module._layers = [module]
    spec = pipeline_spec_of(module)
    with pytest.raises(ValueError, match=match):
        named_layers_of(module, spec.layers)


def test_layer_listed_twice_is_rejected():
    module = WithContract()
    with pytest.raises(ValueError, match="appear once"):
        named_layers_of(module, [module.a, module.a])


def test_stage_module_keeps_names_and_runs_layers_in_order():
    model = TinyTokenModel()
    named = named_layers_of(model, model.configure_pipeline().layers)
    stage = PipelineStageModule(0, named[:3], model)
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in model.named_parameters()][: len(list(stage.parameters()))]
    assert isinstance(stage.blocks, nn.ModuleList)  # block lists stay lists (activation checkpointing finds them)
    tokens = torch.randint(0, 48, (2, 8))
    expected = model.blocks[1](model.blocks[0](model.embed(tokens)))
    torch.testing.assert_close(stage(tokens), expected)


# ----------------------------------------------------------------------------- apply on a fake process group
@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def split_on_fake_rank(module, rank: int, **config_kwargs):

    config = ParallelConfig(pp=2, **config_kwargs)
    dims = config.resolve_dims(2)
    dims.build_mesh("cpu")
    return apply_pipeline_parallel(
        module, dims.get_mesh("pp"), schedule=config.schedule, microbatches=config.pipeline_microbatches,
        virtual_stages=config.virtual_stages, pipeline_split=config.pipeline_split, pipeline_balance=config.pipeline_balance,
    )


def test_each_rank_keeps_only_its_stages_under_their_original_names():
    full = TinyTokenModel()
    names = set(full.state_dict())
    kept = {}
    for rank in (0, 1):
        model = TinyTokenModel()
        with fake_world(rank, 2):
            runner = split_on_fake_rank(model, rank, microbatches=2)
        kept[rank] = set(model.state_dict())
        assert runner.own_stages == [rank]
        held = {id(p) for p in model.parameters()}
        assert held == {id(p) for m in runner.stage_modules for p in m.parameters()}
        with pytest.raises(RuntimeError, match="another rank"):
            (model.head if rank == 0 else model.embed)(torch.zeros(1, dtype=torch.long))
    assert kept[0] | kept[1] == names and not kept[0] & kept[1]


def test_pp_larger_than_layers_and_tied_stages_are_rejected():
    with fake_world(0, 2), pytest.raises(ValueError, match="4 stages, but `configure_pipeline\\(\\)` lists 3 layers"):
        split_on_fake_rank(WithContract(), 0, schedule="interleaved", virtual_stages=2, microbatches=4)
    with fake_world(0, 2), pytest.raises(ValueError, match="tied parameter on two pipeline stages"):
        split_on_fake_rank(WithContract(tie=True), 0, microbatches=2)


def test_meta_initialized_model_materializes_only_own_stage():
    with torch.device("meta"):
        model = TinyTokenModel()
    with fake_world(1, 2):
        split_on_fake_rank(model, 1, microbatches=2)
    assert all(not p.is_meta for p in model.parameters())
    assert "embed.weight" not in model.state_dict()


# ----------------------------------------------------------------------------- activation meter
def test_saved_activation_meter_counts_saved_tensors_and_frees_them_after_backward():
    layer = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    x = torch.randn(8, 16, requires_grad=True)
    with SavedActivationMeter(exclude=list(layer.parameters())) as meter:
        loss = layer(x).sum()
    # Linear saves its input (8x16 fp32), Tanh its output (8x16 fp32); the weight is excluded.
    assert meter.peak_bytes == 2 * 8 * 16 * 4
    loss.backward()
    del loss
    assert meter.live_bytes == 0
