"""The Fabric strategy's step API helpers: argument checks and the errors a loop meets when it calls the model
outside the step the layout needs (``pipeline_step`` under pp, ``run_step`` under cp)."""

from __future__ import annotations

from typing import Any

from torch import nn


def check_accumulate(method: str, accumulate: Any) -> None:
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"{method}(accumulate={accumulate!r}): pass the number of micro-steps per optimizer step, an int >= 1.")


def check_run_step(step: Any, *, pipeline: bool) -> None:
    if pipeline:
        raise ValueError(
            "Under pipeline parallelism (pp > 1) the schedule runs the model: use"
            " `fabric.strategy.pipeline_step(model, batch)` instead of `run_step`."
        )
    if not callable(step):
        raise TypeError(f"run_step(module, step, batch): `step` must be a callable step(module, batch), got {step!r}.")


def schedule_only(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("under pp the core runs the pipeline schedule, never the step callable")


def pipeline_forward_error(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        "Under pipeline parallelism (pp > 1) no rank holds the whole model, so it cannot be called directly."
        " Run the schedule instead: `loss = fabric.strategy.pipeline_step(model, batch)`, then"
        " `fabric.backward(loss)` (docs/fabric.md)."
    )


def outside_run_step_error(cp: int) -> str:
    return (
        f"ParaStrategy(cp={cp}) splits each sequence over the cp ranks, but the model was called outside"
        " `fabric.strategy.run_step`, so every cp rank would process the whole sequence. Run the forward and the"
        " loss through it: `loss = fabric.strategy.run_step(model, step, (input_ids, targets))` with"
        " `def step(model, batch): ...` returning the loss (docs/fabric.md)."
    )


__all__ = ["check_accumulate", "check_run_step", "outside_run_step_error", "pipeline_forward_error", "schedule_only"]
