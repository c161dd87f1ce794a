"""All options of :class:`~lightning_para.ParaStrategy` in one validated dataclass.

Every check here runs before any process group or collective exists, so a bad configuration
fails the same way on every rank and can never leave a rank waiting in a collective.
Errors are ``ValueError`` naming the argument and what to choose instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Any, Optional, Protocol

from lightning_para.mesh import ParallelDims
from lightning_para.spec.options import LAYOUT_OPTIONS, check_option, check_rules, data_parallel_factors_problem, warn_rules
from lightning_para.spec.schedules import validate_pipeline_config

__all__ = ["ParallelConfig", "StrategyLayout"]


class StrategyLayout(Protocol):
    """What :meth:`ParallelConfig.with_layout` takes: the planner's ``Layout`` (``lightning_para.plan``),
    whose :meth:`strategy_kwargs` is the one mapping from a layout to ParaStrategy's arguments."""

    def strategy_kwargs(self) -> dict[str, Any]: ...


# The fields are the one declaration's (lightning_para.spec.options.LAYOUT_OPTIONS: name, type, default), in its order.
_Options = make_dataclass("_Options", [(o.name, o.annotation, field(default=o.default)) for o in LAYOUT_OPTIONS])
_Options.__module__ = __name__


@dataclass
class ParallelConfig(_Options):
    """The parallel layout and the options of each dimension: one field per option of
    :data:`lightning_para.spec.options.LAYOUT_OPTIONS` (its name, type, default and meaning), checked there.

    Degrees multiply to the world size: ``pp * dp * cp * tp == world_size``. Expert parallelism
    lives *inside* data parallelism (``ep`` divides ``dp``): the ``dp`` ranks of one
    pipeline stage and tensor-parallel slot are split into ``dp // ep`` expert-data-parallel
    groups of ``ep`` ranks each, so ``ep`` adds no ranks of its own.

    Hybrid sharding splits ``dp = dp_replicate * dp_shard``: ZeRO state is sharded over
    ``dp_shard`` and replicated over ``dp_replicate``. ``dp`` alone means ``dp_shard = dp``.
    Context parallelism (``cp``) splits every sequence over its own ranks; the cp ranks of a
    data-parallel rank see the same samples. ``loss_parallel="auto"`` becomes ``True`` here (the
    Trainer's meaning); Fabric's front end passes ``False`` for it.
    """

    # Microbatches per pipeline step once validated (``microbatches`` or the schedule's default).
    pipeline_microbatches: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        if self.loss_parallel == "auto":
            self.loss_parallel = True
        for option in LAYOUT_OPTIONS:  # each value, as the declaration says
            check_option(option.name, getattr(self, option.name))
        # The rules between options (lightning_para.spec.options.RULES; with an explicit dp, ep's too: known now, so it
        # fails at construction, not at launch).
        check_rules(self.__dict__)
        warn_rules(self.__dict__)
        if self.pp > 1:
            self.pipeline_microbatches = validate_pipeline_config(self.pp, self.schedule, self.microbatches, self.virtual_stages)

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
            check_rules({"dp": dp, "dp_shard": self.dp_shard}, (data_parallel_factors_problem,))
            return dp // self.dp_shard
        return 1

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
