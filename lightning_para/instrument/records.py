"""The record a measurement of collectives and the planner's prediction of them share: one kind of collective over
one mesh dimension. The dry run fills a list of them from its step and one from the planner
(:func:`~lightning_para.instrument.compare.predicted_rank`), so the two sides read alike. Memory's two records are
:mod:`lightning_para.spec.memory`'s."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class CommFigure:
    """Collectives of one kind over one mesh dimension in the step: calls and bytes (the local tensor's)."""

    dim: str
    op: str
    calls: int
    bytes: float

__all__ = ["CommFigure", "GiB"]
