"""Pipeline schedules: the registry of torch's schedules, their rules, formulas and measurement.

A leaf module: it imports nothing of lightning_para, so :mod:`lightning_para.config` can
validate a pipeline layout with it. Everything here is independent of Lightning:

* :data:`SCHEDULES` maps each user-facing name to a ``torch.distributed.pipelining`` class and
  to what it needs (stages per rank, stage placement, minimum microbatches).
* :func:`validate_pipeline_config` checks ``pp``/``microbatches``/``virtual_stages`` against
  those rules *and* by building torch's own schedule for every rank on stub stages (pure
  computation, no process group), so a configuration torch would reject fails at
  ``ParaStrategy(...)`` with a ``ValueError``, long before any send/recv.
* :func:`schedule_action_order` returns each rank's compute actions (``"0F3"``: stage 0,
  forward, microbatch 3) the same way, for unit tests and timeline drawings.
* The schedules own their math, which the planner, its cost model and the dry run read from here:
  rules (:func:`schedule_problem`), bubble (:func:`expected_bubble`), fill and drain
  (:func:`fill_factor`), in-flight microbatches (:func:`in_flight_microbatches`) and each rank's
  compute order (:func:`compute_order`).

The schedule objects a run steps (:func:`~lightning_para.parallel.pipeline.build.build_schedule`, the
forward-only one) are :mod:`.build`'s.

Bubble formulas (idle time / step time on every rank, equal stage times; p ranks, m
microbatches, v stages per rank):

=============  =======================  ==================================================
schedule       bubble                   source
=============  =======================  ==================================================
gpipe, 1f1b    (p-1) / (m+p-1)          GPipe (Huang et al. 2019); PipeDream-Flush / 1F1B
interleaved    (p-1) / (v*m+p-1)        Megatron-LM, Narayanan et al. 2021, Sec. 2.2.2
looped_bfs     (p-1) / (v*m+p-1)        Lamy-Poirier 2023 (same count as interleaved)
zero_bubble    (p-1)/3 / (m+(p-1)/3)    ZB-H1, Qi et al. 2024 (t_F = t_B_input = t_W)
zbv            ~0 (m >= 2p-1)           ZB-V, Qi et al. 2024, Sec. 6 (t_F = t_B_input = t_W)
dualpipev      not modelled here        DeepSeek-V3 report 2024 (overlaps F and B)
=============  =======================  ==================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping  # private: see docs/architecture.md


@dataclass(frozen=True)
class ScheduleInfo:
    """What one schedule needs from the layout."""

    name: str
    torch_class: type
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


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("gpipe", ScheduleGPipe, False, "loop", max_virtual=1),
    "1f1b": ScheduleInfo("1f1b", Schedule1F1B, False, "loop", max_virtual=1),
    "interleaved": ScheduleInfo("interleaved", ScheduleInterleaved1F1B, True, "loop", min_virtual=2),
    "zero_bubble": ScheduleInfo("zero_bubble", ScheduleInterleavedZeroBubble, True, "loop", split_backward=True),
    "looped_bfs": ScheduleInfo("looped_bfs", ScheduleLoopedBFS, True, "loop"),
    "zbv": ScheduleInfo("zbv", ScheduleZBVZeroBubble, True, "v", 2, 2, split_backward=True),
    "dualpipev": ScheduleInfo("dualpipev", ScheduleDualPipeV, True, "v", 2, 2, split_backward=True),
}
# The user-facing names, in the order error messages list them.
PIPELINE_SCHEDULES = tuple(SCHEDULES)


def schedule_info(name: str) -> ScheduleInfo:
    if name not in SCHEDULES:
        raise ValueError(f"`schedule={name!r}` is unknown. Choose one of {', '.join(map(repr, SCHEDULES))}.")
    return SCHEDULES[name]


def default_microbatches(pp: int, virtual_stages: int) -> int:
    """Microbatches when none are given: one per stage, the least every schedule accepts."""
    return pp * virtual_stages


def stage_to_rank(schedule: str, pp: int, virtual_stages: int) -> dict[int, int]:
    """Which pipeline rank holds each of the ``pp * virtual_stages`` stages."""
    return generate_stage_to_rank_mapping(pp, pp * virtual_stages, style=schedule_info(schedule).placement)


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


def schedule_problem(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> Optional[str]:
    """Why ``schedule`` cannot run with these degrees (``None`` if it can): the rules of
    ``torch.distributed.pipelining``'s schedules, which ParaStrategy runs, as :class:`ScheduleInfo` states them
    (stages per rank; 1F1B ``m >= p``, its warm-up needs one microbatch per stage; ZB-V ``m >= 2p - 1``), and
    whole rounds (``m`` a multiple of ``p``) for the interleaved loop schedules, whose order
    (:func:`compute_order`) and bubble the planner prices."""
    info = schedule_info(schedule)
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return None if v == 1 else f"virtual_stages={v} needs pp > 1"
    if info.max_virtual == 1 and v != 1:
        return f"schedule '{schedule}' runs one stage per rank, not virtual_stages={v}"
    if info.min_virtual == info.max_virtual and v != info.min_virtual:
        return f"schedule '{schedule}' needs virtual_stages={info.min_virtual}, not {v}"
    if v < info.min_virtual:
        return f"schedule '{schedule}' needs virtual_stages >= {info.min_virtual}"
    minimum = info.min_microbatches(p, v)
    if m < minimum and schedule in ("1f1b", "zbv"):
        need = "pp" if schedule == "1f1b" else "2*pp-1"
        return f"schedule '{schedule}' needs microbatches >= {need} ({m} < {minimum})"
    if schedule in ("interleaved", "zero_bubble") and (m < p or m % p):
        return f"schedule '{schedule}' needs microbatches a multiple of pp ({m} vs pp={p})"
    return None


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


# ----------------------------------------------------------------------------- validation without communication
class _RecordingStage:
    """Just enough of a ``PipelineStage`` for torch's schedule code to run without communication.

    Every send/receive is empty and every compute action only appends ``"<stage><F|B|I|W><mb>"``
    to ``log``, so running a real schedule's ``step()`` on these stubs yields the exact order
    in which that rank executes its actions.
    """

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int, log: list[str]) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_rank = group_rank
        self.group_size = group_size
        self.log = log
        self.submod = nn.Identity()
        self.device = torch.device("cpu")
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = False
        self.output_chunks: list[Any] = []
        self.args_recv_info: dict[int, tuple] = {0: ()}
        self.act_send_info: dict[int, list] = {}
        self.stage_index_to_group_rank: dict[int, int] = {}

    def _record(self, kind: str, mb: int) -> None:
        self.log.append(f"{self.stage_index}{kind}{mb}")

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> Tensor:
        self._record("F", mb)
        return torch.zeros(())

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward=False) -> None:
        if self.has_backward:
            self._record("B" if full_backward else "I", mb)

    def backward_weight_one_chunk(self, mb: int, last_backward=False) -> None:
        if self.has_backward:
            self._record("W", mb)

    def _no_ops(self, *args: Any, **kwargs: Any) -> list:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops
    _get_init_p2p_neighbors_ops = _no_ops

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    clear_runtime_states = _prepare_forward_infra = _prepare_backward_infra = _nothing
    perform_reduce_grad = scale_grads = set_local_fwd_input = set_local_bwd_input = _nothing

    def get_local_bwd_output(self, mb: int) -> tuple:
        return ()


def _build_for_rank(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int, log: list[str]):
    info = schedule_info(schedule)
    mapping = stage_to_rank(schedule, pp, virtual_stages)
    num_stages = pp * virtual_stages
    stubs = [_RecordingStage(s, num_stages, rank, pp, log) for s in range(num_stages) if mapping[s] == rank]
    loss = lambda output, target: output  # noqa: E731 - a loss makes torch plan the backward actions
    if info.multi_stage:
        return info.torch_class(stubs, microbatches, loss_fn=loss, scale_grads=False)
    return info.torch_class(stubs[0], microbatches, loss_fn=loss, scale_grads=False)


def validate_pipeline_config(pp: int, schedule: str, microbatches: Optional[int], virtual_stages: int) -> int:
    """Check a pipeline layout before any process exists; returns the number of microbatches.

    Raises ``ValueError`` naming the argument and the fix.
    """
    info = schedule_info(schedule)
    v = virtual_stages
    if info.max_virtual == 1 and v != 1:
        raise ValueError(
            f"`schedule={schedule!r}` runs one stage per rank, but `virtual_stages={v}`. Set virtual_stages=1, or"
            " pick a multi-stage schedule ('interleaved', 'zero_bubble', 'looped_bfs', 'zbv', 'dualpipev')."
        )
    if info.max_virtual is not None and info.min_virtual == info.max_virtual and v != info.min_virtual:
        raise ValueError(
            f"`schedule={schedule!r}` needs exactly {info.min_virtual} stages per rank (a V shape), but"
            f" `virtual_stages={v}`. Set virtual_stages={info.min_virtual}."
        )
    if v < info.min_virtual:
        raise ValueError(
            f"`schedule={schedule!r}` with `virtual_stages={v}` would be plain 1F1B. Set virtual_stages>="
            f"{info.min_virtual} to interleave, or use schedule='1f1b'."
        )
    m = default_microbatches(pp, v) if microbatches is None else microbatches
    least = info.min_microbatches(pp, v)
    if m < least:
        raise ValueError(
            f"`microbatches={m}` is too few for `schedule={schedule!r}` with pp={pp} and virtual_stages={v}:"
            f" it needs at least {least}. Set microbatches>={least} (more microbatches also shrink the bubble)."
        )
    for rank in range(pp):
        try:
            _build_for_rank(schedule, pp, m, v, rank, [])
        except (ValueError, AssertionError, RuntimeError) as err:
            raise ValueError(
                f"torch.distributed.pipelining rejects `schedule={schedule!r}` with pp={pp},"
                f" microbatches={m}, virtual_stages={v}: {err} Change `microbatches` (a multiple of pp always works)."
            ) from None
    return m


def schedule_action_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> dict[int, list[str]]:
    """Each rank's compute actions in the order torch's schedule executes them, e.g. ``"1F0"``.

    ``<stage><action><microbatch>`` with ``F`` forward, ``B`` full backward, ``I`` input-grad
    backward and ``W`` weight-grad backward (split-backward schedules). Runs the schedule's
    real ``step()`` on recording stub stages: no process group, no communication.
    """
    validate_pipeline_config(pp, schedule, microbatches, virtual_stages)
    orders: dict[int, list[str]] = {}
    for rank in range(pp):
        log: list[str] = []
        built = _build_for_rank(schedule, pp, microbatches, virtual_stages, rank, log)
        batch = torch.zeros(microbatches, 1)
        built.step(batch, target=batch, return_outputs=False)
        orders[rank] = log
    return orders


__all__ = [
    "PIPELINE_SCHEDULES",
    "SCHEDULES",
    "ScheduleInfo",
    "default_microbatches",
    "compute_order",
    "expected_bubble",
    "fill_factor",
    "in_flight_microbatches",
    "schedule_problem",
    "schedule_action_order",
    "schedule_info",
    "stage_to_rank",
    "validate_pipeline_config",
]
