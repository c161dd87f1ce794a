"""The layout's options are declared once (issue 38 item 3, issue 35's thin adapters).

``lightning_para.spec.options.LAYOUT_OPTIONS`` gives ParallelConfig's fields, the planner's Layout fields,
the ``--layout`` keys and the Args text of both front ends; both front ends take one ``__init__``
(``core/front_end.ParaFrontEnd``), which LightningCLI reads. No process group here."""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import fields
from pathlib import Path

import pytest

import lightning_para
from lightning_para.config import ParallelConfig
from lightning_para.core.front_end import FRONT_END_ARGUMENTS, ParaFrontEnd
from lightning_para.fabric import ParaStrategy as FabricParaStrategy
from lightning_para.spec.options import (
    LAYOUT_OPTIONS,
    LAYOUT_RULES,
    OPTIONS,
    POSITIONAL,
    RUN_RULES,
    arguments_doc,
    check_rules,
    rule_problems,
)
from lightning_para.plan import Cluster, Layout, Training, preset
from lightning_para.plan.cost import layout_problems
from lightning_para.plan.layout import PLANNER_FIELDS
from lightning_para.run_plan import parse_layout

FRONT_ENDS = [lightning_para.ParaStrategy, FabricParaStrategy]
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _layout_parameters(cls: type) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(cls.__init__).parameters
    return {name: p for name, p in parameters.items() if name in OPTIONS}


@pytest.mark.parametrize("cls", FRONT_ENDS, ids=["trainer", "fabric"])
def test_each_front_end_takes_every_option_with_the_declared_default(cls):
    parameters = _layout_parameters(cls)
    assert list(parameters) == [o.name for o in LAYOUT_OPTIONS]  # all of them, in the declaration's order
    hints = typing.get_type_hints(cls.__init__)
    for option in LAYOUT_OPTIONS:
        p = parameters[option.name]
        assert p.default == option.default and type(p.default) is type(option.default), option.name
        assert hints[option.name] == option.annotation, option.name
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if option.name in POSITIONAL else inspect.Parameter.KEYWORD_ONLY
        assert p.kind == kind, option.name


def test_both_front_ends_have_one_signature_and_one_args_text():
    trainer, fabric = FRONT_ENDS
    assert trainer.__init__ is fabric.__init__ is ParaFrontEnd.__init__  # no copy of the argument list
    args = arguments_doc(FRONT_END_ARGUMENTS)
    for cls in FRONT_ENDS:
        assert args in cls.__doc__ and cls.__doc__.count("    Args:\n") == 1
    front_end_only = set(inspect.signature(trainer.__init__).parameters) - set(OPTIONS) - {"self"}
    documented = {name.strip() for key in FRONT_END_ARGUMENTS for name in key.split(",")}
    assert front_end_only == documented  # every argument documented, once


def test_every_option_is_a_parallel_config_field_with_its_default():
    config_fields = [f for f in fields(ParallelConfig) if f.init]
    assert [f.name for f in config_fields] == [o.name for o in LAYOUT_OPTIONS]
    for f in config_fields:
        assert f.default == OPTIONS[f.name].default and f.type == OPTIONS[f.name].annotation, f.name
    assert ParallelConfig().loss_parallel is True  # "auto" alone is the Trainer's meaning


def test_layout_fields_are_the_planned_options():
    planned = [o.name for o in LAYOUT_OPTIONS if not o.not_planned]
    assert [f.name for f in fields(Layout)] == planned
    for f in fields(Layout):
        annotation, default = PLANNER_FIELDS.get(f.name, (OPTIONS[f.name].annotation, OPTIONS[f.name].default))
        assert (f.type, f.default) == (annotation, default), f.name
    assert set(PLANNER_FIELDS) <= set(planned)


def test_front_end_defaults_of_auto():
    assert lightning_para.ParaStrategy().config.loss_parallel is True
    assert lightning_para.ParaStrategy().core.run_guard.guard.on_sigterm == "checkpoint"
    assert FabricParaStrategy().config.loss_parallel is False
    assert FabricParaStrategy().core.run_guard.guard.on_sigterm is None
    assert FabricParaStrategy(loss_parallel=True).config.loss_parallel is True
    assert FabricParaStrategy(on_sigterm="exit").core.run_guard.guard.on_sigterm == "exit"
    with pytest.raises(ValueError, match="on_sigterm='stop'"):
        FabricParaStrategy(on_sigterm="stop")


# A value each option does not take (the "any" options are checked where they are applied).
BAD_VALUES = {
    "dp": 0, "tp": "two", "pp": 0, "ep": -1, "zero": 4, "cp": 0, "cp_method": "flash", "cp_load_balance": "yes",
    "cp_check": 1, "dp_replicate": 0, "dp_shard": 0, "sequence_parallel": "on", "sp_save_input_shard": None,
    "tp_unplanned": "skip", "loss_parallel": "always", "activation_checkpointing": "some", "schedule": "pipedream",
    "microbatches": 0, "virtual_stages": 0, "pipeline_balance": "flops", "bucket_size_mb": 0,
    "zero_accumulation": "sometimes", "zero3_units": "layers", "compile": "max", "fp8": "e4m3", "layout": "best",
    "layout_memory_gb": -1,
}


@pytest.mark.parametrize("name", [o.name for o in LAYOUT_OPTIONS if o.kind != "any"])
def test_a_bad_value_names_its_argument_in_every_front_end(name):
    for make in (ParallelConfig, *FRONT_ENDS):
        with pytest.raises(ValueError, match=f"`{name}="):
            make(**{name: BAD_VALUES[name]})


# Each rule between options, broken once: the options, the text of its problem and (for the rules ParaStrategy
# cannot run) a planner layout of 8 ranks that breaks it.
BROKEN_RULES = {
    "data_parallel_factors_problem": ({"dp": 4, "dp_replicate": 3, "dp_shard": 2, "zero": 1}, "must equal `dp=4`", None),
    "hybrid_sharding_problem": ({"dp": 4, "dp_replicate": 2, "zero": 0}, "needs `zero` in 1, 2 or 3", None),
    "zero_accumulation_problem": ({"zero": 1, "zero_accumulation": "reduce_each_microbatch"}, "needs `zero=2`", None),
    "expert_degree_problem": ({"dp": 4, "ep": 3}, "`ep=3` must divide `dp=4`", dict(dp=4, tp=2, ep=3)),
    "context_recompute_problem": ({"cp": 2, "activation_checkpointing": "selective"}, "with `cp>1` is not supported",
                                  dict(dp=4, cp=2, activation_checkpointing="selective")),
    "fp8_tensor_parallel_problem": ({"tp": 2, "fp8": "rowwise"}, "`fp8='rowwise'` with `tp=2` is not supported",
                                    dict(dp=4, tp=2, fp8="rowwise")),
    "pipeline_zero3_problem": ({"pp": 2, "zero": 3}, "`zero=3` with `pp>1` is not supported", dict(dp=4, pp=2, zero=3)),
    "pipeline_compile_problem": ({"pp": 2, "compile": True, "schedule": "zero_bubble", "virtual_stages": 2},
                                 "`compile=True` with `schedule='zero_bubble'` is not supported",
                                 dict(dp=4, pp=2, zero=1, compile=True, schedule="zero_bubble", virtual_stages=2)),
}


def test_every_rule_is_tested():
    assert {r.__name__ for r in LAYOUT_RULES + RUN_RULES} == set(BROKEN_RULES)


@pytest.mark.parametrize("rule", sorted(BROKEN_RULES))
def test_a_rule_is_written_once_and_used_by_config_strategy_and_planner(rule):
    values, text, planner_layout = BROKEN_RULES[rule]
    problems = rule_problems(values)
    assert len(problems) == 1 and text in problems[0][0]
    for make in (ParallelConfig, *FRONT_ENDS):
        with pytest.raises(ValueError, match=re.escape(problems[0][0])):
            make(**values)
    if planner_layout is None:  # without it the degrees are no layout: Layout refuses it too
        with pytest.raises(ValueError, match=re.escape(problems[0][0])):
            Layout(**{"dp": 4, **values})
        return
    # ParaStrategy cannot run it: the planner excludes the layout, naming the same problem.
    reasons = layout_problems(preset("gpt-125m"), Cluster.of("h100", nodes=1), Training(seq_len=1024, global_batch=64),
                              Layout(**planner_layout))
    assert problems[0][0] in reasons, reasons


def test_check_rules_message_names_the_fix():
    with pytest.raises(ValueError, match=r"`zero=3` with `pp>1` is not supported\. FSDP2 .* Use zero=1"):
        check_rules({"pp": 2, "zero": 3})


def test_parse_layout_reads_every_layout_field_by_its_declared_kind():
    text = ("dp=4,tp=2,pp=2,ep=1,zero=2,cp=1,cp_method=ring,cp_load_balance=true,dp_replicate=2,dp_shard=2,"
            "sequence_parallel=1,sp_save_input_shard=0,loss_parallel=false,activation_checkpointing=full,"
            "schedule=interleaved,microbatches=4,virtual_stages=2,pipeline_split=0:2:3:5,pipeline_balance=time,"
            "bucket_size_mb=none,zero_accumulation=reduce_each_step,zero3_units=blocks,compile=true,fp8=tensorwise")
    parsed = parse_layout(text)
    assert set(parsed) == {f.name for f in fields(Layout)}
    assert Layout(**parsed).strategy_kwargs() == {k: v for k, v in parsed.items() if v is not None or k != "bucket_size_mb"}
    with pytest.raises(ValueError, match="`--layout` entry 'dp=auto'"):
        parse_layout("dp=auto")  # a layout's degrees are numbers


def test_lightning_cli_reads_the_strategy_arguments_from_the_one_signature(tmp_path, monkeypatch):
    """LightningCLI (jsonargparse) parses a recipe's ``strategy.init_args`` from ParaFrontEnd's signature, takes
    overrides of any option, and a bad value still names its argument."""
    from lightning_para.cli import ParaCLI

    monkeypatch.setattr("sys.argv", ["lightning-para"])
    base = ["--config", str(RECIPES / "gpt-cpu-demo.yaml"), "--trainer.accelerator", "cpu",
            "--trainer.default_root_dir", str(tmp_path)]
    cli = ParaCLI(args=[*base, "--trainer.strategy.init_args.pipeline_balance", "time",
                        "--trainer.strategy.init_args.bucket_size_mb", "7.5"], run=False)
    config = cli.trainer.strategy.config
    assert (config.pp, config.tp, config.pipeline_balance, config.bucket_size_mb) == (2, 2, "time", 7.5)
    assert config.loss_parallel is True  # "auto" under the Trainer
    with pytest.raises(ValueError, match="`schedule='pipedream'` is unknown"):
        ParaCLI(args=[*base, "--trainer.strategy.init_args.schedule", "pipedream"], run=False)
