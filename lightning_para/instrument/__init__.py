"""One instrumentation layer: what a run (or a dry run) measures, and the planner's prediction beside it.

* :mod:`.collectives`: the one collective counter (:class:`CollectiveCounter`; process group -> mesh
  dimension, payload and bus bytes, optionally timed);
* :mod:`.live_bytes`: the one live-bytes counter (:class:`LiveBytes`); :mod:`.saved_activations`: the bytes autograd
  saves for backward (:class:`SavedActivationMeter`, the pipeline runner's ``measure_activations``);
* :mod:`.operators`: operator counters (bytes moved by non-matmul operators, DTensor-dispatched operators);
* :mod:`.records`: the record measured and predicted collectives share (:class:`CommFigure`); memory's two records,
  ``MeasuredMemory`` and ``PredictedMemory``, are :mod:`lightning_para.spec.memory`'s, the one way held bytes are
  counted :mod:`lightning_para.memory`'s;
* :mod:`.compare`: the one comparator (predicted vs measured, tolerances) and the planner's predicted side of a
  dry-run rank.

Used by the profiler (``observe/``), the dry run (``simulate/``), calibration (``calibrate/``) and
``lightning-para plan --validate``. It sits above the planner (it reads its estimates) and below them all.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".collectives": ("CollectiveCounter", "group_labels"),
    ".compare": ("MeasuredRank", "PredictionCheck", "compare", "memory_comparisons", "predicted_rank"),
    ".live_bytes": ("LiveBytes",),
    ".operators": ("DTensorOpCounter", "TrafficCounter"),
    ".records": ("CommFigure",),
    ".saved_activations": ("SavedActivationMeter",),
})
