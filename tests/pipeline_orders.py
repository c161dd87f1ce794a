"""torch's pipeline schedules run on recording stub stages, without communication: each rank's action order
(:func:`schedule_action_order`), which the tests check against the papers, the planner's compute order and the
runner's recorded events, and whether torch builds a schedule at all (:func:`torch_accepts`), which the tests
check the spec layer's schedule rules against.

A stub implementing ~15 private ``PipelineStage`` members (``RecordingStage``): torch has no public "dry run" of a
schedule. It lives with the tests; the library states the rules (``lightning_para.spec.schedules``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_para.parallel.pipeline.build import TORCH_SCHEDULES
from lightning_para.spec.schedules import schedule_info, stage_to_rank, validate_pipeline_config


class RecordingStage:
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


def build_for_rank(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int, log: list[str]) -> Any:
    """torch's schedule object of ``rank`` over recording stages that append their actions to ``log``."""
    info = schedule_info(schedule)
    mapping = stage_to_rank(schedule, pp, virtual_stages)
    num_stages = pp * virtual_stages
    stubs = [RecordingStage(s, num_stages, rank, pp, log) for s in range(num_stages) if mapping[s] == rank]
    loss = lambda output, target: output  # noqa: E731 - a loss makes torch plan the backward actions
    return TORCH_SCHEDULES[schedule](stubs if info.multi_stage else stubs[0], microbatches, loss_fn=loss, scale_grads=False)


def torch_accepts(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> bool:
    """Whether torch builds ``schedule`` for every rank of this layout."""
    try:
        for rank in range(pp):
            build_for_rank(schedule, pp, microbatches, virtual_stages, rank, [])
    except (ValueError, AssertionError, RuntimeError):
        return False
    return True


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
        built = build_for_rank(schedule, pp, microbatches, virtual_stages, rank, log)
        batch = torch.zeros(microbatches, 1)
        built.step(batch, target=batch, return_outputs=False)
        orders[rank] = log
    return orders
