"""torch's pipeline schedules, run without communication: validation and action orders.

The schedules' rules and math (stages per rank, bubble, in-flight microbatches, compute order) are
:mod:`lightning_para.spec.schedules`'; this module holds the ``torch.distributed.pipelining`` class each name runs
(:data:`TORCH_SCHEDULES`, which :mod:`.build` steps) and runs torch's own schedule code on stub stages (pure
computation, no process group):

* :func:`validate_pipeline_config` checks ``pp``/``microbatches``/``virtual_stages`` against the rules *and* by
  building torch's schedule for every rank, so a configuration torch would reject fails at ``ParaStrategy(...)``
  with a ``ValueError``, long before any send/recv;
* :func:`schedule_action_order` returns each rank's compute actions (``"0F3"``: stage 0, forward, microbatch 3) the
  same way, for unit tests and timeline drawings.
"""

from __future__ import annotations

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

from lightning_para.spec.schedules import default_microbatches, schedule_info, schedule_problem, stage_to_rank

TORCH_SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble, "looped_bfs": ScheduleLoopedBFS, "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


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
        return TORCH_SCHEDULES[schedule](stubs, microbatches, loss_fn=loss, scale_grads=False)
    return TORCH_SCHEDULES[schedule](stubs[0], microbatches, loss_fn=loss, scale_grads=False)


def validate_pipeline_config(pp: int, schedule: str, microbatches: Optional[int], virtual_stages: int) -> int:
    """Check a pipeline layout before any process exists; returns the number of microbatches.

    Raises ``ValueError`` naming the argument and the fix.
    """
    m = default_microbatches(pp, virtual_stages) if microbatches is None else microbatches
    problem = schedule_problem(schedule, pp, m, virtual_stages, planned=False)
    if problem:
        raise ValueError(f"`schedule={schedule!r}` with pp={pp}, microbatches={m}: {problem[0]}. {problem[1]}")
    v = virtual_stages
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


__all__ = ["TORCH_SCHEDULES", "schedule_action_order", "validate_pipeline_config"]
