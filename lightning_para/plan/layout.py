"""``Layout``: one parallel layout (degrees and options) that the cost model prices.

Mesh order, innermost (neighbouring ranks) first: ``tp``, ``cp``, ``ep`` (the inner part of
data parallelism), the rest of ``dp_shard``, ``dp_replicate``, then ``pp`` outermost. Tensor
and context parallelism, which communicate inside every layer, therefore stay inside a node
whenever ``tp * cp <= gpus_per_node``; pipeline parallelism, which sends one activation per
microbatch, crosses nodes first. (Megatron-LM orders its groups the same way: tp-cp-ep-dp-pp.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_para.plan.pipeline import check_schedule

RECOMPUTE = (None, "selective", "full")
CP_METHODS = ("ring", "all_to_all")  # ParaStrategy's cp_method (lightning_para.parallel.context)
ZERO_ACCUMULATION = ("no_sync", "reduce_each_step")


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be a positive integer (1 disables this dimension).")


@dataclass(frozen=True)
class Layout:
    """Degrees and options of one layout; ``world_size = pp * dp * cp * tp``.

    Args:
        dp, tp, pp: data, tensor and pipeline parallel degrees.
        ep: expert parallel degree, inside ``dp``: it must divide ``dp_shard`` (checked against
            the model by :func:`~lightning_para.plan.cost.layout_problems`, like every rule that
            depends on more than one argument's range).
        cp: context parallel degree (the sequence split over ranks).
        cp_method: ``"ring"`` (ring attention: K/V blocks passed peer-to-peer, overlapped with the
            blockwise attention) or ``"all_to_all"`` (DeepSpeed-Ulysses: q, k, v and the output
            re-sharded from sequence to heads; heads must divide by ``cp x tp``).
        dp_replicate, dp_shard: hybrid sharding, ``dp = dp_replicate * dp_shard``; ZeRO shards
            over ``dp_shard`` (default: all of ``dp``) and all-reduces over ``dp_replicate``.
        zero: ZeRO stage 0-3.
        sequence_parallel: Megatron sequence parallelism with ``tp`` (Korthikanti et al. 2022).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"`` or ``"zbv"``.
        microbatches: microbatches per pipeline flush (``None``: all microbatches of the step
            in one flush; otherwise the rest is gradient accumulation). Ignored without a
            pipeline, where each microbatch is one accumulation step.
        virtual_stages: model chunks per pipeline rank.
        recompute: activation recomputation, ``None``, ``"selective"`` or ``"full"``.
        zero_accumulation: ZeRO-2/3 over several microbatches: ``"no_sync"`` holds full
            gradients and reduces once per step, ``"reduce_each_step"`` reduce-scatters every
            microbatch (ParaStrategy's option of the same name).
        pipeline_split: where pipeline chunks start, as indices into the pipeline contract's
            entries (ParaStrategy's ``pipeline_split``); ``None``: balanced by parameter count,
            as ParaStrategy does by default.
        bucket_mb: ZeRO-0/1/2 gradient bucket size in MiB (ParaStrategy's ``bucket_size_mb``);
            ``None``: Megatron-LM's rule (:func:`~lightning_para.plan.rank.bucket_bytes`), which
            the YAML then suggests. It changes the number of calls, not the bytes.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp_replicate: int = 1
    dp_shard: Optional[int] = None
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    recompute: Optional[str] = None
    zero_accumulation: str = "no_sync"
    pipeline_split: Optional[tuple[int, ...]] = None
    bucket_mb: Optional[float] = None
    cp_method: str = "ring"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "dp_replicate", "virtual_stages"):
            _check_degree(name, getattr(self, name))
        if self.dp_shard is None:
            if self.dp % self.dp_replicate:
                raise ValueError(f"`dp_replicate={self.dp_replicate}` must divide `dp={self.dp}`.")
            object.__setattr__(self, "dp_shard", self.dp // self.dp_replicate)
        _check_degree("dp_shard", self.dp_shard)
        if self.dp_replicate * self.dp_shard != self.dp:  # type: ignore[operator]
            raise ValueError(
                f"`dp_replicate={self.dp_replicate}` x `dp_shard={self.dp_shard}` must equal `dp={self.dp}`."
            )
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"`zero={self.zero!r}` is not a ZeRO stage. Choose one of 0, 1, 2, 3.")
        if self.dp_replicate > 1 and self.zero == 0:
            raise ValueError("`dp_replicate > 1` (hybrid sharding) needs `zero >= 1`: ZeRO-0 shards nothing.")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"`sequence_parallel={self.sequence_parallel!r}` must be True or False.")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("`sequence_parallel=True` needs `tp > 1` (it shards the sequence over the tp ranks).")
        check_schedule(self.schedule)
        if self.microbatches is not None:
            _check_degree("microbatches", self.microbatches)
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"`recompute={self.recompute!r}` is unknown. Choose one of None, 'selective', 'full'.")
        if self.pipeline_split is not None:
            object.__setattr__(self, "pipeline_split", tuple(int(i) for i in self.pipeline_split))
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise ValueError(f"`bucket_mb={self.bucket_mb!r}` must be a positive number of MiB.")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"`cp_method={self.cp_method!r}` is unknown. Choose 'ring' or 'all_to_all'.")
        if self.zero_accumulation not in ZERO_ACCUMULATION:
            raise ValueError(
                f"`zero_accumulation={self.zero_accumulation!r}` is unknown. Choose 'no_sync' or 'reduce_each_step'."
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks that hold the same experts, ``dp / ep``."""
        return max(1, self.dp // self.ep)

    def group(self, dim: str) -> tuple[int, int]:
        """``(size, span)`` of a communication group: its ranks, and how many consecutive
        ranks it reaches over (it stays inside a node when the span fits in one).

        Dims: ``tp``, ``cp``, ``ep``, ``dp`` (the ZeRO/gradient group of dense parameters:
        ``cp x dp_shard``), ``edp`` (the same for experts: ``cp x dp_shard / ep``),
        ``dp_replicate`` and ``pp``.
        """
        inner_dp = self.tp * self.cp * self.dp_shard  # type: ignore[operator]
        groups = {
            "tp": (self.tp, self.tp),
            "cp": (self.cp, self.tp * self.cp),
            "ep": (self.ep, self.tp * self.cp * self.ep),
            "dp": (self.cp * self.dp_shard, inner_dp),  # type: ignore[operator]
            "edp": (max(1, self.cp * self.dp_shard // self.ep), inner_dp),  # type: ignore[operator]
            "dp_replicate": (self.dp_replicate, inner_dp * self.dp_replicate),
            "pp": (self.pp, self.world_size),
        }
        if dim not in groups:
            raise ValueError(f"`dim={dim!r}` is unknown. Choose one of {', '.join(map(repr, groups))}.")
        return groups[dim]

    def label(self) -> str:
        """A compact name, e.g. ``dp128 tp8 pp16 z1 sp zero_bubble m16``."""
        parts = [f"dp{self.dp}"]
        if self.dp_replicate > 1:
            parts[0] += f"({self.dp_replicate}x{self.dp_shard})"
        parts += [f"{name}{getattr(self, name)}" for name in ("tp", "pp", "ep", "cp") if getattr(self, name) > 1]
        if self.cp > 1 and self.cp_method == "all_to_all":
            parts[-1] += "(ulysses)"
        parts.append(f"z{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.microbatches is not None:
            parts.append(f"m{self.microbatches}")
        if self.recompute:
            parts.append(f"rc:{self.recompute}")
        if self.zero_accumulation != "no_sync" and self.zero >= 2:
            parts.append("reduce-each-step")
        return " ".join(parts)
