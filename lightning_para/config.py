"""All options of :class:`~lightning_para.ParaStrategy` in one validated dataclass.

Every check here runs before any process group or collective exists, so a bad configuration
fails the same way on every rank and can never leave a rank waiting in a collective.
Errors are ``ValueError`` naming the argument and what to choose instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_para.mesh import ParallelDims, check_expert_degree
from lightning_para.parallel.pipeline.schedules import PIPELINE_SCHEDULES, validate_pipeline_config

ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
ACTIVATION_CHECKPOINTING = (None, "full", "selective")
ZERO_ACCUMULATION = ("no_sync", "reduce_each_step")

Degree = Union[int, Literal["auto"]]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be a positive integer (1 disables this dimension).")


def _choices(values: Sequence[Any]) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass
class ParallelConfig:
    """The parallel layout and the options of each dimension.

    Degrees multiply to the world size: ``pp * dp * tp == world_size``. Expert parallelism
    lives *inside* data parallelism (``ep`` divides ``dp``): the ``dp`` ranks of one
    pipeline stage and tensor-parallel slot are split into ``dp // ep`` expert-data-parallel
    groups of ``ep`` ranks each, so ``ep`` adds no ranks of its own.
    """

    dp: Degree = "auto"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    # --- data parallel ---
    bucket_size_mb: float = 25.0
    # "no_sync": accumulation micro-steps skip all gradient communication (the A-th reduces once).
    # "reduce_each_step": ZeRO-2/3 reduce-scatter every micro-step so gradients stay sharded
    # (communication grows with A, memory does not).
    zero_accumulation: str = "no_sync"
    # --- tensor parallel ---
    sequence_parallel: bool = False
    # Under SP, keep only the sequence shard of each sublayer's input for backward and
    # all-gather it again there (Megatron-SP): less activation memory, one more all-gather
    # per sublayer. False keeps the gathered input: the same bytes as TP, more memory.
    sp_save_input_shard: bool = True
    tp_plan: Optional[Mapping[str, Any]] = None
    loss_parallel: bool = True
    activation_checkpointing: Optional[str] = None
    # --- pipeline parallel ---
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    pipeline_split: Optional[Sequence[int]] = None
    pipeline_balance: str = "params"
    # --- layout="auto" (issue 15): the planner picks what the user left at its default at setup ---
    layout: Optional[str] = None
    layout_memory_gb: Optional[float] = None  # memory per process the planner may fill (default: the device's)
    # Microbatches per pipeline step once validated (``microbatches`` or the schedule's default).
    pipeline_microbatches: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        if self.dp != "auto":
            _check_positive_int("dp", self.dp)
        for name in ("tp", "pp", "ep", "virtual_stages"):
            _check_positive_int(name, getattr(self, name))
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"`zero={self.zero!r}` is not a ZeRO stage. Choose one of {_choices(ZERO_STAGES)}.")
        if not (isinstance(self.bucket_size_mb, (int, float)) and self.bucket_size_mb > 0):
            raise ValueError(f"`bucket_size_mb={self.bucket_size_mb!r}` must be a positive number of megabytes.")
        if self.zero_accumulation not in ZERO_ACCUMULATION:
            raise ValueError(
                f"`zero_accumulation={self.zero_accumulation!r}` is unknown. Choose one of {_choices(ZERO_ACCUMULATION)}."
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"`activation_checkpointing={self.activation_checkpointing!r}` is unknown."
                f" Choose one of {_choices(ACTIVATION_CHECKPOINTING)}."
            )
        if self.sequence_parallel and self.tp == 1:
            warnings.warn("`sequence_parallel=True` has no effect with tp=1 (there is nothing to split the sequence over).")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"`schedule={self.schedule!r}` is unknown. Choose one of {_choices(PIPELINE_SCHEDULES)}.")
        if self.microbatches is not None:
            _check_positive_int("microbatches", self.microbatches)
        if self.layout not in (None, "auto"):
            raise ValueError(f"`layout={self.layout!r}` is unknown. Choose 'auto' (the planner picks) or None.")
        if self.layout_memory_gb is not None and not (
            isinstance(self.layout_memory_gb, (int, float)) and not isinstance(self.layout_memory_gb, bool)
            and self.layout_memory_gb > 0
        ):
            raise ValueError(f"`layout_memory_gb={self.layout_memory_gb!r}` must be a positive number of GB.")
        if self.pipeline_balance not in ("params", "time"):
            raise ValueError(f"`pipeline_balance={self.pipeline_balance!r}` is unknown. Choose 'params' or 'time'.")
        if self.pp > 1:
            self._validate_pipeline()
        if isinstance(self.dp, int):  # known now: fail at construction, not at launch
            check_expert_degree(self.ep, self.dp)

    def _validate_pipeline(self) -> None:
        if self.zero == 3:
            raise ValueError(
                "`zero=3` with `pp>1` is not supported: FSDP2 would all-gather a stage's parameters for every"
                " microbatch's forward and backward (2m gathers per step instead of 2) and its reduce-scatter would"
                " fire once per microbatch, or it keeps them gathered and saves nothing over ZeRO-2. Use zero=1"
                " (or zero=2); each rank already holds only 1/pp of the model."
            )
        self.pipeline_microbatches = validate_pipeline_config(self.pp, self.schedule, self.microbatches, self.virtual_stages)

    def resolve_dims(self, world_size: int) -> ParallelDims:
        """The degrees for ``world_size`` processes (``dp="auto"`` takes what is left); raises ``ValueError``
        naming the degrees to change. The mesh itself is built later, by the strategy."""
        model_parallel = self.pp * self.tp
        if self.dp == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"The world size {world_size} is not divisible by pp={self.pp} x tp={self.tp} = {model_parallel},"
                    f" so `dp='auto'` has no valid value. Choose pp and tp whose product divides {world_size}."
                )
            dp = world_size // model_parallel
        else:
            dp = int(self.dp)
        return ParallelDims(pp=self.pp, dp=dp, tp=self.tp, ep=self.ep, world_size=world_size)

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` processes."""
        return self.resolve_dims(world_size).dp
