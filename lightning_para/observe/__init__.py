"""What a run shows: the profiler callback (:mod:`.profiler`), communication tracing
(:mod:`lightning_para.instrument.collectives`), memory against the ZeRO formulas (:mod:`.memory`) and the pipeline
timeline (:mod:`.timeline`)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".profiler": ("ParaProfiler",),
})
