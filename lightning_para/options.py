"""The layout's options declared once: the values each takes, its check, and the rules that involve several.

``config.py`` (:class:`~lightning_para.config.ParallelConfig`, ParaStrategy's arguments), the planner's
:class:`~lightning_para.plan.layout.Layout` and the ``--layout`` parser (:func:`~lightning_para.plan.run.parse_layout`)
check a value with :func:`check_option` and the rules between values with :func:`check_rules`, so an option added
here is known to all of them, with one message. A leaf: it imports only the dimension registries that own their names
(``parallel/pipeline/schedules.py``, ``parallel/context/attention.py``, ``parallel/data/fsdp.py``,
``parallel/activation_checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from lightning_para.parallel.activation_checkpoint import MODES as _AC_MODES
from lightning_para.parallel.context.attention import CP_METHODS as _CP_ATTENTION
from lightning_para.parallel.data.fsdp import ZERO3_UNITS
from lightning_para.parallel.fp8 import FP8_RECIPES as _FP8
from lightning_para.parallel.pipeline.schedules import PIPELINE_SCHEDULES

# Lightning's precision names that ParaPrecision implements (see precision.py for what each keeps).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
# ``activation_checkpointing`` (the planner's "recomputation"): none, per-op selective (save every matmul,
# attention and collective output), torchtitan's per-op selective (``"selective_op"``: every second matmul
# recomputed, see ``parallel/activation_checkpoint.py``), whole blocks.
ACTIVATION_CHECKPOINTING = (None, *_AC_MODES)
# Every pipeline schedule ParaStrategy runs (``parallel/pipeline/schedules.py`` is the registry).
SCHEDULES = PIPELINE_SCHEDULES
# The schedules whose bubble and in-flight activations the planner prices (``plan/pipeline.py``);
# the others are valid layouts that the planner rejects with a reason.
PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")
ZERO_STAGES = (0, 1, 2, 3)
# How ZeRO accumulates gradients over several microbatches: "no_sync" (whole gradients, one reduction
# per step), "reduce_each_step" (ZeRO-2/3: one reduce-scatter per Lightning micro-step), and
# "reduce_each_microbatch" (ZeRO-2: also one per pipeline microbatch and stage, so a pipeline rank never
# holds more than one stage's whole gradients: the Llama 3 paper's FSDP under pipelining).
ZERO_ACCUMULATION = ("no_sync", "reduce_each_step", "reduce_each_microbatch")
CP_METHODS = tuple(_CP_ATTENTION)  # "ring" (ring attention), "all_to_all" (DeepSpeed-Ulysses)
PIPELINE_BALANCE = ("params", "time")
TP_UNPLANNED = ("error", "replicate")
FP8_RECIPES = (None, *_FP8)  # torchao float8 training (parallel/fp8.py); None: off

assert set(PLANNED_SCHEDULES) <= set(SCHEDULES), "the planner prices a schedule ParaStrategy does not run"

# ----------------------------------------------------------------------------- each option's check
# Options taking one of a list of values.
CHOICES: dict[str, tuple[Any, ...]] = {
    "schedule": SCHEDULES, "activation_checkpointing": ACTIVATION_CHECKPOINTING, "cp_method": CP_METHODS,
    "zero_accumulation": ZERO_ACCUMULATION, "zero3_units": tuple(ZERO3_UNITS), "pipeline_balance": PIPELINE_BALANCE,
    "fp8": FP8_RECIPES, "tp_unplanned": TP_UNPLANNED,
}
# Degrees and counts: positive integers (1 disables a dimension).
DEGREES = ("dp", "tp", "pp", "ep", "cp", "dp_replicate", "dp_shard", "virtual_stages", "microbatches")
# True or False.
FLAGS = ("sequence_parallel", "cp_load_balance", "cp_check", "sp_save_input_shard", "loss_parallel", "compile")


def choices_text(values: Any) -> str:
    return ", ".join(repr(v) for v in values)


def check_option(name: str, value: Any) -> None:
    """``ValueError`` naming ``name`` when ``value`` is not one it takes (its relations to other options are
    :func:`check_rules`'). ``None`` is for the caller to allow or not."""
    if name in CHOICES:
        if value not in CHOICES[name]:
            shown = sorted(CHOICES[name]) if name == "cp_method" else CHOICES[name]
            raise ValueError(f"`{name}={value!r}` is unknown. Choose one of {choices_text(shown)}.")
    elif name in DEGREES:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer (1 disables this dimension).")
    elif name in FLAGS:
        if not isinstance(value, bool):
            raise ValueError(f"`{name}={value!r}` must be True or False.")
    elif name == "zero":
        if isinstance(value, bool) or value not in ZERO_STAGES:
            raise ValueError(f"`zero={value!r}` is not a ZeRO stage. Choose one of {choices_text(ZERO_STAGES)}.")
    elif name == "bucket_size_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`bucket_size_mb={value!r}` must be a positive number of MiB.")


# ----------------------------------------------------------------------------- rules between options
def zero_accumulation_problem(zero_accumulation: str, zero: Any) -> Optional[str]:
    if zero_accumulation == "reduce_each_microbatch" and zero != 2:
        return (
            f"`zero_accumulation='reduce_each_microbatch'` reduce-scatters each pipeline microbatch's gradients"
            f" into ZeRO-2's shards; it needs `zero=2` (got zero={zero}). Set zero=2, or use"
            " zero_accumulation='reduce_each_step' (ZeRO-2/3, one reduction per Lightning micro-step)."
        )
    return None


def hybrid_sharding_problem(dp_replicate: Optional[int], zero: Any) -> Optional[str]:
    if (dp_replicate or 1) > 1 and zero == 0:
        return (
            f"`dp_replicate={dp_replicate}` (hybrid sharding) needs `zero` in 1, 2 or 3: ZeRO-0 shards"
            " nothing, so there is nothing to replicate across groups. Use zero>=1, or leave dp_replicate out (plain"
            " data parallel)."
        )
    return None


def data_parallel_factors_problem(dp: int, dp_replicate: Optional[int], dp_shard: Optional[int]) -> Optional[str]:
    """``dp = dp_replicate x dp_shard``, each dividing ``dp``."""
    r, s = dp_replicate, dp_shard
    if r is not None and s is not None and r * s != dp:
        return (
            f"`dp_replicate={r}` x `dp_shard={s}` = {r * s} must equal `dp={dp}`."
            f" Leave out dp (it is dp_replicate x dp_shard), or choose dp_replicate x dp_shard = {dp}."
        )
    for name, value in (("dp_replicate", r), ("dp_shard", s)):
        if value is not None and dp % value:
            choices = [d for d in range(1, dp + 1) if dp % d == 0]
            return f"`{name}={value}` must divide `dp={dp}`. Choose {name} in {choices}."
    return None


def check_rules(values: Mapping[str, Any]) -> None:
    """The rules between options, written once (``ValueError`` naming the arguments and the fix): ``values`` holds
    the options given (a missing one is not checked)."""
    if isinstance(values.get("dp"), int):
        problem = data_parallel_factors_problem(values["dp"], values.get("dp_replicate"), values.get("dp_shard"))
        if problem:
            raise ValueError(problem)
    if values.get("layout") != "auto":  # layout="auto" picks zero >= 1 for hybrid sharding
        problem = hybrid_sharding_problem(values.get("dp_replicate"), values.get("zero", 0))
        if problem:
            raise ValueError(problem)
    if "zero_accumulation" in values:
        problem = zero_accumulation_problem(values["zero_accumulation"], values.get("zero", 0))
        if problem:
            raise ValueError(problem)

__all__ = [
    "CHOICES", "DEGREES", "FLAGS", "check_option", "check_rules", "choices_text", "data_parallel_factors_problem",
    "hybrid_sharding_problem", "zero_accumulation_problem",
    "ACTIVATION_CHECKPOINTING", "CP_METHODS", "FP8_RECIPES", "PIPELINE_BALANCE", "PLANNED_SCHEDULES", "PRECISIONS", "SCHEDULES",
    "TP_UNPLANNED", "ZERO3_UNITS", "ZERO_ACCUMULATION", "ZERO_STAGES",
]
