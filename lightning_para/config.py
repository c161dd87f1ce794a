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

ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
# Pipeline schedules by user-facing name; `parallel.pipeline_parallel` maps them to torch classes.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "looped_bfs", "zbv", "dualpipev")
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
    # --- extra, passed through to the dimension modules ---
    extra: dict[str, Any] = field(default_factory=dict)

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
        if self.pipeline_balance not in ("params", "time"):
            raise ValueError(f"`pipeline_balance={self.pipeline_balance!r}` is unknown. Choose 'params' or 'time'.")
        if self.pp > 1:
            self._validate_pipeline()
        if isinstance(self.dp, int) and self.dp % self.ep != 0:
            raise ValueError(
                f"`ep={self.ep}` must divide `dp={self.dp}`: expert parallelism splits the data-parallel ranks."
                f" Choose ep in {_divisors(self.dp)} or a dp that is a multiple of {self.ep}."
            )

    def _validate_pipeline(self) -> None:
        if self.zero == 3:
            raise ValueError(
                "`zero=3` with `pp>1` is not supported: FSDP2 would all-gather a stage's parameters for every"
                " microbatch's forward and backward (2m gathers per step instead of 2) and its reduce-scatter would"
                " fire once per microbatch, or it keeps them gathered and saves nothing over ZeRO-2. Use zero=1"
                " (or zero=2); each rank already holds only 1/pp of the model."
            )
        from lightning_para.parallel.pipeline_schedules import validate_pipeline_config

        validate_pipeline_config(self.pp, self.schedule, self.microbatches, self.virtual_stages)

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` processes; ``"auto"`` takes what is left."""
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
        if self.pp * dp * self.tp != world_size:
            raise ValueError(
                f"The parallel degrees pp={self.pp} x dp={dp} x tp={self.tp} = {self.pp * dp * self.tp} do not match"
                f" the world size {world_size} (devices x num_nodes). Change the degrees so their product is"
                f" {world_size}, or set dp='auto'."
            )
        if dp % self.ep != 0:
            raise ValueError(
                f"`ep={self.ep}` must divide the data-parallel degree dp={dp}: expert parallelism splits the"
                f" data-parallel ranks. Choose ep in {_divisors(dp)}."
            )
        return dp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
