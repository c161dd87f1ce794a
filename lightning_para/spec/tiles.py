"""Ring attention's score tiles, pure Python: how many query rows one tile of a chunk pair's fp32 scores holds. The
ring (``parallel/context/ring.py``) computes in these tiles and the planner (``lightning_para.plan``) prices two of them, from this one
source."""

from __future__ import annotations

# A (query chunk, key chunk) pair's fp32 scores are [b, h, c, c]: at 64K tokens over cp=2 (c = 16K, 32 heads)
# one such block would be 34 GB. Pairs are computed in tiles of query rows, each at most this many bytes of
# scores; rows are independent in the softmax, so the forward is the same as whole blocks (the backward sums
# dK/dV over the tiles). `lightning_para.plan` prices two such tiles (P and dP) in a layer's backward.
SCORE_TILE_BYTES = 2**28


def score_tile_rows(batch: int, heads: int, chunk: int) -> int:
    """Query rows per tile of one chunk pair's scores: all ``chunk`` rows when the fp32 ``[batch, heads, rows,
    chunk]`` block fits :data:`SCORE_TILE_BYTES`, else as many as fit (at least one)."""
    per_row = 4 * batch * heads * chunk
    return max(1, min(chunk, SCORE_TILE_BYTES // max(1, per_row)))


__all__ = ["SCORE_TILE_BYTES", "score_tile_rows"]
