"""What a run shows: the profiler callback (:mod:`.profiler`), communication tracing
(:mod:`.comm_trace`), memory against the ZeRO formulas (:mod:`.memory`) and the pipeline
timeline (:mod:`.timeline`)."""

from lightning_para.observe.profiler import ParaProfiler

__all__ = ["ParaProfiler"]
