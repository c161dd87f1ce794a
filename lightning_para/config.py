"""All options of :class:`~lightning_para.ParaStrategy` in one validated dataclass.

Every check here runs before any process group or collective exists, so a bad configuration
fails the same way on every rank and can never leave a rank waiting in a collective.
Errors are ``ValueError`` naming the argument and what to choose instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Protocol, Union

from lightning_para._dtensor import divisors
from lightning_para.mesh import ParallelDims, check_expert_degree
from lightning_para.options import (
    ACTIVATION_CHECKPOINTING,
    PRECISIONS,
    TP_UNPLANNED,
    ZERO_STAGES,
    check_option,
    check_rules,
)
from lightning_para.parallel.compile import compile_options
from lightning_para.parallel.pipeline.schedules import schedule_info, validate_pipeline_config

__all__ = ["ACTIVATION_CHECKPOINTING", "PRECISIONS", "ParallelConfig", "StrategyLayout", "TP_UNPLANNED", "ZERO_STAGES"]

Degree = Union[int, Literal["auto"]]


class StrategyLayout(Protocol):
    """What :meth:`ParallelConfig.with_layout` takes: the planner's ``Layout`` (``lightning_para.plan``),
    whose :meth:`strategy_kwargs` is the one mapping from a layout to ParaStrategy's arguments."""

    def strategy_kwargs(self) -> dict[str, Any]: ...


@dataclass
class ParallelConfig:
    """The parallel layout and the options of each dimension.

    Degrees multiply to the world size: ``pp * dp * cp * tp == world_size``. Expert parallelism
    lives *inside* data parallelism (``ep`` divides ``dp``): the ``dp`` ranks of one
    pipeline stage and tensor-parallel slot are split into ``dp // ep`` expert-data-parallel
    groups of ``ep`` ranks each, so ``ep`` adds no ranks of its own.

    Hybrid sharding splits ``dp = dp_replicate * dp_shard``: ZeRO state is sharded over
    ``dp_shard`` and replicated over ``dp_replicate`` (then ``ep`` divides ``dp_shard``). ``dp``
    alone means ``dp_shard = dp``. Context parallelism (``cp``) splits every sequence over its
    own ranks; the cp ranks of a data-parallel rank see the same samples.
    """

    dp: Degree = "auto"
    # "auto": ModelParallelStrategy's meaning, the devices of one node (or what dp leaves, when dp is set).
    tp: Degree = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    # --- data parallel ---
    bucket_size_mb: float = 25.0
    # "no_sync": accumulation micro-steps skip all gradient communication (the A-th reduces once).
    # "reduce_each_step": ZeRO-2/3 reduce-scatter every micro-step so gradients stay sharded
    # (communication grows with A, memory does not). "reduce_each_microbatch": ZeRO-2 also reduce-scatters
    # each pipeline microbatch's gradients, stage by stage (parallel/data/zero.py).
    zero_accumulation: str = "no_sync"
    # ZeRO-3's FSDP2 units: "blocks" (embedding, norm and head one grouped unit: Lightning's recipe's
    # collectives), "blocks_and_ends" (a unit each, torchtitan's), "auto" (by size; parallel/data/fsdp.py).
    zero3_units: str = "auto"
    # --- tensor parallel ---
    sequence_parallel: bool = False
    # Under SP, keep only the sequence shard of each sublayer's input for backward and
    # all-gather it again there (Megatron-SP): less activation memory, one more all-gather
    # per sublayer. False keeps the gathered input: the same bytes as TP, more memory.
    sp_save_input_shard: bool = True
    tp_plan: Optional[Mapping[str, Any]] = None
    # An nn.Linear the plan does not cover: "error" (default) or "replicate" (whole on every tp rank).
    tp_unplanned: str = "error"
    loss_parallel: bool = True
    activation_checkpointing: Optional[str] = None
    # --- context parallel (issue 16) ---
    cp: int = 1
    cp_method: str = "ring"  # "ring" (K/V blocks peer-to-peer) or "all_to_all" (DeepSpeed-Ulysses)
    cp_load_balance: bool = True  # head-tail chunks, so causal attention costs the same on every cp rank
    # The first cp step checks that the model computes under cp what it computes on the whole
    # sequence (positions, masks, labels: parallel/context/check.py) and raises naming the hook to write.
    cp_check: bool = True
    # --- hybrid sharded data parallel (issue 16): dp = dp_replicate x dp_shard ---
    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    # --- pipeline parallel ---
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    pipeline_split: Optional[Sequence[int]] = None
    pipeline_balance: str = "params"
    # --- layout="auto" (issue 15): the planner picks what the user left at its default at setup ---
    layout: Optional[str] = None
    layout_memory_gb: Optional[float] = None  # memory per process the planner may fill (default: the device's)
    # --- performance (issue 25) ---
    # torch.compile each block (True: inductor, torch's defaults; a dict: torch.compile's keyword arguments).
    compile: Union[bool, Mapping[str, Any]] = False
    # torchao float8 training of the linears ("tensorwise" or "rowwise"; parallel/fp8.py), None: off.
    fp8: Optional[str] = None
    # Microbatches per pipeline step once validated (``microbatches`` or the schedule's default).
    pipeline_microbatches: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        if self.dp != "auto":
            check_option("dp", self.dp)
        if self.tp != "auto":
            check_option("tp", self.tp)
        for name in ("pp", "ep", "cp", "virtual_stages"):
            check_option(name, getattr(self, name))
        check_option("tp_unplanned", self.tp_unplanned)
        self._validate_context_and_hybrid()
        for name in ("zero", "bucket_size_mb", "zero_accumulation"):
            check_option(name, getattr(self, name))
        check_rules({"zero_accumulation": self.zero_accumulation, "zero": self.zero})
        check_option("zero3_units", self.zero3_units)
        if self.zero3_units != "auto" and self.zero != 3:
            warnings.warn(f"`zero3_units={self.zero3_units!r}` has no effect with zero={self.zero} (it chooses ZeRO-3's units).")
        check_option("activation_checkpointing", self.activation_checkpointing)
        if self.sequence_parallel and self.tp == 1:
            warnings.warn("`sequence_parallel=True` has no effect with tp=1 (there is nothing to split the sequence over).")
        check_option("schedule", self.schedule)
        if self.microbatches is not None:
            check_option("microbatches", self.microbatches)
        if self.layout not in (None, "auto"):
            raise ValueError(f"`layout={self.layout!r}` is unknown. Choose 'auto' (the planner picks) or None.")
        if self.layout_memory_gb is not None and not (
            isinstance(self.layout_memory_gb, (int, float)) and not isinstance(self.layout_memory_gb, bool)
            and self.layout_memory_gb > 0
        ):
            raise ValueError(f"`layout_memory_gb={self.layout_memory_gb!r}` must be a positive number of GB.")
        check_option("pipeline_balance", self.pipeline_balance)
        compile_options(self.compile)  # ValueError naming `compile`
        check_option("fp8", self.fp8)
        if self.fp8 == "rowwise" and self.tp != 1:
            raise ValueError(
                f"`fp8='rowwise'` with `tp={self.tp}` is not supported: torchao's float8 tensor-parallel styles assume"
                " tensorwise scales. Use fp8='tensorwise' with tp, or fp8='rowwise' with tp=1."
            )
        if self.pp > 1:
            self._validate_pipeline()
        if isinstance(self.dp, int):  # known now: fail at construction, not at launch
            check_expert_degree(self.ep, self.dp, self._replicas(self.dp))

    def _validate_context_and_hybrid(self) -> None:
        """cp, cp_method and the hybrid-sharding degrees (issue 16)."""
        for name in ("cp_method", "cp_load_balance", "cp_check"):
            check_option(name, getattr(self, name))
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) is not None:
                check_option(name, getattr(self, name))
        if self.cp > 1 and self.activation_checkpointing in ("selective", "selective_op"):
            raise ValueError(
                f"`activation_checkpointing={self.activation_checkpointing!r}` with `cp>1` is not supported: selective recomputation caches"
                " the outputs of collectives, which would replay ring attention's point-to-point receives without"
                " their sends. Use activation_checkpointing='full' (recomputes attention across the cp group) or None."
            )
        check_rules({"dp": self.dp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "zero": self.zero,
                     "layout": self.layout})

    def with_layout(self, layout: StrategyLayout) -> "ParallelConfig":
        """This config with a planner layout's degrees and options, validated again.

        The one place a ``Layout`` becomes a config: ``layout.strategy_kwargs()`` names
        ParaStrategy's arguments, so every option the layout holds replaces this config's
        (``layout="auto"``, ``plan --validate`` and the parity tool all come through here).
        Options the layout leaves out (e.g. ``bucket_size_mb`` when the planner used its rule)
        stay this config's.
        """
        kwargs = layout.strategy_kwargs()
        if kwargs.get("compile") and isinstance(self.compile, Mapping):
            kwargs["compile"] = self.compile  # the layout says whether; the user's dict says how
        return replace(self, **kwargs)

    def _replicas(self, dp: int) -> int:
        """``dp_replicate`` for ``dp`` data-parallel ranks (1 without hybrid sharding)."""
        if self.dp_replicate is not None:
            return self.dp_replicate
        if self.dp_shard is not None:
            if dp % self.dp_shard:
                raise ValueError(
                    f"`dp_shard={self.dp_shard}` must divide dp={dp} (the world size / (pp x cp x tp))."
                    f" Choose dp_shard in {divisors(dp)}."
                )
            return dp // self.dp_shard
        return 1

    def _validate_pipeline(self) -> None:
        if self.zero == 3:
            raise ValueError(
                "`zero=3` with `pp>1` is not supported: FSDP2 would all-gather a stage's parameters for every"
                " microbatch's forward and backward (2m gathers per step instead of 2) and its reduce-scatter would"
                " fire once per microbatch, or it keeps them gathered and saves nothing over ZeRO-2. Use zero=1"
                " (or zero=2); each rank already holds only 1/pp of the model."
            )
        if self.compile and schedule_info(self.schedule).split_backward:
            raise ValueError(
                f"`compile=True` with `schedule={self.schedule!r}` is not supported: the schedule splits each backward"
                " into input- and weight-gradient passes over the stage's autograd graph, which a compiled block"
                " runs as one opaque node. Use schedule='1f1b' or 'interleaved' (or 'gpipe', 'looped_bfs') with"
                " compile, or compile=False with this schedule."
            )
        self.pipeline_microbatches = validate_pipeline_config(self.pp, self.schedule, self.microbatches, self.virtual_stages)

    def resolve_dims(self, world_size: int, devices_per_node: Optional[int] = None) -> ParallelDims:
        """The degrees for ``world_size`` processes (``dp="auto"`` takes what is left); raises ``ValueError``
        naming the degrees to change. The mesh itself is built later, by the strategy.

        ``tp="auto"`` follows Lightning's ``ModelParallelStrategy``: the devices of one node
        (``devices_per_node``, default: the world size), so with ``dp="auto"`` too, dp is the
        number of nodes. With an explicit ``dp``, ``tp="auto"`` takes what dp, pp and cp leave."""
        tp = self._resolve_tp(world_size, devices_per_node)
        model_parallel = self.pp * self.cp * tp
        if self.dp == "auto" and self.dp_replicate is not None and self.dp_shard is not None:
            dp = self.dp_replicate * self.dp_shard  # both given: dp is their product
        elif self.dp == "auto":
            if world_size % model_parallel != 0:
                cp, names = (f" x cp={self.cp}", "pp, cp and tp") if self.cp > 1 else ("", "pp and tp")
                raise ValueError(
                    f"The world size {world_size} is not divisible by pp={self.pp}{cp} x tp={tp} ="
                    f" {model_parallel}, so `dp='auto'` has no valid value. Choose {names} whose product divides"
                    f" {world_size}."
                )
            dp = world_size // model_parallel
        else:
            dp = int(self.dp)
        return ParallelDims(
            pp=self.pp, dp=dp, tp=tp, ep=self.ep, world_size=world_size, cp=self.cp,
            dp_replicate=self._replicas(dp),
        )

    def _resolve_tp(self, world_size: int, devices_per_node: Optional[int]) -> int:
        if self.tp != "auto":
            return int(self.tp)
        if self.dp != "auto":
            taken = int(self.dp) * self.pp * self.cp
            rest = world_size // taken
            if rest < 1 or rest * taken != world_size:
                raise ValueError(
                    f"`tp='auto'` takes what dp={self.dp} x pp={self.pp} x cp={self.cp} leave of the world size"
                    f" {world_size}, but {taken} does not divide it. Set tp explicitly or choose dp that divides"
                    f" {world_size}."
                )
            return rest
        return devices_per_node or world_size

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` processes."""
        return self.resolve_dims(world_size).dp
