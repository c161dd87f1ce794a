"""Document masks: causal attention that stays inside each document of a packed sequence.

A training sequence packs several documents (``TokenDataModule(document_mask=True)``). ``document_ids``
``[batch, seq]`` numbers each token's document within its sequence (non-decreasing); a query then attends to
the keys at or before it *in its own document*: the causal mask AND the same document.

:func:`document_attention` is that attention in SDPA's layout. It is an overridable torch function
(``torch.overrides``), so a ``TorchFunctionMode`` can take it over: context parallelism's mode
(:mod:`.attention`) runs it as ring or all-to-all attention with the document ids of the whole sequence, and
the first-step check (:mod:`.check`) records its inputs. On CUDA it runs FlexAttention (compiled, with a block
mask: blocks that cross documents are skipped); elsewhere SDPA with a boolean ``[batch, 1, seq, seq]`` mask.

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

__all__ = ["causal_document_mask", "check_document_ids", "document_attention"]

BACKENDS = ("sdpa", "flex")
_compiled_flex: Any = None
# The last block mask built, with the document ids it was built from (kept alive, so `is` identifies them):
# every layer of one forward gets the same document-id tensor and builds its mask once.
_last_block_mask: Optional[tuple[Tensor, Any]] = None


def check_document_ids(document_ids: Any, batch: int, seq: int, what: str = "document_ids") -> Tensor:
    """``document_ids`` as a ``[batch, seq]`` integer tensor, or ``ValueError`` naming ``what``."""
    if not isinstance(document_ids, Tensor) or document_ids.dim() != 2 or document_ids.is_floating_point() \
            or tuple(document_ids.shape) != (batch, seq):
        shape = tuple(document_ids.shape) if isinstance(document_ids, Tensor) else type(document_ids).__name__
        raise ValueError(
            f"`{what}` must be an integer tensor [batch, seq] = {[batch, seq]} (each token's document), got {shape}."
        )
    return document_ids


def causal_document_mask(document_ids: Tensor) -> Tensor:
    """``[batch, 1, seq, seq]`` bool: query ``i`` may see key ``j`` when ``j <= i`` and both are in one document."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]


def document_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    document_ids: Tensor,
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    backend: Optional[str] = None,
) -> Tensor:
    """Causal attention within documents: ``F.scaled_dot_product_attention``'s layout and arguments.

    Args:
        query, key, value: ``[batch, heads | kv_heads, seq, head_dim]``.
        document_ids: ``[batch, seq]`` integers, the document of each token (of this call's tokens: under
            context parallelism the local chunks, split like the tokens).
        dropout_p, scale, enable_gqa: as SDPA's.
        backend: ``"flex"`` (FlexAttention with a block mask; compiled on CUDA) or ``"sdpa"`` (a boolean mask);
            ``None``: flex on CUDA without dropout, else SDPA.
    """
    args = (query, key, value, document_ids)
    if has_torch_function(args):
        return handle_torch_function(
            document_attention, args, *args, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa, backend=backend
        )
    check_document_ids(document_ids, query.shape[0], query.shape[2])
    if backend not in (None, *BACKENDS):
        raise ValueError(f"`backend={backend!r}` is unknown. Choose one of {', '.join(map(repr, BACKENDS))} or None.")
    if backend is None:
        backend = "flex" if query.is_cuda and dropout_p == 0.0 else "sdpa"
    if backend == "flex":
        return _flex(query, key, value, document_ids, scale, enable_gqa)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_document_mask(document_ids.to(query.device)), dropout_p=dropout_p,
        scale=scale, enable_gqa=enable_gqa,
    )


def _flex(query: Tensor, key: Tensor, value: Tensor, document_ids: Tensor, scale: Optional[float], gqa: bool) -> Tensor:
    global _compiled_flex, _last_block_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _last_block_mask is None or _last_block_mask[0] is not document_ids:
        docs = document_ids.to(query.device)

        def same_document(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return (q >= k) & (docs[b, q] == docs[b, k])

        batch, seq = docs.shape
        _last_block_mask = (document_ids, create_block_mask(same_document, batch, None, seq, seq, device=query.device))
    run = flex_attention
    if query.is_cuda:  # eager FlexAttention materialises the scores; compiled, it is a fused kernel
        _compiled_flex = _compiled_flex or torch.compile(flex_attention)
        run = _compiled_flex
    return run(query, key, value, block_mask=_last_block_mask[1], scale=scale, enable_gqa=gqa)
