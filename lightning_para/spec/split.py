"""Where pipeline stages start: the split math, pure Python, so the planner prices the same split
:func:`~lightning_para.parallel.pipeline.split.apply_pipeline_parallel` applies, from this one source."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_split(costs: Sequence[float], num_stages: int) -> list[int]:
    """Start index of each stage: contiguous parts minimizing the largest part's cost.

    Dynamic programming over (stages, prefix): O(num_stages * L^2), exact.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-cost splitting the first i layers into k stages; cut[k][i]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def explicit_split(split: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Normalize ``pipeline_split`` (where stages 1.. start; a leading 0 is allowed) to all starts."""
    starts = [int(s) for s in split]
    if len(starts) == num_stages - 1:
        starts = [0, *starts]
    ok = len(starts) == num_stages and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
    if not ok or starts[-1] >= num_layers:
        raise ValueError(
            f"`pipeline_split={list(split)}` must give the first layer index of stages 1..{num_stages - 1}"
            f" ({num_stages - 1} strictly increasing indices in 1..{num_layers - 1}) for {num_stages} stages"
            f" over {num_layers} layers."
        )
    return starts


__all__ = ["balanced_split", "explicit_split"]
