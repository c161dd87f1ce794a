"""Hugging Face ``transformers`` causal LMs under every layout (``pip install lightning-para[transformers]``).

* :func:`pipeline_spec`: a ready :class:`~lightning_para.PipelineSpec` for decoder-only causal LMs
  (Llama, Mistral, Qwen2/Qwen3, Mixtral and the other models of the same shape), so that
  ``configure_pipeline()`` is one line: ``return pipeline_spec(self.model)``;
* expert parallelism for transformers MoE blocks (:mod:`.experts`): applied by ``ParaStrategy(ep=...)``
  itself, nothing to call;
* context parallelism (:mod:`.context`): global ``position_ids``, masks and shifted labels under
  ``ParaStrategy(cp=...)``, applied by the strategy itself, nothing to call;
* :func:`export`: a checkpoint of any layout -> a folder ``AutoModelForCausalLM.from_pretrained`` opens.

transformers itself is imported only inside the functions that need it (``# optional:``), so
``import lightning_para`` works without it. See ``docs/transformers.md``.
"""

from lightning_para.integrations.transformers import dry_run as _dry_run  # noqa: F401 - registers its meta answer
from lightning_para.integrations.transformers.context import is_pretrained_model
from lightning_para.integrations.transformers.experts import is_transformers_experts, transformers_experts
from lightning_para.integrations.transformers.export import export, transformers_models
from lightning_para.integrations.transformers.pipeline import check_causal_lm, pipeline_spec

__all__ = [
    "check_causal_lm",
    "export",
    "is_pretrained_model",
    "is_transformers_experts",
    "pipeline_spec",
    "transformers_experts",
    "transformers_models",
]
