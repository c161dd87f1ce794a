"""The values ParaStrategy's options take, named once (issue 22: one layout vocabulary).

``config.py`` validates ParaStrategy's arguments against these lists and the planner
(``plan/``) prices the same names, so a precision, schedule or recomputation mode added here is
known to both. A leaf: it imports only the dimension registries that own their names
(``parallel/pipeline/schedules.py``, ``parallel/context/attention.py``, ``parallel/data/fsdp.py``,
``parallel/activation_checkpoint.py``).
"""

from __future__ import annotations

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

__all__ = [
    "ACTIVATION_CHECKPOINTING", "CP_METHODS", "FP8_RECIPES", "PIPELINE_BALANCE", "PLANNED_SCHEDULES", "PRECISIONS", "SCHEDULES",
    "TP_UNPLANNED", "ZERO3_UNITS", "ZERO_ACCUMULATION", "ZERO_STAGES",
]
