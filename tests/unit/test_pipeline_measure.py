"""The pipeline's step clock makes no host synchronization per action (issue 17).

On an accelerator, waiting for the device around every forward/backward action would serialize
the schedule and defeat the overlap of sends and receives with compute. The recorder marks
actions with device events and waits at most once per measured step; with timing off it records
nothing. Here torch's device event and every ``synchronize`` are replaced by counters, so the
accelerator path is checked on CPU.
"""

from __future__ import annotations

import pytest
import torch

from lightning_para.parallel.pipeline.measure import StepRecorder


class _CountingEvent:
    """Stands in for ``torch.Event``: counts records and waits, with a fake clock in ms."""

    records = 0
    waits = 0
    clock = 0.0

    def __init__(self, device=None, enable_timing=False) -> None:
        assert enable_timing, "timing events are needed to measure"
        self.time = None

    def record(self, stream=None) -> None:
        type(self).records += 1
        type(self).clock += 1.0
        self.time = type(self).clock

    def synchronize(self) -> None:
        type(self).waits += 1

    def elapsed_time(self, end: "_CountingEvent") -> float:
        return end.time - self.time


@pytest.fixture
def counted(monkeypatch):
    _CountingEvent.records = _CountingEvent.waits = 0
    _CountingEvent.clock = 0.0
    device_syncs = []
    monkeypatch.setattr(torch, "Event", _CountingEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append(1))
    return device_syncs


def _step(recorder: StepRecorder, actions: int):
    recorder.start_step()
    for mb in range(actions):
        with recorder.action(0, mb, "F"):
            pass
    return recorder.end_step()


@pytest.mark.parametrize("actions", [1, 8])
def test_measured_steps_wait_once_per_step_not_per_action(counted, actions):
    recorder = StepRecorder(torch.device("cuda"), enabled=True)
    wall = _step(recorder, actions)
    assert counted == []  # no device-wide synchronize at all
    assert _CountingEvent.waits == 1  # the step's last event, once, whatever the number of actions
    assert _CountingEvent.records == 2 * actions + 2
    assert len(recorder.events) == actions and wall == pytest.approx((2 * actions + 1) / 1000)  # ms -> s
    assert recorder.busy_time == pytest.approx(actions / 1000)  # each action spans one tick (1 ms)


def test_unmeasured_steps_record_and_wait_for_nothing(counted):
    recorder = StepRecorder(torch.device("cuda"), enabled=False)
    assert _step(recorder, 8) is None
    assert (counted, _CountingEvent.waits, _CountingEvent.records, recorder.events) == ([], 0, 0, [])


def test_cpu_clock_measures_without_events(counted):
    recorder = StepRecorder(torch.device("cpu"))
    wall = _step(recorder, 3)
    assert _CountingEvent.records == 0 and wall is not None and wall >= recorder.busy_time >= 0
    assert [e.microbatch for e in recorder.events] == [0, 1, 2]
