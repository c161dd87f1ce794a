"""One layout vocabulary (issue 22 item 2): the planner's ``Layout`` and ParaStrategy's arguments are
the same names, mapped in one place (``Layout.strategy_kwargs`` / ``Layout.from_config`` /
``ParallelConfig.with_layout``), and ``layout="auto"`` keeps what the user fixed (issue 23 item 4).
No communication here; the training checks are in ``tests/distributed/test_plan_tools.py``."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_para import ParaStrategy
from lightning_para.config import ParallelConfig
from lightning_para.spec.options import ACTIVATION_CHECKPOINTING, PRECISIONS, SCHEDULES, ZERO3_UNITS
from lightning_para.parity import strategy_arguments
from lightning_para.parity.run import world_of
from lightning_para.describe import describe_module
from lightning_para.plan import Cluster, Layout, Training, estimate, preset
from lightning_para.auto_layout import RunSetting, batch_shape, plan_layout, run_training_of, search_space
from lightning_para.plan.cost import layout_problems
from lightning_para.core.front_end import FRONT_END_ARGUMENTS
from lightning_para.spec.options import LAYOUT_OPTIONS
from lightning_para.run_plan import LAYOUT_ALIASES, LAYOUT_KEYS, parse_layout
from lightning_para.recipes import GPT

CPU = torch.device("cpu")


def _meta(**kwargs) -> GPT:
    with torch.device("meta"):
        return GPT(sample_tokens=0, **kwargs)


# ----------------------------------------------------------------------------- the vocabulary
def test_every_parastrategy_argument_is_a_layout_field_or_named_as_not_one():
    """A new ParaStrategy argument fails here until it is a Layout field or listed, with a reason, as no part of a layout."""
    arguments = set(inspect.signature(ParaStrategy.__init__).parameters) - {"self"}
    # No part of a layout: the options the planner does not price (each says why) and the front ends' own arguments.
    NOT_LAYOUT_ARGUMENTS = {o.name for o in LAYOUT_OPTIONS if o.not_planned} | {
        name.strip() for key in FRONT_END_ARGUMENTS for name in key.split(",")}
    layout_fields = {f.name for f in fields(Layout)}
    assert layout_fields <= arguments, f"Layout fields that are not ParaStrategy arguments: {layout_fields - arguments}"
    assert not layout_fields & set(NOT_LAYOUT_ARGUMENTS)
    missing = arguments - layout_fields - set(NOT_LAYOUT_ARGUMENTS)
    assert not missing, f"ParaStrategy arguments the layout vocabulary does not cover: {sorted(missing)}"
    config_fields = {f.name for f in fields(ParallelConfig) if f.init}
    assert config_fields <= layout_fields | set(NOT_LAYOUT_ARGUMENTS)


# Every layout option away from its default, in combinations ParaStrategy accepts.
ROUND_TRIPS = [
    dict(dp=4, dp_replicate=2, dp_shard=2, tp=2, pp=2, ep=2, cp=1, zero=2, zero3_units="auto",
         sequence_parallel=True, sp_save_input_shard=False, loss_parallel=False, activation_checkpointing="selective",
         schedule="interleaved", microbatches=4, virtual_stages=2, pipeline_split=[0, 2, 3, 5],
         pipeline_balance="time", bucket_size_mb=7.0, zero_accumulation="reduce_each_step", cp_method="ring",
         cp_load_balance=True, compile=False, fp8=None),
    dict(dp=2, dp_replicate=1, dp_shard=2, tp=1, pp=1, ep=1, cp=2, cp_method="all_to_all", cp_load_balance=False,
         zero=3, zero3_units="blocks_and_ends", sequence_parallel=False, sp_save_input_shard=True, loss_parallel=True,
         activation_checkpointing="full", schedule="1f1b", microbatches=None, virtual_stages=1, pipeline_split=None,
         pipeline_balance="params", bucket_size_mb=25.0, zero_accumulation="no_sync", compile=True, fp8="tensorwise"),
    dict(dp=4, dp_replicate=2, dp_shard=2, tp=1, pp=2, ep=1, cp=1, cp_method="ring", cp_load_balance=True,
         zero=1, zero3_units="auto", sequence_parallel=False, sp_save_input_shard=True, loss_parallel=True,
         activation_checkpointing=None, schedule="looped_bfs", microbatches=4, virtual_stages=2, pipeline_split=None,
         pipeline_balance="params", bucket_size_mb=25.0, zero_accumulation="no_sync", compile=True, fp8="tensorwise"),
]


@pytest.mark.parametrize("kwargs", ROUND_TRIPS, ids=["tp-pp-hsdp", "cp-ulysses-zero3", "hsdp-looped-bfs"])
def test_strategy_arguments_round_trip_through_the_layout(kwargs):
    assert set(kwargs) == {f.name for f in fields(Layout)}  # every option in each case
    strategy = ParaStrategy(**kwargs)
    world = kwargs["dp"] * kwargs["tp"] * kwargs["pp"] * kwargs["cp"]
    layout = Layout.from_config(strategy.config, strategy.config.resolve_dims(world))
    assert layout.strategy_kwargs() == kwargs
    assert ParallelConfig().with_layout(layout) == strategy.config  # the one config mapping agrees
    assert Layout(**{k: v for k, v in kwargs.items()}) == layout  # same names, same meaning


def test_strategy_kwargs_leave_out_the_planner_bucket_rule():
    """bucket_size_mb=None (Megatron's rule) keeps a config's own bucket size."""
    layout = Layout(dp=4, zero=1)
    assert "bucket_size_mb" not in layout.strategy_kwargs()
    assert ParallelConfig(bucket_size_mb=10.0).with_layout(layout).bucket_size_mb == 10.0
    assert ParallelConfig().with_layout(replace(layout, bucket_size_mb=5.0)).bucket_size_mb == 5.0


def test_option_lists_are_defined_once():
    import lightning_para.config as config
    import lightning_para.parallel.activation_checkpoint as ac
    import lightning_para.plan.cluster as cluster
    import lightning_para.plan.layout as layout
    import lightning_para.precision as precision
    from lightning_para.plan.search import SearchSpace

    assert cluster.PRECISIONS is precision.PRECISIONS is PRECISIONS and "16-true" in PRECISIONS
    assert SearchSpace().recompute is ACTIVATION_CHECKPOINTING and ac.MODES == ACTIVATION_CHECKPOINTING[1:]
    assert not hasattr(config, "PRECISIONS")  # read from the spec layer, not re-exported
    assert not hasattr(layout, "RECOMPUTE")  # no second name for the same list
    for precision in PRECISIONS:  # the planner prices every precision ParaStrategy has
        Training(seq_len=8, global_batch=8, precision=precision)
    for schedule in SCHEDULES:  # and can hold every schedule (pricing the ones it models)
        assert Layout(pp=2, schedule=schedule).schedule == schedule


def test_sixteen_true_is_priced_like_bf16_true():
    model, cluster = preset("gpt-125m"), Cluster.of("h100", nodes=1)
    by_precision = {
        p: estimate(model, cluster, Training(seq_len=1024, global_batch=16, precision=p), Layout(dp=8, zero=1)).memory
        for p in ("16-true", "bf16-true")
    }
    assert by_precision["16-true"] == by_precision["bf16-true"]


def test_unpriced_schedule_is_a_reason_not_a_crash():
    model, cluster = preset("gpt-125m"), Cluster.of("h100", nodes=1)
    layout = Layout(dp=2, pp=4, zero=1, schedule="dualpipev", virtual_stages=2)
    problems = layout_problems(model, cluster, Training(seq_len=1024, global_batch=64), layout)
    assert any("no bubble model" in p for p in problems)


def test_zero3_units_are_priced_as_chosen():
    """"blocks" groups the embedding, final norm and head (fewer gathers), "blocks_and_ends" does not;
    "auto" is one of the two by plan/shape.py's rule (zero3_ends), so the numbers for auto stay the same."""
    model, cluster = preset("gpt-125m"), Cluster.of("h100", nodes=1)
    training = Training(seq_len=1024, global_batch=16, precision="bf16-true")

    def dp_calls(units: str) -> tuple[float, float]:
        e = estimate(model, cluster, training, Layout(dp=8, zero=3, zero3_units=units))
        gathers = [c for c in e.ranks[0].collectives if c.dim == "dp" and c.op == "all_gather"]
        return sum(c.calls for c in gathers), e.memory.params

    grouped, each = dp_calls("blocks"), dp_calls("blocks_and_ends")
    assert grouped[0] < each[0]
    assert dp_calls("auto") in (grouped, each)
    assert Layout(dp=8, zero=3, zero3_units="blocks").label().endswith("units:blocks")


# ----------------------------------------------------------------------------- --layout keys
def test_parse_layout_takes_every_layout_field_and_the_aliases():
    assert {f.name for f in fields(Layout)} | set(LAYOUT_ALIASES) == set(LAYOUT_KEYS)
    parsed = parse_layout(
        "cp=2,cp_method=all_to_all,cp_load_balance=false,dp_replicate=2,dp_shard=2,zero=3,zero3_units=blocks,"
        "loss_parallel=0,sp_save_input_shard=false,pipeline_balance=time,pipeline_split=0:3,bucket_mb=10"
    )
    assert parsed == {
        "cp": 2, "cp_method": "all_to_all", "cp_load_balance": False, "dp_replicate": 2, "dp_shard": 2, "zero": 3,
        "zero3_units": "blocks", "loss_parallel": False, "sp_save_input_shard": False, "pipeline_balance": "time",
        "pipeline_split": [0, 3], "bucket_size_mb": 10.0,
    }
    for bad, message in [("cp_method=flash", "cp_method='flash'"), ("zero3_units=all", "zero3_units='all'"),
                         ("pipeline_split=a:b", "integers separated by ':'"), ("cp_load_balance=maybe", "true or false")]:
        with pytest.raises(ValueError, match=message):
            parse_layout(bad)


def test_parity_layout_cp2_is_a_two_process_layout():
    arguments = strategy_arguments("cp=2")
    assert arguments == {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 2} and world_of(arguments) == 2
    hybrid = strategy_arguments("dp_replicate=2,dp_shard=2,zero=1")
    assert hybrid["dp"] == 4 and world_of(hybrid) == 4
    ParallelConfig(**hybrid).resolve_dims(4)  # ParaStrategy accepts what the parser gives


# ----------------------------------------------------------------------------- layout="auto"
def _plan(config: ParallelConfig, module=None, data=None, world: int = 4, **kwargs):
    module = module or _meta(n_layer=4, n_embd=64, n_head=4, block_size=64)
    data = data if data is not None else SimpleNamespace(seq_len=64, global_batch_size=16)
    return plan_layout(config, module, data, RunSetting(world, world, CPU, "32-true", **kwargs))


@pytest.mark.parametrize("fixed, check", [
    ({"cp": 2}, lambda l: l.cp == 2),
    ({"cp": 2, "cp_method": "all_to_all"}, lambda l: l.cp == 2 and l.cp_method == "all_to_all"),
    ({"cp": 2, "cp_load_balance": False}, lambda l: l.cp == 2 and not l.cp_load_balance),
    ({"dp_replicate": 2, "zero": 1}, lambda l: l.dp_replicate == 2),
    ({"dp_replicate": 2}, lambda l: l.dp_replicate == 2 and l.zero >= 1),
    ({"dp_shard": 2, "zero": 2}, lambda l: l.dp_shard == 2 and l.dp_replicate == l.dp // 2),
    ({"dp": 2}, lambda l: l.dp == 2),
    ({"tp": 2}, lambda l: l.tp == 2),
    ({"pp": 2}, lambda l: l.pp == 2),
    ({"zero": 3, "zero3_units": "blocks_and_ends"}, lambda l: l.zero == 3 and l.zero3_units == "blocks_and_ends"),
    ({"loss_parallel": False, "sp_save_input_shard": False}, lambda l: not l.loss_parallel and not l.sp_save_input_shard),
], ids=["cp", "cp_method", "cp_load_balance", "dp_replicate", "dp_replicate-zero", "dp_shard", "dp", "tp", "pp",
        "zero3_units", "tp-options"])
def test_auto_keeps_what_the_user_fixed(fixed, check):
    config = ParallelConfig(layout="auto", layout_memory_gb=4.0, **fixed)
    choice = _plan(config)
    assert check(choice.layout), (fixed, choice.layout)
    chosen = config.with_layout(choice.layout)
    assert chosen.resolve_dims(4).world_size == 4  # the chosen degrees fit the world (the old cp failure)
    for name, value in fixed.items():
        assert getattr(chosen, name) == value, name


def test_auto_keeps_cp_where_the_old_mapping_dropped_it():
    """`ParaStrategy(cp=2, layout="auto")` on 4 processes failed at setup (pp=1 x dp=4 x cp=2 x tp=1 = 8)."""
    config = ParallelConfig(cp=2, layout="auto", layout_memory_gb=4.0)
    dims = config.with_layout(_plan(config).layout).resolve_dims(4)
    assert dims.cp == 2 and dims.pp * dims.dp * dims.cp * dims.tp == 4


def test_batch_shape_reads_the_usual_batches():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_shape(ids) == (4, 16)
    assert batch_shape((ids, ids)) == (4, 16)
    assert batch_shape({"labels": torch.zeros(4, 9), "input_ids": ids}) == (4, 16)
    assert batch_shape([torch.zeros(3), {"x": ids}]) == (4, 16)
    assert batch_shape(torch.zeros(4)) is None


class _PlainData(L.LightningDataModule):
    """A datamodule with neither `seq_len` nor a batch size attribute."""

    def train_dataloader(self):
        x = torch.zeros(40, 32, dtype=torch.long)
        return DataLoader(TensorDataset(x, x), batch_size=2)


def test_auto_reads_the_first_batch_of_a_plain_datamodule():
    module = _meta(n_layer=2, n_embd=32, n_head=4, block_size=32)
    training = run_training_of(module, _PlainData(), "32-true", accumulation=3)
    assert (training.seq_len, training.batch_per_rank, training.accumulation) == (32, 2, 3)
    choice = _plan(ParallelConfig(layout="auto", layout_memory_gb=4.0), module, _PlainData())
    assert choice.layout.world_size == 4
    # Loaders passed to fit(): Lightning keeps them on the fit loop until its data setup.
    x = torch.zeros(8, 24, dtype=torch.long)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=SimpleNamespace(instance=DataLoader(x, batch_size=4))))
    training = run_training_of(module, None, "32-true", trainer=trainer)
    assert (training.seq_len, training.batch_per_rank) == (24, 4)


def test_auto_says_why_when_there_is_no_batch_either():
    class Broken(L.LightningDataModule):
        def train_dataloader(self):
            raise RuntimeError("call setup() first")

    with pytest.raises(ValueError, match=r"could not find the batch size of the run: reading the first training"
                                         r" batch failed \(RuntimeError: call setup\(\) first\)"):
        run_training_of(_meta(), Broken(), "32-true")
    with pytest.raises(ValueError, match="there is no training loader"):
        run_training_of(_meta(), None, "32-true")


def test_search_space_of_auto_carries_the_fixed_options():
    module = _meta()
    config = ParallelConfig(cp=2, cp_method="all_to_all", zero3_units="blocks", zero=3)
    space = search_space(config, module, describe_module(module), 4)
    assert space.cp == (2,) and space.dp_replicate == (1,)
    assert space.options.cp_method == "all_to_all" and space.options.zero3_units == "blocks"
    assert ZERO3_UNITS == ("auto", "blocks", "blocks_and_ends")
