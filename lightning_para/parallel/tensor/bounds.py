"""Range checks where tensor parallelism would otherwise hide bad indices.

On one device ``F.embedding`` raises ``IndexError: index out of range in self`` for an id outside
``[0, num_embeddings)`` and ``F.cross_entropy`` raises ``IndexError: Target 7 is out of bounds.``.
Split by vocabulary, each rank looks up (or picks the logit of) only the ids in its own row range
and treats the others as "someone else's": an id no rank owns becomes a zero vector, a label no
rank owns a logit of 0, and training goes on. These checks restore torch's errors.

Why no collective: the token ids and the labels are the same tensor on every tp rank (the tp
ranks of one data-parallel rank share the batch), so a local ``aminmax`` over the *whole* tensor
gives every tp rank the same verdict and every one raises the same error. The cost is one
reduction over the ids (a few thousand integers) and one host read of two integers per forward
(``docs/reliability.md`` has the measured figure). The other data-parallel ranks hold other
batches and continue into their next collective; the watchdog releases them (a rank that raised
publishes a verdict, see :mod:`lightning_para.reliability.watchdog`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def check_token_ids(ids: Tensor, num_embeddings: int, where: str = "the vocab-parallel embedding") -> None:
    """``IndexError`` naming the range found and the vocabulary size if any id is outside ``[0, num_embeddings)``."""
    if ids.numel() == 0 or ids.is_floating_point() or ids.is_meta:  # meta (the dry run): no values to check
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids.detach())).tolist())
    if lo < 0 or hi >= num_embeddings:
        raise IndexError(
            f"Token ids must lie in [0, {num_embeddings}) for {where} (num_embeddings={num_embeddings}), but this"
            f" batch holds ids from {lo} to {hi}. On one device torch raises 'index out of range in self' here;"
            " tensor parallelism would have turned the out-of-range ids into zero vectors. Check the tokenizer's"
            " vocabulary size against the model's (and any padding id)."
        )


def check_targets(target: Tensor, num_classes: int, ignore_index: Optional[int] = -100) -> None:
    """``IndexError`` as ``F.cross_entropy`` raises it on one device (``Target 7 is out of bounds.``) for a class
    index outside ``[0, num_classes)`` other than ``ignore_index``; class probabilities are not checked."""
    if target.numel() == 0 or target.is_floating_point() or target.is_meta:  # meta (the dry run): no values
        return
    target = target.detach()
    bad = (target < 0) | (target >= num_classes)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bool(bad.any()):
        values = target[bad]
        first = int(values[0])
        raise IndexError(
            f"Target {first} is out of bounds. Labels must lie in [0, {num_classes}) (the vocabulary of the"
            f" vocab-sharded logits) or equal ignore_index={ignore_index}; {values.numel()} label(s) here lie from"
            f" {int(values.min())} to {int(values.max())}. Loss parallel would have counted their logit as 0."
        )


__all__ = ["check_targets", "check_token_ids"]
