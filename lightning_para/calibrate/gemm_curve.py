"""This machine's GEMM curve: fp32 matmuls timed by shape, for :func:`lightning_para.plan.gemm.fit_gemm_model`.

``lightning-para calibrate`` times :data:`GEMM_CURVE_SHAPES` in every rank process at once (the machine as loaded as
in a run) and keeps the medians; :class:`GemmShapes` records the shapes of a real model's matmuls, so the efficiency
measured on that model is kept as its fraction of the curve (:meth:`~lightning_para.calibrate.cache.Calibration.
cluster_figures`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["GEMM_CURVE_SHAPES", "GemmShapes", "measure_gemm_curve", "median_seconds"]


def median_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``run`` (a preempted call skews a median less than a mean)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The GEMM shapes this machine's curve is timed at (``m, n, k``; fp32 on CPU): the README demo's block at its two
# calibration microbatches (256 and 1,024 rows of width 128 and 384) and two larger ones, where the plateau shows.
GEMM_CURVE_SHAPES = ((256, 384, 128), (1024, 384, 128), (1024, 128, 384), (128, 384, 1024), (2048, 512, 512),
                     (1024, 1024, 1024))


def measure_gemm_curve(threads: Optional[int] = None, shapes: Sequence[tuple[int, int, int]] = GEMM_CURVE_SHAPES,
                       repeats: int = 7) -> list[list[float]]:
    """``[[m, n, k, seconds], ...]``: the median seconds of ``repeats`` fp32 ``m x k`` by ``k x n`` matmuls per shape
    (each sample ~0.05 GFLOP or more) under ``threads`` intra-op threads; :func:`lightning_para.plan.gemm.fit_gemm_model`
    fits the planner's GEMM curve to them."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = []
        for m, n, k in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            torch.mm(a, b)  # warm-up
            calls = max(1, int(5e7 // (2 * m * n * k)))
            seconds = median_seconds(lambda: [torch.mm(a, b) for _ in range(calls)], repeats) / calls
            out.append([float(m), float(n), float(k), seconds])
    finally:
        torch.set_num_threads(before)
    return out


class GemmShapes:
    """The ``(m, n, k, count)`` of every matmul (``mm``, ``addmm``, ``bmm``) dispatched inside it."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        shapes = self.shapes = []  # type: list[tuple[int, int, int, int]]
        mm, addmm, bmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func in (mm, addmm):
                    a, b = args[-2], args[-1]
                    shapes.append((a.shape[0], b.shape[1], a.shape[1], 1))
                elif func is bmm:
                    a, b = args
                    shapes.append((a.shape[1], b.shape[2], a.shape[2], a.shape[0]))
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()
