"""One instrumentation layer: what a run (or a dry run) measures, and the planner's prediction beside it.

* :mod:`.collectives`: the one collective counter (:class:`CollectiveCounter`; process group -> mesh
  dimension, payload and bus bytes, optionally timed);
* :mod:`.live_bytes`: the one live-bytes counter (:class:`LiveBytes`); :mod:`.saved_activations`: the bytes autograd
  saves for backward (:class:`SavedActivationMeter`, the pipeline runner's ``measure_activations``);
* :mod:`.operators`: operator counters (bytes moved by non-matmul operators, DTensor-dispatched operators);
* :mod:`.records`: the record measured and predicted collectives share (:class:`CommFigure`); memory's two records,
  ``MeasuredMemory`` and ``PredictedMemory``, and the one way held bytes are counted are :mod:`lightning_para.memory`'s;
* :mod:`.compare`: the one comparator (predicted vs measured, tolerances) and the planner's predicted side of a
  dry-run rank.

Used by the profiler (``observe/``), the dry run (``simulate/``), calibration (``calibrate/``) and
``lightning-para plan --validate``. It sits above the planner (it reads its estimates) and below them all.
"""

from lightning_para.instrument.collectives import CollectiveCounter, group_labels
from lightning_para.instrument.compare import MeasuredRank, PredictionCheck, compare, memory_comparisons, predicted_rank
from lightning_para.instrument.live_bytes import LiveBytes
from lightning_para.instrument.operators import DTensorOpCounter, TrafficCounter
from lightning_para.instrument.records import CommFigure
from lightning_para.instrument.saved_activations import SavedActivationMeter

__all__ = [
    "CollectiveCounter", "CommFigure", "DTensorOpCounter", "LiveBytes", "MeasuredRank", "PredictionCheck",
    "SavedActivationMeter", "TrafficCounter", "compare", "group_labels", "memory_comparisons", "predicted_rank",
]
