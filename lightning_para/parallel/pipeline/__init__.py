"""Pipeline parallelism: the contract (:mod:`.spec`), the split (:mod:`.split`), the runner of
Lightning steps (:mod:`.runner`), torch's schedules (:mod:`.schedules`) and measurement
(:mod:`.measure`)."""

from lightning_para.parallel.pipeline.measure import PipelineEvent, PipelineStats, PipelineStepStats
from lightning_para.parallel.pipeline.runner import PipelineRunner
from lightning_para.parallel.pipeline.spec import PipelineSpec
from lightning_para.parallel.pipeline.split import apply_pipeline_parallel

__all__ = ["PipelineEvent", "PipelineRunner", "PipelineStats", "PipelineStepStats", "PipelineSpec", "apply_pipeline_parallel"]
