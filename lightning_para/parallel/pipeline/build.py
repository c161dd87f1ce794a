"""The schedule object a pipeline rank steps: torch's schedule for its stages, or the forward-only one of
validate/test/predict for any stage placement (:class:`ScheduleForwardOnly`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (  # private: see docs/architecture.md
    PipelineScheduleMulti,
    _batch_p2p,
    _wait_batch_p2p,
)

from lightning_para.spec.schedules import schedule_info, stage_to_rank

# The torch class each schedule name runs (its rules are lightning_para.spec.schedules').
TORCH_SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble, "looped_bfs": ScheduleLoopedBFS, "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


class ScheduleForwardOnly(PipelineScheduleMulti):
    """Forward of every local stage over all microbatches, for any stage placement.

    torch's ``_ScheduleForwardOnly`` takes one stage per rank and the training schedules'
    ``eval()`` breaks on V placements (their local stage hand-off expects a backward). This
    runs each rank's stages in increasing index order (a topological order of the pipeline),
    microbatch by microbatch: receive, forward, hand to the next stage (locally or by send).
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, stage_index_to_rank: dict[int, int]) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=None, scale_grads=False)
        self.stage_index_to_group_rank = dict(stage_index_to_rank)
        for stage in stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0])
        local = {stage.stage_index: stage for stage in self._stages}
        sends: list[list[Any]] = []
        for index in sorted(local):
            stage = local[index]
            for mb in range(self._n_microbatches):
                if not stage.is_first and index - 1 not in local:
                    _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(mb)))
                output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs)
                if index + 1 in local:
                    local[index + 1].set_local_fwd_input(output, mb)
                elif not stage.is_last:
                    sends.append(_batch_p2p(stage.get_fwd_send_ops(mb)))
        for work in sends:
            _wait_batch_p2p(work)


def build_schedule(
    schedule: str, stages: list[PipelineStage], microbatches: int, loss_fn: Optional[Callable[..., Tensor]]
) -> Any:
    """torch's schedule object for this rank's stages; ``loss_fn=None`` gives the forward-only one.

    Gradients are never rescaled by torch (``scale_grads=False``): torch divides every
    ``.grad`` of the stage by m after the last microbatch, which would also divide gradients
    accumulated over earlier steps. ``loss_fn`` divides by m instead.
    """
    info = schedule_info(schedule)
    if loss_fn is None:
        pp = stages[0].group_size
        return ScheduleForwardOnly(stages, microbatches, stage_to_rank(schedule, pp, len(stages)))
    torch_class = TORCH_SCHEDULES[schedule]
    return torch_class(stages if info.multi_stage else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


__all__ = ["ScheduleForwardOnly", "TORCH_SCHEDULES", "build_schedule"]
