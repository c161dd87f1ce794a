"""What a run shows: the profiler callback (:mod:`.profiler`), communication tracing
(:mod:`lightning_para.instrument.collectives`), memory against the ZeRO formulas (:mod:`.memory`) and the pipeline
timeline (:mod:`.timeline`)."""

from lightning_para.observe.profiler import ParaProfiler

__all__ = ["ParaProfiler"]
