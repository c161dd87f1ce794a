"""``Layout``: one parallel layout (degrees and options) that the cost model prices.

Its degrees are :class:`~lightning_para.spec.dims.Degrees` (:attr:`Layout.degrees`), the record
``ParallelDims`` is too: a group's size and the ranks it spans follow the mesh order of
:mod:`lightning_para.spec.dims` (tensor and context parallelism, which communicate inside every
layer, stay inside a node whenever ``tp * cp <= gpus_per_node``; pipeline parallelism, which
sends one activation per microbatch, crosses nodes first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from functools import cached_property
from typing import Any, Optional

from lightning_para.spec.dims import DEGREES, MESH_DIMS, Degrees
from lightning_para.spec.options import (
    LAYOUT_OPTIONS,
    LAYOUT_RULES,
    OPTIONS,
    check_option,
    check_rules,
    sequence_parallel_problem,
)

# The layout options a Layout holds with the planner's own type and default (the rest: the declaration's).
# The planner prices resolved layouts: whole degrees, a bool for loss parallel and compile (a dict of
# torch.compile options is ``True`` here), ``dp_shard`` derived from ``dp / dp_replicate``, the split as a
# tuple, and ``bucket_size_mb=None`` for Megatron-LM's rule (:func:`~lightning_para.plan.shape.bucket_bytes`).
PLANNER_FIELDS: dict[str, tuple[Any, Any]] = {
    **{name: (int, 1) for name in DEGREES}, "loss_parallel": (bool, True), "compile": (bool, False),
    "pipeline_split": (Optional[tuple[int, ...]], None), "bucket_size_mb": (Optional[float], None),
}
# Options the search does not vary: :class:`~lightning_para.plan.search.SearchSpace` takes them
# from its ``options`` layout (``layout="auto"``: the user's config), so a chosen layout keeps them.
FIXED_OPTIONS = (
    "cp_method", "cp_load_balance", "zero3_units", "sp_save_input_shard", "loss_parallel", "pipeline_split",
    "pipeline_balance", "compile", "fp8",
)


def _planner_field(name: str) -> tuple[str, Any, Any]:
    annotation, default = PLANNER_FIELDS.get(name, (OPTIONS[name].annotation, OPTIONS[name].default))
    return name, annotation, field(default=default)


# The fields: every planned option of the one declaration (lightning_para.spec.options), in its order.
_LayoutOptions = make_dataclass(
    "_LayoutOptions", [_planner_field(o.name) for o in LAYOUT_OPTIONS if not o.not_planned], frozen=True
)
_LayoutOptions.__module__ = __name__
# The values a planner field takes besides its kind's: None where it is the planner's default, never "auto".
_PLANNER_ALSO = {name: (None,) if default is None else () for name, (_, default) in PLANNER_FIELDS.items()}


@dataclass(frozen=True)
class Layout(_LayoutOptions):
    """Degrees and options of one layout; ``world_size = pp * dp * cp * tp``.

    Every field is the ParaStrategy argument of the same name and meaning, documented once in
    :data:`lightning_para.spec.options.LAYOUT_OPTIONS` (:meth:`strategy_kwargs` and :meth:`from_config` are
    the one mapping each way; :data:`PLANNER_FIELDS` the fields with the planner's own type or default; the other
    ParaStrategy arguments are the options the planner does not price, each saying why, and the front ends' own).
    What the planner makes of each (priced, carried, or priced as the default): ``docs/planner.md``, "Layout and mesh
    order"; the model-dependent checks (heads divide ``tp``, experts divide ``ep``, ...) are
    :func:`~lightning_para.plan.cost.layout_problems`'s, with ParaStrategy's rules
    (:data:`lightning_para.spec.options.RUN_RULES`).
    """

    def __post_init__(self) -> None:
        # Each option's check and the rules between options are declared once (lightning_para.spec.options), shared
        # with ParallelConfig and the --layout parser.
        if isinstance(self.compile, Mapping):  # ParaStrategy's dict of torch.compile options: compiled
            object.__setattr__(self, "compile", True)
        if self.pipeline_split is not None:
            object.__setattr__(self, "pipeline_split", tuple(int(i) for i in self.pipeline_split))
        for f in fields(self):
            if f.name == "dp_shard" and self.dp_shard is None:
                continue
            check_option(f.name, getattr(self, f.name), _PLANNER_ALSO.get(f.name))
        check_rules({f.name: getattr(self, f.name) for f in fields(self)}, LAYOUT_RULES)
        if self.dp_shard is None:
            object.__setattr__(self, "dp_shard", self.dp // self.dp_replicate)
        problem = sequence_parallel_problem(self.sequence_parallel, self.tp)
        if problem:  # ParaStrategy only warns (nothing to split over); the planner cannot price a sequence shard of tp=1
            raise ValueError("`sequence_parallel=True` needs `tp > 1` (it shards the sequence over the tp ranks).")

    @property
    def reduces_each_microbatch(self) -> bool:
        """ZeRO-2 reduce-scatters each pipeline microbatch's gradients (``"reduce_each_microbatch"`` with ``pp > 1``;
        without a pipeline it is ``"reduce_each_step"``)."""
        return self.zero_accumulation == "reduce_each_microbatch" and self.pp > 1

    # ------------------------------------------------------------------ the one mapping
    def strategy_kwargs(self) -> dict[str, Any]:
        """ParaStrategy's arguments for this layout: the one ``Layout -> ParaStrategy`` mapping.

        Every field under its own name (``pipeline_split`` as a list); ``bucket_size_mb=None``
        (the planner's rule) is left out, so a config keeps its own.
        ``ParaStrategy(**layout.strategy_kwargs())`` and ``config.with_layout(layout)`` run this layout.
        """
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.pipeline_split is not None:
            out["pipeline_split"] = list(self.pipeline_split)
        if self.bucket_size_mb is None:
            del out["bucket_size_mb"]
        return out

    @classmethod
    def from_config(cls, config: Any, dims: Degrees) -> "Layout":
        """The layout of a resolved ParaStrategy configuration (the reverse of :meth:`strategy_kwargs`): ``config`` a
        :class:`~lightning_para.config.ParallelConfig`, ``dims`` its :class:`~lightning_para.mesh.ParallelDims`.

        ``dims`` gives the degrees ``"auto"`` resolved to. Pipeline options are those of the
        run only with a pipeline (``pp=1`` runs no schedule) and ``sequence_parallel`` only with
        ``tp > 1``, as ParaStrategy applies them; microbatches are the validated count.
        """
        pipelined = dims.pp > 1
        kwargs = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        kwargs.update(
            **{name: getattr(dims, name) for name in DEGREES}, dp_shard=dims.dp_shard,
            sequence_parallel=config.sequence_parallel and dims.tp > 1,
            schedule=config.schedule if pipelined else "1f1b",
            microbatches=config.pipeline_microbatches if pipelined else None,
            virtual_stages=config.virtual_stages if pipelined else 1,
            pipeline_split=tuple(config.pipeline_split) if pipelined and config.pipeline_split is not None else None,
            compile=bool(config.compile),  # the planner prices whether; a dict of torch.compile options stays the config's
        )
        return cls(**kwargs)

    @cached_property
    def degrees(self) -> Degrees:
        """The layout's degrees: the record :class:`~lightning_para.mesh.ParallelDims` is built on."""
        return Degrees(**{name: getattr(self, name) for name in DEGREES})

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    def group(self, dim: str) -> tuple[int, int]:
        """``(size, span)`` of a communication group of the planner's dimension ``dim``: its ranks, and how many
        consecutive ranks it reaches over (it stays inside a node when the span fits in one;
        :meth:`Degrees.group <lightning_para.spec.dims.Degrees.group>`: ``dp`` is ZeRO's ``cp x dp_shard``)."""
        return self.degrees.group(dim)

    def label(self) -> str:
        """A compact name, e.g. ``dp128 tp8 pp16 z1 sp zero_bubble m16``."""
        parts = [f"dp{self.dp}"]
        if self.dp_replicate > 1:
            parts[0] += f"({self.dp_replicate}x{self.dp_shard})"
        # The model-parallel degrees above 1, innermost first (dp_replicate is in dp's part).
        parts += [f"{n}{getattr(self, n)}" for n in reversed(MESH_DIMS) if n in DEGREES[1:] and n != "dp_replicate"
                  and getattr(self, n) > 1]
        if self.cp > 1 and self.cp_method == "all_to_all":
            parts[-1] += "(ulysses)"
        parts.append(f"z{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.microbatches is not None:
            parts.append(f"m{self.microbatches}")
        if self.activation_checkpointing:
            parts.append(f"rc:{self.activation_checkpointing}")
        if self.zero == 3 and self.zero3_units != "auto":
            parts.append(f"units:{self.zero3_units}")
        if self.cp > 1 and not self.cp_load_balance:
            parts.append("cp-contiguous")
        if self.zero_accumulation != "no_sync" and self.zero >= 2:
            parts.append(self.zero_accumulation.replace("_", "-"))
        if self.compile:
            parts.append("compile")
        if self.fp8:
            parts.append(f"fp8:{self.fp8}")
        return " ".join(parts)
