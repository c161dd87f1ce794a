"""Grouped matrix products for the local experts: ``rows of expert e @ weight[e]`` for every e at once.

Three implementations of the same product, chosen per device and dtype:

* ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` (one kernel; on CPU for fp32/bf16/fp16
  in torch >= 2.13, on CUDA where the device supports it). No padding.
* ``"bmm"``: the rows padded per expert to the largest count, one ``torch.bmm``. Exact too; costs
  ``E * max_count`` rows of memory (more when routing is skewed).
* ``"loop"``: one matmul per expert, the reference the others are tested against.

``"auto"`` takes ``grouped_mm`` where a one-time probe on tiny tensors shows it runs for this
device and dtype and both expert widths are whole multiples of 16 bytes (its kernels' alignment),
else ``bmm``. Under autocast both operands are cast to the autocast dtype
first, as the loop's matmuls would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLEMENTATIONS = ("auto", "grouped_mm", "bmm", "loop")
_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def _same(t: Tensor) -> Tensor:
    return t


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs forward and backward for ``device``/``dtype`` (probed once, cached)."""
    key = (device.type, dtype)
    if key not in _SUPPORT:
        fn = getattr(F, "grouped_mm", None)
        ok = fn is not None and dtype in (torch.float32, torch.bfloat16, torch.float16)
        if ok:
            # The first call may come inside a checkpointed block (whose saved-tensor hooks would turn the
            # probe's backward into a recomputation of the block: torch's composable checkpoint then fails
            # with a bare AssertionError) or under no_grad (a validation pass first: the probe's backward
            # would fail and mark grouped_mm unsupported for good). Probe with plain saving, with grad.
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    a = torch.ones(4, 16, device=device, dtype=dtype, requires_grad=True)
                    b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    out = fn(a, b, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
                    out.backward(torch.ones_like(out))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _SUPPORT[key] = ok
    return _SUPPORT[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward rejects expanded ones)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _autocast(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    device_type = x.device.type
    # The dry run's meta tensors have no autocast (asking raises).
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), weight.to(dtype)
    return x, weight


def grouped_linear(x: Tensor, weight: Tensor, counts: Sequence[int], implementation: str = "auto") -> Tensor:
    """``x`` holds the rows of each expert in turn (``counts[e]`` for expert e); returns
    ``cat([x_e @ weight[e] for e])`` with ``weight`` shaped ``[E, in, out]``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"`implementation={implementation!r}` is unknown. Choose one of {IMPLEMENTATIONS}.")
    if len(counts) != weight.shape[0]:
        raise ValueError(f"{len(counts)} row counts for {weight.shape[0]} experts; give one count per local expert.")
    x, weight = _autocast(x, weight)
    if implementation == "auto":
        fits = _aligned(x, weight) and grouped_mm_supported(x.device, x.dtype)
        implementation = "grouped_mm" if fits else "bmm"
    elif implementation == "grouped_mm" and not _aligned(x, weight):
        raise ValueError(
            f"`implementation='grouped_mm'` needs the expert widths ({weight.shape[-2]} -> {weight.shape[-1]}) to be"
            " whole multiples of 16 bytes; use 'auto' (which falls back to 'bmm') or 'bmm'."
        )
    if implementation == "loop":
        return torch.cat([chunk @ weight[e] for e, chunk in enumerate(x.split(list(counts)))])
    if implementation == "grouped_mm":
        offsets = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, weight, offs=offsets))
    return _padded_bmm(x, weight, counts)


def _aligned(x: Tensor, weight: Tensor) -> bool:
    """grouped_mm's kernels need 16-byte aligned rows: both widths a multiple of 16 bytes."""
    return all(width * x.element_size() % 16 == 0 for width in (weight.shape[-2], weight.shape[-1]))


def _padded_bmm(x: Tensor, weight: Tensor, counts: Sequence[int]) -> Tensor:
    experts, most = len(counts), max(counts, default=0)
    if most == 0:
        # No rows at all, but the result must stay in the graph: under expert parallelism the backward
        # all-to-all behind `x` runs on every rank, whether or not it received tokens.
        return x @ weight[0]
    count = torch.tensor(counts, device=x.device)
    # output_size: the rows are known (no device sync; and the dry run's meta tensors have no values to sum).
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), count, output_size=x.shape[0])
    start = torch.cumsum(count, 0) - count
    slot = torch.arange(x.shape[0], device=x.device) - start[expert]  # row's place within its expert
    padded = x.new_zeros(experts, most, x.shape[-1]).index_put((expert, slot), x)
    return torch.bmm(padded, weight)[expert, slot]


__all__ = ["IMPLEMENTATIONS", "grouped_linear", "grouped_mm_supported"]
