"""LitGPT models (``litgpt.model.GPT``) under every layout (``pip install lightning-para[litgpt]``).

Public entry points (also used by the Fabric front end):

* tensor / sequence parallelism: nothing to call. ``import lightning_para`` registers a
  :class:`~lightning_para.parallel.tensor.adapters.TensorParallelAdapter` for LitGPT's
  ``CausalSelfAttention`` (:mod:`.tensor`): the grouped-query fused ``qkv`` gets explicit block sizes,
  and each attention module its own config copy with the per-rank head counts;
* context parallelism: nothing to call. Its ``ContextParallelAdapter`` (:mod:`.context`) gives every
  block the RoPE tables indexed by this rank's global positions;
* expert parallelism for ``LLaMAMoE``: nothing to call. Its ``ExpertAdapter`` (:mod:`.experts`) stacks
  each block's experts into expert-major parameters sharded over ep and routes tokens by all-to-all;
* :func:`pipeline_spec`: a ready :class:`~lightning_para.PipelineSpec` for a ``GPT``
  (``configure_pipeline()`` is one line);
* :func:`forward_with_documents`: the model's logits with attention kept inside packed documents
  (:mod:`.documents`; what ``LitGPTCausalLM`` runs for batches with document ids);
* :func:`load_checkpoint` / :func:`export`: a LitGPT checkpoint folder (``lit_model.pth`` +
  ``model_config.yaml``) into a model, and a trained model (any layout) back to that format.

litgpt itself is imported only inside the functions that need it. See ``docs/litgpt.md``.
"""

from lightning_para.integrations.litgpt import context as _context  # noqa: F401  (registers its cp adapter)
from lightning_para.integrations.litgpt import experts as _experts  # noqa: F401  (registers its expert adapter)
from lightning_para.integrations.litgpt.checkpoint import export, litgpt_models, load_checkpoint
from lightning_para.integrations.litgpt.documents import forward_with_documents
from lightning_para.integrations.litgpt.pipeline import pipeline_spec
from lightning_para.integrations.litgpt.tensor import ADAPTER as _TENSOR_PARALLEL_ADAPTER
from lightning_para.integrations.litgpt.tensor import is_litgpt_attention, is_litgpt_module
from lightning_para.parallel.tensor.adapters import register_tensor_parallel_adapter

register_tensor_parallel_adapter(_TENSOR_PARALLEL_ADAPTER)

__all__ = [
    "export", "forward_with_documents", "is_litgpt_attention", "is_litgpt_module", "litgpt_models", "load_checkpoint", "pipeline_spec",
]
