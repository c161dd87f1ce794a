"""Document boundaries of packed windows: each token's document and its position in it (docs/data.md,
"Document masks"). :class:`~lightning_para.recipes.tokens.TokenDataModule` adds them to its batches with
``document_mask=True``; models that keep attention inside documents say so with ``accepts_documents = True``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """The document of each token of ``tokens`` (..., T): 0 for the first, +1 after each EOS (an EOS ends its
    document, so it belongs to the one it ends)."""
    ends = (tokens == eos_id).long()
    return ends.cumsum(-1) - ends


def document_positions(documents: Tensor) -> Tensor:
    """Each token's position in its document (``documents`` (..., T) from :func:`document_ids`): 0 at each start."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def check_model_takes_documents(module: Any) -> None:
    """``ValueError`` naming ``data.document_mask`` unless ``module`` declares ``accepts_documents = True``."""
    if not getattr(module, "accepts_documents", False):
        raise ValueError(
            f"`data.document_mask=True` adds each token's document to the batches, (x, y, document_ids), but"
            f" `{type(module).__name__}` does not declare `accepts_documents = True`: its attention would cross"
            " documents (or it would not unpack the batch). Set `data.document_mask=False`, or use a model that"
            ' keeps attention inside documents (GPT, HFCausalLM, LitGPTCausalLM; docs/data.md, "Document masks").'
        )


__all__ = ["check_model_takes_documents", "document_ids", "document_positions"]
