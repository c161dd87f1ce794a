"""The pipeline schedules' rules and math, pure Python: what torch's schedules need from a layout, and the formulas the
planner, its cost model and the dry run read.

* :data:`RULES` maps each user-facing name to what it needs (stages per rank, placement, minimum microbatches); the
  torch classes that run them are ``parallel/pipeline/build.py``'s; :func:`validate_pipeline_config` checks a layout
  against them (``tests/pipeline_orders.py`` builds torch's schedules and checks they accept exactly these layouts);
* rules (:func:`schedule_problem`), bubble (:func:`expected_bubble`), fill and drain (:func:`fill_factor`), in-flight
  microbatches (:func:`in_flight_microbatches`), each rank's compute order (:func:`compute_order`) and the stage
  placement (:func:`stage_to_rank`).

The formulas and their sources (GPipe, 1F1B, Megatron-LM's interleaving, ZB-H1 and ZB-V; Korthikanti et al. 2022
for the in-flight activations): ``docs/planner.md``, "Bubble" and "Memory per rank".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ScheduleInfo:
    """What one schedule needs from the layout."""

    name: str
    multi_stage: bool  # takes a list of stages per rank (PipelineScheduleMulti)
    placement: str  # "loop": stage s on rank s % p; "v": V shape (rank r holds r and 2p-1-r)
    min_virtual: int = 1
    max_virtual: Optional[int] = None
    split_backward: bool = False  # input-grad (I) and weight-grad (W) actions instead of B

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        if self.name == "1f1b":
            return pp  # torch's Schedule1F1B: warmup needs one microbatch per stage
        if self.name == "zbv":
            return 2 * pp - 1  # ZB-V fills the V with 2p-1 microbatches before steady state
        if self.name == "dualpipev":
            return pp * virtual_stages  # DualPipeV: microbatches >= stages
        return 1


RULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("gpipe", False, "loop", max_virtual=1),
    "1f1b": ScheduleInfo("1f1b", False, "loop", max_virtual=1),
    "interleaved": ScheduleInfo("interleaved", True, "loop", min_virtual=2),
    "zero_bubble": ScheduleInfo("zero_bubble", True, "loop", split_backward=True),
    "looped_bfs": ScheduleInfo("looped_bfs", True, "loop"),
    "zbv": ScheduleInfo("zbv", True, "v", 2, 2, split_backward=True),
    "dualpipev": ScheduleInfo("dualpipev", True, "v", 2, 2, split_backward=True),
}
# Every schedule ParaStrategy runs, in the order error messages list them.
SCHEDULES = tuple(RULES)
# The schedules whose bubble and in-flight activations the planner prices; the others are valid layouts that the
# planner rejects with a reason.
PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def schedule_info(name: str) -> ScheduleInfo:
    if name not in RULES:
        raise ValueError(f"`schedule={name!r}` is unknown. Choose one of {', '.join(map(repr, SCHEDULES))}.")
    return RULES[name]


def check_planned(name: str) -> None:
    """``ValueError`` for a schedule name the planner does not price."""
    if name in SCHEDULES and name not in PLANNED_SCHEDULES:
        raise ValueError(
            f"`schedule={name!r}` runs under ParaStrategy, but the planner has no bubble model for it."
            f" Choose one of {', '.join(map(repr, PLANNED_SCHEDULES))} to plan."
        )
    if name not in PLANNED_SCHEDULES:
        raise ValueError(f"`schedule={name!r}` is unknown. Choose one of {', '.join(map(repr, PLANNED_SCHEDULES))}.")


def default_microbatches(pp: int, virtual_stages: int) -> int:
    """Microbatches when none are given: one per stage, the least every schedule accepts."""
    return pp * virtual_stages


def stage_to_rank(schedule: str, pp: int, virtual_stages: int) -> dict[int, int]:
    """Which pipeline rank holds each of the ``pp * virtual_stages`` stages: stage ``s`` on rank ``s % pp`` ("loop"),
    or a V (rank ``r`` holds ``r`` and ``2 pp - 1 - r``), as ``torch.distributed.pipelining`` places them."""
    if schedule_info(schedule).placement == "loop":
        return {s: s % pp for s in range(pp * virtual_stages)}
    return {s: s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(pp * virtual_stages)}


def expected_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Optional[float]:
    """The idle fraction the schedule's paper predicts for equal stage times (see module docstring)."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / 3 / (m + (p - 1) / 3)
    if schedule == "zbv":
        return 0.0
    return None


def fill_factor(schedule: str, virtual_stages: int = 1) -> float:
    """``k`` of a step's fill and drain, ``k (sum_r t_r - t_max)`` on top of the ``m t_max`` the slowest rank
    needs: 1 for GPipe and 1F1B, ``1/v`` interleaved, ``1/3`` zero-bubble (ZB-H1), 0 for ZB-V (with equal
    ``t_r`` this is :func:`expected_bubble`)."""
    return {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 1.0 / virtual_stages, "looped_bfs": 1.0 / virtual_stages,
            "zero_bubble": 1.0 / 3.0}.get(schedule, 0.0)


def schedule_problem(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, planned: bool = True
) -> Optional[tuple[str, str]]:
    """Why ``schedule`` cannot run with these degrees, ``(what is wrong, the fix)``, or ``None``: the rules of
    ``torch.distributed.pipelining``'s schedules, which ParaStrategy runs, as :class:`ScheduleInfo` states them (stages
    per rank; 1F1B ``m >= p``, its warm-up needs one microbatch per stage; ZB-V ``m >= 2p - 1``; DualPipeV
    ``m >= p v``). ``planned``: also whole rounds (``m`` a multiple of ``p``) for the interleaved loop schedules,
    whose order (:func:`compute_order`) and bubble the planner prices."""
    info = schedule_info(schedule)
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return None if v == 1 else (f"virtual_stages={v} needs pp > 1", "Set virtual_stages=1.")
    if info.max_virtual == 1 and v != 1:
        return (f"schedule '{schedule}' runs one stage per rank, not virtual_stages={v}", "Set virtual_stages=1, or"
                " pick a multi-stage schedule ('interleaved', 'zero_bubble', 'looped_bfs', 'zbv', 'dualpipev').")
    if info.min_virtual == info.max_virtual and v != info.min_virtual:
        return (f"schedule '{schedule}' needs virtual_stages={info.min_virtual}, not {v}",
                f"It runs {info.min_virtual} stages per rank (a V shape): set virtual_stages={info.min_virtual}.")
    if v < info.min_virtual:
        return (f"schedule '{schedule}' needs virtual_stages >= {info.min_virtual}", f"With virtual_stages={v} it"
                f" would be plain 1F1B: set virtual_stages>={info.min_virtual} to interleave, or use schedule='1f1b'.")
    least = info.min_microbatches(p, v)
    if m < least:
        need = {"1f1b": "pp", "zbv": "2*pp-1"}.get(schedule, "pp*virtual_stages")
        return (f"schedule '{schedule}' needs microbatches >= {need} ({m} < {least})",
                f"Set microbatches>={least} (more microbatches also shrink the bubble).")
    if planned and schedule in ("interleaved", "zero_bubble") and (m < p or m % p):
        return (f"schedule '{schedule}' needs microbatches a multiple of pp ({m} vs pp={p})",
                f"Set microbatches to a multiple of {p}.")
    if schedule in ("interleaved", "zero_bubble") and m % max(1, m // p):  # torch's rounds of max(1, m // p)
        return (f"schedule '{schedule}' needs microbatches a multiple of its rounds ({m} vs {max(1, m // p)} rounds)",
                f"Set microbatches to a multiple of pp={p} (or fewer than pp).")
    return None


def validate_pipeline_config(pp: int, schedule: str, microbatches: Optional[int], virtual_stages: int) -> int:
    """The microbatches of a pipeline layout (``None``: :func:`default_microbatches`) checked against the schedule's
    rules (:func:`schedule_problem`: the rules torch's schedules apply when they are built, stated here; the tests
    build torch's schedules on recording stages and check they accept exactly these layouts); ``ValueError`` naming
    the argument and the fix, before any process exists."""
    m = default_microbatches(pp, virtual_stages) if microbatches is None else microbatches
    problem = schedule_problem(schedule, pp, m, virtual_stages, planned=False)
    if problem:
        raise ValueError(f"`schedule={schedule!r}` with pp={pp}, microbatches={m}: {problem[0]}. {problem[1]}")
    return m


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step on every pipeline rank for equal stage times, for a schedule the planner prices
    (:func:`expected_bubble`; the module docstring's table)."""
    check_planned(schedule)
    return expected_bubble(schedule, pp, microbatches, virtual_stages) or 0.0


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """Microbatches' worth of pipeline rank ``rank``'s activations held at its peak (in units of one microbatch
    through all of its layers; Korthikanti et al. 2022, Sec. 4.2.3): GPipe all ``m``; 1F1B and ZB-H1 (``v = 1``)
    ``min(p - rank, m)``; interleaved ``2 (p - rank - 1) + (v - 1) p`` warm-up chunk-forwards plus one in flight
    (Megatron-LM's ``get_num_warmup_microbatches``), each ``1/v`` of its layers; ZB-V ``p`` (Qi et al. 2024, Sec. 6)."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 1.0  # gradient accumulation runs its microbatches one after another
    if schedule == "gpipe":
        return float(m)
    if schedule == "zbv":
        return float(min(p, m))
    if v == 1:  # 1f1b, zero_bubble (ZB-H1)
        return float(min(p - rank, m))
    chunk_forwards = min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    return chunk_forwards / v


@functools.lru_cache(maxsize=1024)
def compute_order(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> Optional[tuple]:
    """This rank's forwards and (full) backwards in the order ``torch.distributed.pipelining`` runs them:
    ``(("F", chunk), ("B", chunk), ...)``, ``chunk`` the rank's local chunk (0 to ``v - 1``).

    GPipe: every forward, then every backward. 1F1B (``Schedule1F1B``): ``min(m, p - i)`` warm-up forwards, then a
    backward and a forward in turn. Interleaved (``ScheduleInterleaved1F1B``, Megatron-LM's order):
    ``min((v - 1) r + 2 (p - i - 1), m v)`` warm-up forwards, ``r`` microbatches per round (``p`` when ``p``
    divides ``m``), forwards chunk by chunk in rounds, backwards from the last chunk, then forward-backward pairs.
    ``tests/unit/test_plan_pipeline_memory.py`` checks each against torch's own schedule run on recording stages.
    ``None`` for the zero-bubble schedules (their split backward is not walked here).
    """
    p, m, v, i = pp, microbatches, virtual_stages, rank
    if schedule == "gpipe":
        return tuple([("F", 0)] * m + [("B", 0)] * m)
    if schedule == "1f1b":
        warmup = min(m, p - i)
        order = [("F", 0)] * warmup
        for k in range(m):
            order.append(("B", 0))
            if warmup + k < m:
                order.append(("F", 0))
        return tuple(order)
    if schedule != "interleaved":
        return None
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - i), total)

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    order = []
    for op in range(total + warmup):
        if op < total:
            order.append(("F", (op // per_round) % v))
        if op >= warmup:  # a forward-backward pair in the steady state, then the cool-down's backwards
            order.append(("B", backward_chunk(op)))
    return tuple(order)


__all__ = [
    "PLANNED_SCHEDULES", "RULES", "SCHEDULES", "ScheduleInfo", "bubble_fraction", "check_planned", "compute_order", "default_microbatches",
    "expected_bubble", "fill_factor", "in_flight_microbatches", "schedule_info", "schedule_problem", "stage_to_rank",
    "validate_pipeline_config",
]
