"""What the pipeline runner needs of its collaborators, and what a caller may give it up front.

:class:`GradientSync` is data parallelism as the runner sees it (``lightning_para.parallel.data.DataParallel``
implements it); :class:`StaticStageShapes` replaces torch's run-time shape inference where a run has no tensor
values (the dry run).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor


class GradientSync(Protocol):
    """What the runner needs of data parallelism (``lightning_para.parallel.data.DataParallel``):
    skip sync over the schedule, then sync once."""

    sync_enabled: bool
    reduces_each_microbatch: bool

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def sync_now(self) -> None: ...

    def each_microbatch(self) -> contextlib.AbstractContextManager[None]: ...

    def reduce_part(self, part: int) -> None: ...

    def commit_microbatches(self) -> None: ...


@dataclass(frozen=True)
class StaticStageShapes:
    """The pipeline's stage metadata given up front, instead of torch's run-time shape inference.

    torch's ``PipelineStage`` otherwise votes across the pipeline on how to infer the stages' input and output
    shapes, reads the vote's result (``.item()``), and sends each stage's output metadata to the next rank: steps a
    run without tensor values (the dry run, on meta tensors under the fake process group) cannot take.

    ``activation()`` makes one microbatch's activation passed between stages (its shape, dtype and
    ``requires_grad`` are what counts: a meta tensor is enough); ``model_has_moe``: whether any stage of the whole
    model has MoE layers (otherwise read once from the first step's loss all-reduce). Every pipeline rank must be
    given the same (each skips the vote).
    """

    activation: Callable[[], Tensor]
    model_has_moe: bool


__all__ = ["GradientSync", "StaticStageShapes"]
