"""``pipeline_spec(gpt)``: a ready :class:`~lightning_para.PipelineSpec` for a LitGPT ``GPT``.

``GPT.forward`` embeds the tokens, slices the RoPE tables ``cos``/``sin`` (buffers of the ``GPT``)
to the sequence length and calls every block as ``block(x, cos, sin, mask, input_pos, ...)``.
Under pipeline parallelism no rank runs that ``forward``, so:

* the pipeline layers are the model's own modules ``[transformer.wte, *transformer.h,
  transformer.ln_f, lm_head]``: names stay LitGPT's (checkpoints, tensor-parallel plans);
* each block gets a forward pre-hook that, when the block is called alone (``x = block(x)``),
  passes what ``GPT.forward`` would: ``cos[:T]``, ``sin[:T]`` with ``T = x.shape[1]`` (under
  sequence parallelism the stream is a global-shaped DTensor, so ``T`` is the whole sequence).
  Called by ``GPT.forward`` itself, the hook does nothing;
* the loss is next-token cross-entropy on LitGPT's batch convention: ``(input_ids, targets)``
  with targets already shifted (``litgpt pretrain``: ``data[:, :-1], data[:, 1:]``), or one token
  tensor that is split that way; ``-100`` targets are ignored.

Not reproduced by the layers (refused with a ``ValueError``): ``scale_embeddings``,
``final_logit_softcapping`` and per-block ``rope_indices`` (Gemma-style configs).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_para.integrations.litgpt.tensor import is_litgpt_module
from lightning_para.parallel.pipeline.spec import PipelineSpec
from lightning_para.parallel.tensor.loss import IGNORE_INDEX

UNSUPPORTED_CONFIG = {"scale_embeddings": False, "final_logit_softcapping": None, "rope_indices": None}
# The GPTs whose blocks already carry the pipeline hook (pipeline_spec may be called more than once).
_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def check_gpt(model: nn.Module, what: str = "pipeline_spec") -> None:
    """``ValueError`` naming the problem unless ``model`` is a LitGPT ``GPT`` whose forward the layers reproduce."""
    if not is_litgpt_module(model, "GPT"):
        raise ValueError(f"{what} expects a litgpt.model.GPT, got {type(model).__name__}.")
    config = model.config
    odd = {k: getattr(config, k, v) for k, v in UNSUPPORTED_CONFIG.items() if getattr(config, k, v) not in (v, False)}
    if odd:
        raise ValueError(
            f"{what}: the LitGPT config sets {odd}, which GPT.forward applies outside the blocks and the pipeline"
            " layers do not reproduce. Write configure_pipeline() yourself with layers that apply it, or train with pp=1."
        )


def _rope_inputs(gpt_ref: Callable[[], Any], block: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    if len(args) != 1 or "cos" in kwargs:
        return None  # called by GPT.forward: it passed cos and sin
    gpt = gpt_ref()
    x = args[0]
    seq = x.shape[1]
    cos = gpt.cos[:seq].unsqueeze(0).to(device=x.device)
    sin = gpt.sin[:seq].unsqueeze(0).to(device=x.device)
    return (x, cos, sin), kwargs


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(input_ids, targets)`` as they are (targets shifted, LitGPT's convention), or one token tensor split."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"], batch.get("labels", batch.get("targets"))
    if isinstance(batch, Tensor):
        return batch[:, :-1], batch[:, 1:]
    if isinstance(batch, (tuple, list)) and len(batch) in (3, 4):
        raise ValueError(
            "The LitGPT pipeline does not take document masks, (input_ids, targets, document_ids[, position_ids]):"
            " its stages run GPT's layers with the causal mask. Set `data.document_mask=False`, or pp=1."
        )
    raise ValueError(
        "The LitGPT pipeline expects batches (input_ids, targets) with targets already shifted, a dict with"
        " 'input_ids' and 'labels', or one [batch, seq+1] token tensor; pass split_batch= for another form."
    )


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the targets (``-100`` ignored), as ``litgpt.utils.chunked_cross_entropy``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def pipeline_spec(
    model: nn.Module,
    split_batch: Callable[[Any], tuple[Any, Any]] = split_batch,
    loss_fn: Callable[[Any, Any], Tensor] = next_token_loss,
    log_name: Optional[str] = "loss",
) -> PipelineSpec:
    """The pipeline of a LitGPT ``GPT`` (see module docstring)::

        def configure_pipeline(self):
            return pipeline_spec(self.model)   # self.model = litgpt.model.GPT(config)
    """
    check_gpt(model)
    if model not in _HOOKED:
        ref = weakref.ref(model)
        for block in model.transformer.h:
            block.register_forward_pre_hook(lambda b, a, k: _rope_inputs(ref, b, a, k), with_kwargs=True)
        _HOOKED.add(model)
    layers = [model.transformer.wte, *model.transformer.h, model.transformer.ln_f, model.lm_head]
    return PipelineSpec(layers=layers, split_batch=split_batch, loss_fn=loss_fn, log_name=log_name)


__all__ = ["check_gpt", "next_token_loss", "pipeline_spec", "split_batch"]
