"""The planner: predict memory, communication, bubble and step time of a parallel layout, and search for the best.

A pure-Python cost model (no process group, no GPU)::

    from lightning_para.plan import Cluster, Training, preset, search

    result = search(preset("llama3-8b"), Cluster.of("h100", nodes=1), Training(seq_len=8192, global_batch=64))
    print(result.table())
    print(result.strategy_yaml())

Formulas and their sources: ``docs/planner.md`` and each module's docstring.
"""

from lightning_para.plan.cluster import (
    GPU_SPECS,
    OPTIMIZERS,
    PRECISIONS,
    Cluster,
    Training,
)
from lightning_para.plan.comm import Collective
from lightning_para.plan.cost import (
    Estimate,
    PredictedMemory,
    RankEstimate,
    estimate,
    layout_problems,
)
from lightning_para.plan.describe import describe_module
from lightning_para.plan.layout import Layout
from lightning_para.plan.memory import layer_activation_bytes, zero_state_bytes
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import SCHEDULES, bubble_fraction
from lightning_para.plan.presets import PRESETS, preset
from lightning_para.plan.result import PlanResult, Rejected
from lightning_para.plan.search import SearchSpace, search

__all__ = [
    "GPU_SPECS", "OPTIMIZERS", "PRECISIONS", "PRESETS", "SCHEDULES",
    "Cluster", "Collective", "Estimate", "Layout", "PredictedMemory", "ModelDesc", "PlanResult", "RankEstimate",
    "Rejected", "SearchSpace", "Training",
    "bubble_fraction", "describe_module", "estimate", "layer_activation_bytes", "layout_problems", "preset",
    "search", "zero_state_bytes",
]
