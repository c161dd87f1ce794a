"""A pipeline timeline image: which rank runs which microbatch's F/B/W, over time.

Drawn with PIL (no matplotlib) from *measured* events, one row per pipeline rank: forward
(F), backward (B, or input-grad only ``I`` for zero-bubble schedules) and weight-grad (W)
boxes labelled with the microbatch index; the grey gaps are the bubble.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import numpy as np

from lightning_para.parallel.pipeline.measure import PipelineEvent, PipelineStats, PipelineStepStats

COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (52, 168, 83), "W": (251, 140, 0)}
OTHER_COLOR = (160, 80, 200)
IDLE = (236, 236, 236)


def as_events(records: Iterable[Any]) -> list[PipelineEvent]:
    """Accept :class:`PipelineEvent`, dicts with the same keys, or 6-tuples in field order."""
    events = []
    for r in records:
        if isinstance(r, PipelineEvent):
            events.append(r)
        elif isinstance(r, dict):
            events.append(PipelineEvent(**{k: r[k] for k in PipelineEvent.__dataclass_fields__ if k in r}))
        else:
            events.append(PipelineEvent(*r))
    return events


@dataclass(frozen=True)
class RankPipelineRecord:
    """What one rank sends rank 0: its stage, its last step's idle fraction, the schedule's expected
    one, and its events on the ranks' common clock."""

    stage: int
    idle: Optional[float]
    expected: Optional[float]
    events: tuple[PipelineEvent, ...]


def rank_pipeline_record(stats: Union[PipelineStats, PipelineStepStats], rank: int, stage: int, *,
                         expected: Optional[float] = None) -> RankPipelineRecord:
    """This rank's record for rank 0 from ``ParaStrategy.pipeline_stats()`` (or one measured step of it).

    Events come in seconds since this rank's step start plus ``step_start_unix``, which puts the
    ranks of one machine on one clock (across machines NTP accuracy bounds the alignment). The
    loss action ("L") runs inside the last forward and is left out.
    """
    if isinstance(stats, PipelineStats):
        expected = stats.expected_idle_fraction
    origin = float(stats.step_start_unix)
    events = tuple(
        replace(e, rank=rank, start=origin + e.start, end=origin + e.end) for e in stats.events if e.action != "L"
    )
    return RankPipelineRecord(stage=stage, idle=stats.idle_fraction, expected=expected, events=events)


def pipeline_metrics(per_rank: Sequence[RankPipelineRecord]) -> tuple[dict[str, float], list[PipelineEvent]]:
    """Idle fraction per stage (mean over its ranks), the expected bubble, and all events."""
    by_stage: dict[int, list[float]] = {}
    for r in per_rank:
        if r.idle is not None:
            by_stage.setdefault(r.stage, []).append(float(r.idle))
    metrics = {f"pipeline/idle_fraction/stage{s}": sum(v) / len(v) for s, v in sorted(by_stage.items())}
    if per_rank and per_rank[0].expected is not None:
        metrics["pipeline/expected_idle_fraction"] = float(per_rank[0].expected)
    return metrics, [e for r in per_rank for e in r.events]


def idle_fraction(events: Sequence[PipelineEvent]) -> dict[int, float]:
    """Per rank: 1 - busy / (span of the whole step over all ranks)."""
    if not events:
        return {}
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    span = max(t1 - t0, 1e-12)
    busy: dict[int, float] = {}
    for e in events:
        busy[e.rank] = busy.get(e.rank, 0.0) + (e.end - e.start)
    return {rank: max(0.0, 1.0 - b / span) for rank, b in sorted(busy.items())}


def with_median_cpu(steps: Sequence[Sequence[PipelineEvent]]) -> list[list[PipelineEvent]]:
    """``steps`` (one rank's events of several steps) with each action's CPU time replaced by its
    median over the steps, so one step's outlier (a cache-cold first pass, a sibling hyperthread
    busy) does not move the replayed idle fraction; the order and wall times stay as measured."""
    times: dict[tuple[int, int, str, int], list[float]] = {}
    for events in steps:
        for e in events:
            times.setdefault((e.rank, e.stage, e.action, e.microbatch), []).append(e.cpu)
    median = {key: statistics.median(values) for key, values in times.items()}
    return [[replace(e, cpu=median[(e.rank, e.stage, e.action, e.microbatch)]) for e in events] for events in steps]


def replayed_idle_fraction(events: Sequence[PipelineEvent]) -> dict[int, float]:
    """Per rank: the idle fraction of the measured schedule re-timed with each action's CPU time.

    Each rank runs its actions in the measured order; an action starts when the rank's previous
    action has ended and its inputs exist: a forward of stage ``s`` waits for that microbatch's
    forward on stage ``s - 1``, a backward (``B``, or the input-grad ``I``) of stage ``s`` for
    that microbatch's backward on stage ``s + 1``. Each lasts its measured thread CPU time. This
    is the step a machine with a core per process would run: on an oversubscribed host the
    wall-clock idle fraction (:func:`idle_fraction`) also counts the time the OS gave the core to
    another process. Sends and receives take no time here (their bytes are counted elsewhere).
    """
    if not events:
        return {}
    by_rank: dict[int, list[PipelineEvent]] = {}
    for e in sorted(events, key=lambda e: e.start):
        by_rank.setdefault(e.rank, []).append(e)
    last_stage = max(e.stage for e in events)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    position = {rank: 0 for rank in by_rank}
    clock = {rank: 0.0 for rank in by_rank}
    busy = {rank: 0.0 for rank in by_rank}
    remaining = len(events)
    while remaining:
        progressed = False
        for rank, queue in by_rank.items():
            while position[rank] < len(queue):
                e = queue[position[rank]]
                backward = e.action in ("B", "I")
                if e.action == "F":
                    needed = ("F", e.stage - 1, e.microbatch) if e.stage > 0 else None
                elif backward and e.stage < last_stage:
                    needed = ("B", e.stage + 1, e.microbatch)
                else:
                    needed = None  # the last stage's backward follows its own forward; W its own I
                if needed is not None and needed not in done:
                    break
                start = max(clock[rank], done.get(needed, 0.0) if needed else 0.0)
                clock[rank] = start + e.cpu
                busy[rank] += e.cpu
                if e.action == "F" or backward:
                    done[("F" if e.action == "F" else "B", e.stage, e.microbatch)] = clock[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded pipeline events are not a schedule (a dependency never ran)")
    span = max(clock.values())
    return {rank: (1.0 - busy[rank] / span) if span > 0 else 0.0 for rank in sorted(by_rank)}


def draw_timeline(
    events: Sequence[PipelineEvent],
    *,
    width: int = 1200,
    row_height: int = 30,
    title: Optional[str] = None,
) -> np.ndarray:
    """An RGB image (H, W, 3, uint8) of the events; rows are ranks, x is time."""
    from PIL import Image, ImageDraw, ImageFont

    events = list(events)
    ranks = sorted({e.rank for e in events})
    left, right, top = 90, 20, 40
    bottom = 50
    height = top + row_height * max(len(ranks), 1) + bottom
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((left, 8), title or "pipeline timeline (measured)", fill="black", font=font)
    if not events:
        draw.text((left, top), "no pipeline events recorded", fill="black", font=font)
        return np.asarray(image)
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    span = max(t1 - t0, 1e-9)
    scale = (width - left - right) / span
    row_of = {rank: i for i, rank in enumerate(ranks)}
    stage_of = {}
    for e in events:
        stage_of.setdefault(e.rank, set()).add(e.stage)
    for rank, i in row_of.items():
        y = top + i * row_height
        draw.rectangle([left, y + 2, width - right, y + row_height - 2], fill=IDLE)
        stages = ",".join(str(s) for s in sorted(stage_of[rank]))
        draw.text((6, y + row_height // 2 - 6), f"rank {rank} s{stages}", fill="black", font=font)
    for e in events:
        y = top + row_of[e.rank] * row_height
        x0 = left + (e.start - t0) * scale
        x1 = max(x0 + 1, left + (e.end - t0) * scale)
        color = COLORS.get(e.action, OTHER_COLOR)
        draw.rectangle([x0, y + 3, x1, y + row_height - 3], fill=color, outline="white")
        label = f"{e.action}{e.microbatch}"
        if x1 - x0 > 6 * len(label) + 2:
            draw.text((x0 + 2, y + row_height // 2 - 6), label, fill="white", font=font)
    # time axis
    axis_y = top + row_height * len(ranks) + 6
    draw.line([left, axis_y, width - right, axis_y], fill="black")
    for k in range(6):
        x = left + k * (width - left - right) / 5
        draw.line([x, axis_y, x, axis_y + 4], fill="black")
        label = f"{k * span / 5 * 1e3:.1f} ms"
        draw.text((min(x - 10, width - 6 * len(label) - 2), axis_y + 6), label, fill="black", font=font)
    # legend
    lx = left
    for name, color in (("F forward", COLORS["F"]), ("B backward", COLORS["B"]), ("W weight grad", COLORS["W"]), ("idle", IDLE)):
        draw.rectangle([lx, height - 16, lx + 10, height - 6], fill=color, outline="black")
        draw.text((lx + 14, height - 18), name, fill="black", font=font)
        lx += 110
    return np.asarray(image)
