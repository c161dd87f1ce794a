"""Measuring a pipeline: per-action clocks, busy/idle time, saved-activation bytes.

* :class:`PipelineEvent`, :class:`PipelineStepStats` and :class:`PipelineStats` are the typed
  records ``ParaStrategy.pipeline_stats()`` returns (and ``observe/timeline.py`` draws).
* :class:`StepRecorder` keeps one rank's action events for a step and the busy time they add up to.
* :class:`TimedPipelineStage` is torch's ``PipelineStage`` with a clock around every forward,
  backward, input-grad and weight-grad action.
* the saved-activation bytes come from a meter the runner is given (``instrument.SavedActivationMeter``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.pipelining import PipelineStage

from lightning_para.moe import moe_stats_paused


@dataclass(frozen=True)
class PipelineEvent:
    """One schedule action as it ran.

    ``action``: ``F`` forward, ``B`` full backward, ``I`` input-grad backward, ``W`` weight-grad
    backward, ``L`` loss of a microbatch on the last stage (inside its forward). ``start``/``end``
    in seconds: since this rank's step start in :class:`PipelineStats`, on the ranks' common clock
    after ``observe.timeline.rank_pipeline_record``. ``cpu``: thread CPU seconds (0: not measured).
    """

    rank: int
    stage: int
    action: str
    microbatch: int
    start: float
    end: float
    cpu: float = 0.0


@dataclass(frozen=True)
class PipelineStepStats:
    """One measured training step of this rank's pipeline stages.

    ``idle_time_s = step_time_s - busy_time_s``: waiting on sends/receives (and the schedule's own
    bookkeeping) up to the loss all-reduce, which ends the step on all pipeline ranks together --
    so it is the bubble the formulas describe. ``step_start_unix`` (``time.time()``) puts the
    ranks of one machine on one clock. ``peak_saved_activation_bytes`` is measured only while
    the runner's ``measure_activations`` is on (else ``None``).
    """

    step_time_s: float
    busy_time_s: float
    idle_time_s: float
    idle_fraction: float
    step_start_unix: float
    events: tuple[PipelineEvent, ...] = ()
    peak_saved_activation_bytes: Optional[int] = None


@dataclass(frozen=True)
class PipelineStats:
    """This rank's pipeline layout and its measured training steps (``ParaStrategy.pipeline_stats()``).

    ``mean_idle_fraction`` averages the recorded steps after the first (which also infers
    shapes); ``last_step`` is the last measured step (``None`` before one). The last step's
    fields are also read directly (``stats.idle_fraction``, ``stats.events``, ...).
    """

    schedule: str
    pp: int
    pp_rank: int
    virtual_stages: int
    microbatches: int
    stages: list[int]
    stage_layers: dict[int, list[str]]
    expected_idle_fraction: float
    steps: int
    mean_idle_fraction: Optional[float]
    last_step: Optional[PipelineStepStats] = None

    @property
    def step_time_s(self) -> Optional[float]:
        return self.last_step.step_time_s if self.last_step is not None else None

    @property
    def busy_time_s(self) -> Optional[float]:
        return self.last_step.busy_time_s if self.last_step is not None else None

    @property
    def idle_time_s(self) -> Optional[float]:
        return self.last_step.idle_time_s if self.last_step is not None else None

    @property
    def idle_fraction(self) -> Optional[float]:
        return self.last_step.idle_fraction if self.last_step is not None else None

    @property
    def step_start_unix(self) -> float:
        return self.last_step.step_start_unix if self.last_step is not None else 0.0

    @property
    def events(self) -> tuple[PipelineEvent, ...]:
        return self.last_step.events if self.last_step is not None else ()

    @property
    def peak_saved_activation_bytes(self) -> Optional[int]:
        return self.last_step.peak_saved_activation_bytes if self.last_step is not None else None


class StepRecorder:
    """Per-step clock of one rank: action events and busy/idle totals, with no host synchronization.

    An event is a :class:`PipelineEvent` of this ``rank`` with times in seconds since the step
    began, and ``cpu`` the thread CPU seconds the action used (``time.thread_time``; CPU only: not
    stretched while the OS runs another process). ``step_start_unix`` (``time.time()``) aligns
    the ranks of one machine on a common clock.

    On CPU the clock is ``time.perf_counter``. On an accelerator, each mark is a device event
    recorded in the current stream (``torch.Event(enable_timing=True)``): recording never waits
    for the device, so the schedule's sends, receives and kernels keep overlapping; the step's
    events are read once, in :meth:`end_step`, by waiting for the last one. With ``enabled``
    off (the default on accelerators unless the profiler asks) nothing is recorded at all.
    """

    def __init__(self, device: Optional[torch.device] = None, enabled: bool = True, rank: int = 0) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.enabled = enabled
        self.rank = rank
        self.events: list[PipelineEvent] = []
        self.step_start_unix = 0.0
        self.inferring = False
        self._marks: list[tuple[int, int, str, Any, Any, float]] = []
        self._start: Any = None

    @property
    def _uses_device_events(self) -> bool:
        return self.device.type != "cpu"

    def _mark(self) -> Any:
        if not self._uses_device_events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        if not self._uses_device_events:
            return end - start
        return start.elapsed_time(end) / 1000.0  # milliseconds

    @contextlib.contextmanager
    def inferring_shapes(self) -> Iterator[None]:
        previous, self.inferring = self.inferring, True
        try:
            yield
        finally:
            self.inferring = previous

    def start_step(self) -> None:
        self.events, self._marks = [], []
        if self.enabled:
            self.step_start_unix = time.time()
            self._start = self._mark()

    def end_step(self) -> Optional[float]:
        """The step's wall time in seconds (``None`` when not enabled); resolves the action events."""
        if not self.enabled or self._start is None:
            return None
        end = self._mark()
        if self._uses_device_events:
            end.synchronize()  # once per measured step: every earlier mark is complete too
        self.events = [
            PipelineEvent(self.rank, stage, action, mb, self._seconds(self._start, a), self._seconds(self._start, b), cpu)
            for stage, mb, action, a, b, cpu in self._marks
        ]
        wall = self._seconds(self._start, end)
        self._start = None
        return wall

    @contextlib.contextmanager
    def action(self, stage: int, microbatch: int, action: str) -> Iterator[None]:
        if not self.enabled or self._start is None:
            yield
            return
        start, cpu_start = self._mark(), time.thread_time()
        try:
            yield
        finally:
            self._marks.append((stage, microbatch, action, start, self._mark(), time.thread_time() - cpu_start))

    @property
    def busy_time(self) -> float:
        return sum(e.end - e.start for e in self.events)


class TimedPipelineStage(PipelineStage):
    """torch's ``PipelineStage`` with each forward/backward action timed by a :class:`StepRecorder`."""

    def __init__(
        self, *args: Any, recorder: StepRecorder, backward_context: Callable[[], Any] = contextlib.nullcontext,
        after_weight_gradients: Optional[Callable[[], None]] = None,
        after_action: Optional[Callable[[str, int, int], None]] = None, static_metadata: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder
        # Entered around each backward action (e.g. loss parallel's custom ops): a context held
        # over the whole schedule would be switched off by the forwards in between.
        self.backward_context = backward_context
        # Called once a microbatch's weight gradients of this stage are complete (a full backward, or the
        # weight half of a split one): ZeRO-2 reduces them then under "reduce_each_microbatch".
        self.after_weight_gradients = after_weight_gradients
        # Called after each action with (action, stage index, microbatch): "F", "B", "I" or "W".
        self.after_action = after_action
        # Every stage of the pipeline (on every rank) was given its input and output metadata up front
        # (`input_args`/`output_args`): torch's start-up vote on static vs run-time shape inference has one answer.
        self.static_metadata = static_metadata

    # With static metadata on every rank the vote is known: skip its exchange and its `.item()` of the result,
    # which a meta-device run (the dry run) cannot read.
    def _warmup_forward_vote(self, has_backward: bool, received_acc: Optional[Tensor] = None) -> Tensor:  # private override
        if self.static_metadata:
            return torch.ones(1, dtype=torch.int32)
        return super()._warmup_forward_vote(has_backward, received_acc=received_acc)

    def _warmup_backward_result(self, received_result: Optional[Tensor] = None) -> Tensor:  # private override
        if self.static_metadata:
            return torch.ones(1, dtype=torch.int32)
        return super()._warmup_backward_result(received_result=received_result)

    def _acted(self, action: str, microbatch: int) -> None:
        if self.after_action is not None:
            self.after_action(action, self.stage_index, microbatch)

    # Shape inference (first step per input shape) runs a real forward, loss and input-grad
    # backward; the recorder marks it so the loss wrapper does not count that loss.
    def _prepare_forward_infra(self, *args: Any, **kwargs: Any):  # private override: see docs/architecture.md
        # Its MoE aux losses are not this step's.
        with self.recorder.inferring_shapes(), moe_stats_paused(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any):
        with self.recorder.inferring_shapes(), self.backward_context():
            return super()._prepare_backward_infra(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        with self.recorder.action(self.stage_index, fwd_chunk_id, "F"):
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._acted("F", fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        with self.recorder.action(self.stage_index, bwd_chunk_id, "B" if full_backward else "I"), self.backward_context():
            result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
            if full_backward and self.after_weight_gradients is not None:
                self.after_weight_gradients()
        self._acted("B" if full_backward else "I", bwd_chunk_id)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self.recorder.action(self.stage_index, bwd_chunk_id, "W"), self.backward_context():
            result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.after_weight_gradients is not None:
                self.after_weight_gradients()
        self._acted("W", bwd_chunk_id)
        return result


def step_stats(wall: float, recorder: StepRecorder, meter: Any) -> PipelineStepStats:
    """One training step's record: its wall time, the recorder's busy time and events, and the saved-activation
    peak when ``meter`` measured it."""
    busy = recorder.busy_time
    idle = max(wall - busy, 0.0)
    return PipelineStepStats(
        step_time_s=wall, busy_time_s=busy, idle_time_s=idle, idle_fraction=idle / wall if wall > 0 else 0.0,
        step_start_unix=recorder.step_start_unix, events=tuple(recorder.events),
        peak_saved_activation_bytes=getattr(meter, "peak_bytes", None),
    )


__all__ = [
    "PipelineEvent",
    "PipelineStats",
    "PipelineStepStats",
    "StepRecorder",
    "TimedPipelineStage",
    "step_stats",
]
