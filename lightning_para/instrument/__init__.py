"""One instrumentation layer: what a run (or a dry run) measures, and the planner's prediction beside it.

* :mod:`.collectives`: the one collective counter (:class:`CollectiveCounter`; process group -> mesh
  dimension, payload and bus bytes, optionally timed);
* :mod:`.live_bytes`: the one live-bytes counter (:class:`LiveBytes`) and the states a rank holds;
* :mod:`.operators`: operator counters (bytes moved by non-matmul operators, DTensor-dispatched operators);
* :mod:`.records`: the records measured and predicted figures share (:class:`MemoryFigures`, :class:`CommFigure`);
* :mod:`.compare`: the one comparator (predicted vs measured, tolerances) and the planner's predicted record of a rank.

Used by the profiler (``observe/``), the dry run (``simulate/``), calibration (``calibrate/``) and
``lightning-para plan --validate``. It sits above the planner (it reads its estimates) and below them all.
"""

from lightning_para.instrument.collectives import CollectiveCounter, group_labels
from lightning_para.instrument.compare import MeasuredRank, PredictionCheck, compare, predicted_rank
from lightning_para.instrument.live_bytes import LiveBytes, measure_states
from lightning_para.instrument.operators import DTensorOpCounter, TrafficCounter
from lightning_para.instrument.records import CommFigure, MemoryFigures

__all__ = [
    "CollectiveCounter", "CommFigure", "DTensorOpCounter", "LiveBytes", "MeasuredRank", "MemoryFigures",
    "PredictionCheck", "TrafficCounter", "compare", "group_labels", "measure_states", "predicted_rank",
]
