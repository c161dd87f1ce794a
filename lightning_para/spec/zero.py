"""ZeRO's shard arithmetic, written once: the rows a data-parallel rank holds of a tensor, and the bytes of model states
per rank (Rajbhandari et al. 2020, "ZeRO", Sec. 5.1; the table is ``docs/planner.md``'s, "Memory per rank").

Rows: ZeRO-1/2 (``parallel/data/layout.py``) and FSDP2 (ZeRO-3) split each tensor by rows (dim 0) into
``ceil(rows / N)``-row chunks (``torch.chunk``'s layout), so a tensor whose rows ``N`` does not divide is padded, and
the first rank holds the most (:func:`chunk_rows`, :func:`row_range`); the planner counts the same (``plan/tensors.py``).

Bytes (:func:`zero_state_bytes`): stage 1 shards the optimizer state (fp32 master included), stage 2 the gradients
too, stage 3 the weights too, over ``N`` ranks: ``dp_shard x cp`` for dense parameters, ``edp x cp`` for routed
experts. Over several microbatches ZeRO-2/3 with ``zero_accumulation="no_sync"`` hold full gradients until the last
one (``full_grads``).
"""

from __future__ import annotations

import math


def chunk_rows(rows: int, shards: int) -> int:
    """Rows of the largest of ``shards`` row chunks of a tensor with ``rows`` rows: ``ceil(rows / shards)``."""
    return math.ceil(rows / shards)


def row_range(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the rows data-parallel rank ``rank`` of ``shards`` holds (empty past the last row)."""
    chunk = chunk_rows(rows, shards)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def zero_state_bytes(
    params: float, *, zero: int, shards: int, weight_bytes: float, grad_bytes: float, optimizer_bytes: float,
    full_grads: bool = False,
) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer)`` bytes of ``params`` parameters on one rank (the module's table).

    ``optimizer_bytes`` is the ZeRO paper's K: fp32 master plus optimizer state. ``full_grads``: gradients are held
    unsharded during accumulation (ZeRO-2/3 with ``"no_sync"``).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"`zero={zero!r}` is not a ZeRO stage. Choose one of 0, 1, 2, 3.")
    n = shards
    weights = weight_bytes * params / (n if zero == 3 else 1)
    grads = grad_bytes * params / (n if zero >= 2 and not full_grads else 1)
    optimizer = optimizer_bytes * params / (n if zero >= 1 else 1)
    return weights, grads, optimizer


__all__ = ["chunk_rows", "row_range", "zero_state_bytes"]
