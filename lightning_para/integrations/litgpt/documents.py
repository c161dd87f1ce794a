"""Document masks for LitGPT models: :func:`forward_with_documents`.

``GPT.forward`` has no way to say where packed documents start: its blocks get ``cos[:T]``, ``sin[:T]`` and no
mask. :func:`forward_with_documents` runs the same layers itself (as the pipeline layers do: the embedding, each
block, the final norm and head) and hands every block

* RoPE tables at the tokens' positions when the batch has them (``cos[position_ids]``: positions restarting per
  document; under cp split like the tokens, so the cp adapter leaves these tables, passed by keyword, alone);
* the document ids in the block's ``mask`` argument, which LitGPT passes down to its attention's
  ``scaled_dot_product_attention(q, k, v, mask)``. Each attention module gets its own version of that method
  (an instance attribute; the class is untouched) that runs an integer ``[batch, seq]`` mask as
  :func:`~lightning_para.parallel.context.documents.document_attention` -- ring or all-to-all attention under cp
  -- and any other mask as LitGPT does.

The ids are arguments of every block, so activation checkpointing recomputes the same masked attention.
Configs whose forward does more than those layers, or whose attention builds its own mask, are refused.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.integrations.litgpt.pipeline import check_gpt
from lightning_para.integrations.litgpt.tensor import is_litgpt_attention
from lightning_para.parallel.context.documents import document_attention

# Attention modules whose `scaled_dot_product_attention` already takes document ids (weak: keeps none alive).
_ADAPTED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def check_documents(model: nn.Module) -> None:
    """``ValueError`` naming ``data.document_mask`` unless the model's attention can keep to documents."""
    check_gpt(model, "LitGPT with document masks (data.document_mask=True)")
    config = model.config
    odd = {k: getattr(config, k) for k in ("sliding_window_size", "attention_logit_softcapping")
           if getattr(config, k, None) is not None}
    if odd:
        raise ValueError(
            f"LitGPT with document masks: the config sets {odd}, whose attention builds its own mask or scores. Set"
            " `data.document_mask=False` for this model."
        )


def _documents_sdpa(attention: nn.Module, litgpt_sdpa: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if mask is None or mask.is_floating_point() or mask.dtype == torch.bool:
            return litgpt_sdpa(q, k, v, mask)
        config = attention.config  # LitGPT's scale, its per-module config under tp
        scale = getattr(attention, "mscale", 1.0) ** 2 / math.sqrt(config.attention_scores_scalar or config.head_size)
        # k and v arrive with their groups repeated to n_head (LitGPT's forward does that before this call).
        return document_attention(q, k, v, mask, scale=scale).transpose(1, 2)

    return sdpa


def forward_with_documents(
    model: nn.Module, idx: Tensor, document_ids: Tensor, position_ids: Optional[Tensor] = None
) -> Tensor:
    """Logits of a LitGPT ``GPT`` on ``idx`` (B, T) with attention kept inside each document of ``document_ids``
    (B, T); ``position_ids`` (B, T): RoPE positions (restarting per document), else ``0..T-1``."""
    check_documents(model)
    for module in model.modules():
        if is_litgpt_attention(module) and module not in _ADAPTED:
            module.scaled_dot_product_attention = _documents_sdpa(module, module.scaled_dot_product_attention)
            _ADAPTED.add(module)
    x = model.transformer.wte(idx)
    if position_ids is None:  # GPT.forward's tables, positionally: the cp adapter replaces them with global ones
        cos, sin = model.cos[: idx.shape[1]].unsqueeze(0).to(x.device), model.sin[: idx.shape[1]].unsqueeze(0).to(x.device)
        for block in model.transformer.h:
            x = block(x, cos, sin, document_ids)  # the mask argument carries the document ids (see above)
    else:  # by keyword: the batch's own positions (split like the tokens under cp), which the cp adapter keeps
        index = position_ids.to(model.cos.device)
        cos, sin = model.cos[index].to(x.device), model.sin[index].to(x.device)
        for block in model.transformer.h:
            x = block(x, cos=cos, sin=sin, mask=document_ids)
    return model.lm_head(model.transformer.ln_f(x))


__all__ = ["check_documents", "forward_with_documents"]
