"""Pipeline parallelism: the contract (:mod:`.spec`), the split (:mod:`.split`), the runner of
Lightning steps (:mod:`.runner`), torch's schedules (:mod:`.build`; their rules are in ``lightning_para.spec.schedules``) and measurement
(:mod:`.measure`)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".measure": ("PipelineEvent", "PipelineStats", "PipelineStepStats"),
    ".runner": ("PipelineRunner",),
    ".spec": ("PipelineSpec",),
    ".split": ("apply_pipeline_parallel",),
})
