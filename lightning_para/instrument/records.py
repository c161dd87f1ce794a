"""The typed records a measurement and the planner's prediction of it share: one rank's memory figures and one
kind of collective over one mesh dimension. The dry run fills one of each from its step and one from the planner
(:func:`~lightning_para.instrument.compare.predicted_rank`), so the two sides read alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GiB = 1024**3


@dataclass(frozen=True)
class MemoryFigures:
    """Bytes of one rank: states held between steps, activations held at the schedule's peak, the peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    peak: float
    # The caching allocator's reserved peak of a steady-state step, its trace replayed through
    # `plan.allocator` (dry run only: None in the planner's figures, and when the step did not run), with the
    # default settings and with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    reserved: Optional[float] = None
    reserved_expandable: Optional[float] = None


@dataclass(frozen=True)
class CommFigure:
    """Collectives of one kind over one mesh dimension in the step: calls and bytes (the local tensor's)."""

    dim: str
    op: str
    calls: int
    bytes: float



__all__ = ["CommFigure", "GiB", "MemoryFigures"]
