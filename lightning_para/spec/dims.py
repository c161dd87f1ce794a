"""The parallel dimensions, declared once (:data:`DIMS`), and the one record of their degrees (:class:`Degrees`).

The mesh, outermost first: ``pp, dp_replicate, edp, ep, cp, tp`` (:data:`MESH_DIMS`). ``tp`` is innermost, so a
tensor-parallel group is consecutive ranks (one node and its NVLink: Megatron's rule); ``cp`` next (the next most
frequent traffic, Megatron-Core orders tp-cp-ep-dp-pp and torchtitan puts cp just outside tp); ``ep`` and ``edp``
split data parallelism (experts sharded over ``ep``, replicated over ``edp``); ``dp_replicate`` (hybrid sharding)
outside the sharded part, so only gradient shards cross the slow links; ``pp`` outermost (only point-to-point
activations cross nodes). ``dp = dp_replicate x dp_shard`` and ``dp_shard = edp x ep``.

Flattened groups join mesh dims: ``dp`` (every data-parallel rank, the sampler's), ``dp_shard`` (what ZeRO shards
dense state over), ``dp_shard_cp`` (the same with the cp ranks: cp ranks see the same samples, so ZeRO shards over
them too, as torchtitan's FSDP over its ``dp_shard_cp``) and ``edp_cp`` (what ZeRO shards expert state over). A
flattened group whose ranks equal another's when a degree is 1 is that group (``same_as``).

The planner prices collectives under shorter names (``priced_as``): ZeRO's groups ``dp_shard_cp`` and ``edp_cp`` are
its ``dp`` and ``edp``. Everyone reads this table: the mesh (``lightning_para.mesh``), the planner's ``Layout``, the
collective counter's labels, the comparisons and the integrity check. A new dimension is one row here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Dim:
    """One dimension (a mesh dim, or a flattened group of mesh dims).

    ``parts``: the mesh dims a flattened group joins (empty: a mesh dim). ``position``: a mesh dim's place, 0
    outermost. ``priced_as``: the planner's name for collectives over it (empty: none priced). ``same_as``:
    ``(degree, name)``, the same group as ``name`` where ``degree`` is 1. ``within_node``: the planner keeps it
    inside a node. ``per_microbatch``: its collectives run inside every microbatch's layers (pp's run per pipeline
    flush, data parallelism's once per step).
    ``data``: data or context parallelism may shard a parameter over it. ``replicas``: a parameter whole on its
    ranks is one replica per rank (what the integrity check compares over).
    """

    name: str
    label: str
    parts: tuple[str, ...] = ()
    position: Optional[int] = None
    priced_as: str = ""
    same_as: tuple[str, str] = ()
    within_node: bool = False
    per_microbatch: bool = False
    data: bool = False
    replicas: bool = False

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        return self.parts or (self.name,)


# The order is the labels' priority: a process group two names share is labelled by the first (the plainer); the
# planner's groups (``priced_as``) come in its tables' order.
DIMS: tuple[Dim, ...] = (
    Dim("tp", "tensor parallel", position=5, priced_as="tp", within_node=True, per_microbatch=True, replicas=True),
    Dim("cp", "context parallel", position=4, priced_as="cp", per_microbatch=True, data=True, replicas=True),
    Dim("ep", "expert parallel", position=3, priced_as="ep", per_microbatch=True),
    Dim("pp", "pipeline parallel", position=0, priced_as="pp"),
    Dim("dp", "data parallel: every data-parallel rank (the sampler's)", ("dp_replicate", "edp", "ep"), data=True,
        replicas=True),
    Dim("dp_shard", "what ZeRO shards dense state over", ("edp", "ep"), same_as=("dp_replicate", "dp"), data=True),
    Dim("dp_shard_cp", "what ZeRO shards dense state over, with the cp ranks", ("edp", "ep", "cp"), priced_as="dp",
        same_as=("cp", "dp_shard"), data=True),
    Dim("edp", "expert data parallel: the ranks holding the same experts", position=2, data=True, replicas=True),
    Dim("edp_cp", "what ZeRO shards expert state over", ("edp", "cp"), priced_as="edp", same_as=("cp", "edp"),
        data=True),
    Dim("dp_replicate", "hybrid sharding's replicas", position=1, priced_as="dp_replicate", data=True, replicas=True),
)
DIM: dict[str, Dim] = {d.name: d for d in DIMS}
MESH_DIMS: tuple[str, ...] = tuple(d.name for d in sorted((d for d in DIMS if not d.parts), key=lambda d: d.position))
FLATTENED: dict[str, tuple[str, ...]] = {d.name: d.parts for d in DIMS if d.parts}
# The planner's groups -> the dimension each prices (its ``dp`` is ZeRO's ``dp_shard_cp``, its ``edp`` ``edp_cp``).
PRICED: dict[str, str] = {d.priced_as: d.name for d in DIMS if d.priced_as}
# The degrees a layout gives (ParaStrategy's and Layout's arguments): dp and the mesh dims but edp (dp_shard / ep).
DEGREES: tuple[str, ...] = ("dp", *(n for n in MESH_DIMS if n != "edp"))
# The degrees a rank has a coordinate along (dp: every data-parallel rank), outermost first.
COORDINATES: tuple[str, ...] = tuple(sorted(
    (n for n in DEGREES if n != "dp_replicate"), key=lambda n: min(DIM[p].position for p in DIM[n].mesh_dims)))


def planner_label(name: str) -> str:
    """The planner's name for collectives over dimension ``name`` (``""``: a group it prices none over)."""
    dim = DIM[name]
    return dim.priced_as or (name if name in PRICED else "")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid degrees for a dimension of size ``n``)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_dim(name: str, names: tuple[str, ...] = tuple(DIM)) -> Dim:
    """The row of ``name``; ``ValueError`` listing the names otherwise."""
    if name not in names:
        raise ValueError(f"Unknown mesh dimension {name!r}. Valid names: {', '.join(names)}.")
    return DIM[name]


@dataclass
class Degrees:
    """The degree of every dimension of one layout; ``world_size = pp x dp x cp x tp`` (``ep`` lives inside dp).

    The one record of degrees: :class:`~lightning_para.mesh.ParallelDims` (with its mesh) and the planner's
    ``Layout`` both answer with it."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    dp_replicate: int = 1

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard ZeRO state (all of ``dp`` without hybrid sharding)."""
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks of one replica: how many ranks shard the same experts' ZeRO state."""
        return max(1, self.dp_shard // self.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, n) for n in MESH_DIMS)

    def size(self, name: str) -> int:
        """Ranks in a group of dimension ``name`` (a flattened one: the product of its parts)."""
        return math.prod(getattr(self, part) for part in check_dim(name).mesh_dims)

    def span(self, name: str) -> int:
        """How many consecutive ranks a group of ``name`` reaches over (it stays in a node when that fits one):
        the mesh dims from the innermost out to its outermost part."""
        outermost = min(DIM[part].position for part in check_dim(name).mesh_dims)  # type: ignore[type-var]
        return math.prod(size for n, size in zip(MESH_DIMS, self.shape) if DIM[n].position >= outermost)

    def group(self, name: str) -> tuple[int, int]:
        """``(size, span)`` of a group of the planner's dimension ``name`` (:data:`PRICED`: ``dp`` is ZeRO's
        ``dp_shard x cp``, ``edp`` its expert group)."""
        if name not in PRICED:
            raise ValueError(f"`dim={name!r}` is unknown. Choose one of {', '.join(map(repr, PRICED))}.")
        return self.size(PRICED[name]), self.span(PRICED[name])

    def coordinate(self, name: str, global_rank: int) -> int:
        """``global_rank``'s coordinate along ``name`` in the mesh (row-major over :data:`MESH_DIMS`, as
        ``init_device_mesh`` lays ranks out; a flattened dimension is the row-major index over its parts)."""
        parts = check_dim(name).mesh_dims
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"`global_rank={global_rank}` is outside the world of {self.world_size} ranks.")
        coords, rest = {}, global_rank
        for dim, size in reversed(list(zip(MESH_DIMS, self.shape))):
            coords[dim], rest = rest % size, rest // size
        index = 0
        for part in parts:
            index = index * getattr(self, part) + coords[part]
        return index


__all__ = ["COORDINATES", "DEGREES", "DIM", "DIMS", "Degrees", "Dim", "FLATTENED", "MESH_DIMS", "PRICED", "check_dim", "divisors", "planner_label"]
