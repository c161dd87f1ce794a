"""The planner: predict memory, communication, bubble and step time of a parallel layout, and search for the best.

A pure-Python cost model (no process group, no GPU, no Lightning; it imports only ``lightning_para.spec``)::

    from lightning_para.plan import Cluster, Training, preset, search

    result = search(preset("llama3-8b"), Cluster.of("h100", nodes=1), Training(seq_len=8192, global_batch=64))
    print(result.table())
    print(result.strategy_yaml())

Formulas and their sources: ``docs/planner.md`` and each module's docstring. A module's description of a model
(``describe_module``) is :mod:`lightning_para.describe`'s; a run's translation to the planner's inputs
:mod:`lightning_para.run_plan`'s.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".cluster": ("GPU_SPECS", "OPTIMIZERS", "PRECISIONS", "Cluster", "Training"),
    ".comm": ("Collective",),
    ".cost": ("Estimate", "RankEstimate", "estimate", "layout_problems"),
    ".layout": ("Layout",),
    ".memory": ("layer_activation_bytes",),
    ".model": ("ModelDesc",),
    ".presets": ("PRESETS", "preset"),
    ".result": ("PlanResult", "Rejected"),
    ".search": ("SearchSpace", "search"),
    "lightning_para.spec.memory": ("PredictedMemory",),
    "lightning_para.spec.schedules": ("bubble_fraction",),
    "lightning_para.spec.zero": ("zero_state_bytes",),
})
