"""Operator counters: the bytes the non-matmul operators read and write and the kernels every operator
launches (:class:`TrafficCounter`), and the operators that go through DTensor's dispatch
(:class:`DTensorOpCounter`). Calibration times them (:mod:`lightning_para.calibrate`), the tests recount
``plan/overhead.py``'s tables with them and ``benchmarks/kernel_counts.py`` counts kernels per step."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # private: see docs/architecture.md
from torch.utils._pytree import tree_flatten


# Operators whose cost is priced elsewhere (matmuls and CPU's and CUDA's fused attention, by their FLOPs), and
# those that move no data (views are caught by their schema; these create or alias without reading).
_PRICED_BY_FLOPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                              "_scaled_dot_product_flash_attention_for_cpu_backward",
                              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                              "_scaled_dot_product_efficient_attention",
                              "_scaled_dot_product_efficient_attention_backward",
                              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"})
_NO_TRAFFIC = frozenset({"detach", "alias", "_unsafe_view", "_reshape_alias", "empty", "empty_like", "empty_strided",
                         "new_empty", "new_empty_strided", "lift_fresh"})
# Profiler markers (``record_function``): dispatched like operators, but they launch nothing.
_NO_KERNEL = _NO_TRAFFIC | {"_record_function_enter", "_record_function_enter_new", "_record_function_exit"}


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written by the non-matmul aten operators (inputs plus outputs of each; views,
    allocations and the operators priced by FLOPs excluded), and how many there were. Used by
    :func:`~lightning_para.calibrate.measure.measure_elementwise_bandwidth` and by the tests that recount ``plan/overhead.py``'s traffic
    coefficients.

    ``kernels`` counts by name every operator that launches a kernel on a GPU (matmuls and collectives
    included; views, detaches, aliases, bare allocations and profiler markers not): ``benchmarks/kernel_counts.py``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.is_view or name in _NO_TRAFFIC:
            return out
        if name not in _NO_KERNEL:
            self.kernels[name] += 1
        if name in _PRICED_BY_FLOPS:
            return out
        self.ops += 1
        for value in tree_flatten((args, kwargs, out))[0]:
            if isinstance(value, torch.Tensor):
                self.bytes += value.numel() * value.element_size()
        return out



class DTensorOpCounter(TorchDispatchMode):
    """Counts top-level aten operators, split into those with a DTensor argument (they go through DTensor's
    dispatch) and plain ones. Also used by the tests that recount ``plan/overhead.py``'s TP tables."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor = 0
        self.plain = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(isinstance(v, DTensor) for v in tree_flatten((args, kwargs))[0]):
            self.dtensor += 1
        else:
            self.plain += 1
        return func(*args, **(kwargs or {}))

    def pair(self) -> tuple[int, int]:
        """``(DTensor operators, plain operators)``."""
        return self.dtensor, self.plain


__all__ = ["DTensorOpCounter", "TrafficCounter"]
