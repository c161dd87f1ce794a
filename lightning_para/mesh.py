"""One :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions, built once.

Layout (outermost to innermost)::

    ("pp", "dp_replicate", "edp", "ep", "cp", "tp")

    flattened:  "dp"          = ("dp_replicate", "edp", "ep")   every data-parallel rank (the sampler's)
                "dp_shard"    = ("edp", "ep")                    what ZeRO shards dense state over
                "dp_shard_cp" = ("edp", "ep", "cp")              the same with the cp ranks (cp > 1)
                "edp_cp"      = ("edp", "cp")                    what ZeRO shards expert state over (cp > 1)

* ``tp`` is innermost, so tensor-parallel groups are consecutive ranks: on GPUs that is
  one node and its NVLink (Megatron's rule: TP within a node). It communicates inside every
  sublayer, forward and backward.
* ``cp`` comes next: context parallelism exchanges K/V blocks (ring) or re-shards q/k/v
  (all-to-all) inside every attention layer, forward and backward -- the next most frequent
  traffic after tp, so ``tp * cp`` ranks should share a node (Megatron-Core orders its groups
  tp-cp-ep-dp-pp; torchtitan puts cp just outside tp too).
* ``ep`` and ``edp`` split data parallelism: experts are sharded over ``ep`` and replicated over
  the expert-data-parallel ranks; dense parameters are replicated over all of ``dp``. ``ep``
  all-to-alls once per MoE layer, so it sits inside the rest of dp.
* ``dp_replicate`` (hybrid sharded data parallel) sits outside the sharded part: ZeRO state is
  sharded over ``dp_shard`` (inside a node) and replicated over ``dp_replicate`` (across
  nodes), so the only traffic crossing the slow links is one all-reduce of each rank's gradient
  *shard* per step; parameters are gathered within the node.
* ``pp`` is outermost, so pipeline neighbours sit in different nodes and only their
  point-to-point activations cross the slow links (PP across nodes).

``dp = dp_replicate * dp_shard`` and ``dp_shard = edp * ep``. With ``dp`` alone (the default)
``dp_replicate = 1`` and the mesh is today's flat one. The cp ranks of a data-parallel rank see
the same samples, so gradients are averaged over ``dp x cp``: ZeRO shards over ``dp_shard x cp``
("dp_shard_cp"), as torchtitan's FSDP does over its flattened ``dp_shard_cp``.

Every dimension exists even at size 1, so code asks for ``mesh["tp"]`` without branching.
Flattened names whose ranks coincide with another name (``dp_shard`` when ``dp_replicate = 1``,
``dp_shard_cp`` when ``cp = 1``) are the *same* mesh object, so one process group serves both
and the comm tracer labels it by the plainer name. Sub-meshes are handed to each ``apply_*``
function explicitly; there is no global state.

Lightning's names: the mesh also answers to ``"data_parallel"`` and ``"tensor_parallel"``
(:data:`LIGHTNING_ALIASES`), the dims of Lightning's ``ModelParallelStrategy`` mesh, so a
``configure_model`` written for it (``self.device_mesh["tensor_parallel"]``) runs unchanged.
Each alias is a flattened copy of its dim (same ranks, its own process group).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_para._dtensor import divisors

MESH_DIM_NAMES = ("pp", "dp_replicate", "edp", "ep", "cp", "tp")
FLATTENED_DIMS = {
    "dp": ("dp_replicate", "edp", "ep"),
    "dp_shard": ("edp", "ep"),
    "dp_shard_cp": ("edp", "ep", "cp"),
    "edp_cp": ("edp", "cp"),
}
# A flattened name whose ranks equal another mesh's when some degree is 1: (name, degree, same as).
_ALIASES = (("dp_shard", "dp_replicate", "dp"), ("dp_shard_cp", "cp", "dp_shard"), ("edp_cp", "cp", "edp"))
# Lightning's ModelParallelStrategy names -> ours (each alias is flattened from its target once the mesh exists).
LIGHTNING_ALIASES = {"data_parallel": "dp", "tensor_parallel": "tp"}


def expert_degree_problem(
    ep: int, dp: Any, dp_replicate: Optional[int] = None, dp_shard: Optional[int] = None
) -> Optional[tuple[str, str]]:
    """``ep`` must divide the sharded part of ``dp``: expert parallelism splits the data-parallel ranks of one
    replica. ``(problem, why and the fix)`` or ``None`` (a rule of :data:`lightning_para.options.RUN_RULES`;
    ``dp="auto"`` is checked once the world size resolves it)."""
    if not isinstance(dp, int) or isinstance(dp, bool):
        return None
    replicas = dp_replicate if dp_replicate is not None else (dp // dp_shard if dp_shard else 1)
    shard = dp // max(1, replicas)
    if shard % ep == 0:
        return None
    if replicas == 1:
        return (f"`ep={ep}` must divide `dp={dp}`",
                f"expert parallelism splits the data-parallel ranks. Choose ep in {divisors(dp)} or a dp that is a"
                f" multiple of {ep}.")
    return (f"`ep={ep}` must divide `dp_shard={shard}`",
            f"expert parallelism splits the data-parallel ranks of one replica (hybrid sharding replicates whole"
            f" replicas over dp_replicate={replicas}). Choose ep in {divisors(shard)} or a dp_shard that is a multiple"
            f" of {ep}.")


def check_expert_degree(ep: int, dp: int, dp_replicate: int = 1) -> None:
    """``ValueError`` naming ``ep`` when it does not divide the sharded part of ``dp`` (:func:`expert_degree_problem`)."""
    problem = expert_degree_problem(ep, dp, dp_replicate)
    if problem:
        raise ValueError(f"{problem[0]}: {problem[1]}")


@dataclass
class ParallelDims:
    """The degrees of each dimension for one world size, and the mesh built from them.

    ``dp`` counts every data-parallel rank; ``dp_replicate`` of them hold replicas of the ZeRO
    state and ``dp_shard = dp / dp_replicate`` shard it (hybrid sharding). ``cp`` ranks split
    each sequence.
    """

    pp: int
    dp: int
    tp: int
    ep: int
    world_size: int
    cp: int = 1
    dp_replicate: int = 1
    mesh: Optional[DeviceMesh] = field(default=None, repr=False, compare=False)
    # Flattened meshes by name, and FSDP2's 2-D hybrid meshes by ("dp_replicate", shard name).
    _flattened: dict[Union[str, tuple[str, str]], DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        product = self.pp * self.dp * self.cp * self.tp
        if product != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"The parallel degrees pp={self.pp} x dp={self.dp}{cp} x tp={self.tp} = {product} do not match"
                f" the world size {self.world_size} (devices x num_nodes). Change the degrees so their product is"
                f" {self.world_size}, or set dp='auto'."
            )
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"`dp_replicate={self.dp_replicate}` must divide `dp={self.dp}` (dp = dp_replicate x dp_shard)."
                f" Choose dp_replicate in {divisors(self.dp)}."
            )
        check_expert_degree(self.ep, self.dp, self.dp_replicate)

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard ZeRO state (all of ``dp`` without hybrid sharding)."""
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks of one replica: how many ranks shard the same experts' ZeRO state."""
        return self.dp_shard // self.ep

    @property
    def zero_shards(self) -> int:
        """Ranks that share (shard) the ZeRO state of a dense parameter: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def expert_zero_shards(self) -> int:
        """Ranks that share the ZeRO state of an expert parameter: ``edp x cp``."""
        return self.edp * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.edp, self.ep, self.cp, self.tp)

    pp_enabled = property(lambda self: self.pp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    ep_enabled = property(lambda self: self.ep > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    replicated = property(lambda self: self.dp_replicate > 1)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the mesh (a collective over the world); call once per process group."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialized default process group.")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"The process group has {dist.get_world_size()} ranks but the degrees were resolved for"
                f" {self.world_size}."
            )
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        degrees = dict(zip(MESH_DIM_NAMES, self.shape))
        aliases = {name: same for name, degree, same in _ALIASES if degrees[degree] == 1}
        # Keep the flattened meshes: torch deprecates re-slicing a flattened dim from the root.
        flattened: dict[Union[str, tuple[str, str]], DeviceMesh] = {}
        for name, dims in FLATTENED_DIMS.items():
            if name in aliases:
                same = aliases[name]
                flattened[name] = flattened[same] if same in flattened else mesh[same]
            else:
                flattened[name] = mesh[dims]._flatten(name)  # private: see docs/architecture.md
        if self.dp_replicate > 1:
            # FSDP2's hybrid-sharding meshes (replicate, shard), built once and kept: the one 2-D
            # slice of a flattened dim from the root, which torch warns it will deprecate.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flattened dim from root mesh.*")
                for shard in ("dp_shard_cp", "edp_cp"):
                    flattened[("dp_replicate", shard)] = mesh["dp_replicate", flattened[shard].mesh_dim_names[0]]
        for alias, target in LIGHTNING_ALIASES.items():
            source = flattened[target] if target in flattened else mesh[target]
            flattened[alias] = source._flatten(alias)  # private: see docs/architecture.md
        self._flattened = flattened
        self.mesh = mesh
        return mesh

    @property
    def valid_mesh_names(self) -> tuple[str, ...]:
        return MESH_DIM_NAMES + tuple(FLATTENED_DIMS) + tuple(LIGHTNING_ALIASES)

    def get_mesh(self, *names: str) -> DeviceMesh:
        """A sub-mesh by name, e.g. ``get_mesh("tp")`` or ``get_mesh("dp", "tp")``."""
        if self.mesh is None:
            raise RuntimeError("The device mesh is built in `ParaStrategy.setup_environment`; it does not exist yet.")
        unknown = [n for n in names if n not in self.valid_mesh_names]
        if unknown or not names:
            raise ValueError(
                f"Unknown mesh dimension(s) {unknown or names}. Valid names: {', '.join(self.valid_mesh_names)}."
            )
        if len(names) == 1 and names[0] in self._flattened:
            return self._flattened[names[0]]
        if names in self._flattened:
            return self._flattened[names]
        # An alias (e.g. "dp_shard_cp" when cp = 1) slices the root under the name it was built with.
        real = tuple(self._flattened[n].mesh_dim_names[0] if n in self._flattened else n for n in names)
        return self.mesh[real[0] if len(real) == 1 else real]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one (possibly flattened) mesh dimension."""
        return self.get_mesh(name).get_group()

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along one (possibly flattened) mesh dimension. Before the mesh exists (e.g. while
        ``layout="auto"`` reads the first batch, whose loader may ask for the sampler's rank), the coordinate the
        mesh will give it: :meth:`coordinate` of the default group's rank."""
        if self.mesh is None and dist.is_initialized():
            return self.coordinate(name, dist.get_rank())
        return self.get_mesh(name).get_local_rank()

    def coordinate(self, name: str, global_rank: int) -> int:
        """``global_rank``'s coordinate along ``name`` in the mesh :meth:`build_mesh` builds (row-major over
        :data:`MESH_DIM_NAMES`, as ``init_device_mesh`` lays ranks out; a flattened dimension is the row-major
        index over its parts), computed from the degrees alone."""
        name = LIGHTNING_ALIASES.get(name, name)
        parts = FLATTENED_DIMS.get(name, (name,))
        if any(part not in MESH_DIM_NAMES for part in parts):
            raise ValueError(f"Unknown mesh dimension {name!r}. Valid names: {', '.join(self.valid_mesh_names)}.")
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"`global_rank={global_rank}` is outside the world of {self.world_size} ranks.")
        coords, rest = {}, global_rank
        for dim, size in reversed(list(zip(MESH_DIM_NAMES, self.shape))):
            coords[dim], rest = rest % size, rest // size
        index = 0
        for part in parts:
            index = index * dict(zip(MESH_DIM_NAMES, self.shape))[part] + coords[part]
        return index

    def zero_mesh(self, expert: bool = False) -> DeviceMesh:
        """The 1-D mesh ZeRO shards a parameter's state over: ``dp_shard x cp`` (dense) or ``edp x cp`` (experts).

        Without hybrid sharding it is also the whole gradient-averaging group (``dp x cp``); with
        ``cp = 1`` and ``dp_replicate = 1`` it is the ``dp`` (``edp``) mesh itself.
        """
        return self.get_mesh("edp_cp" if expert else "dp_shard_cp")

    def replicate_mesh(self) -> Optional[DeviceMesh]:
        """The 1-D mesh over which ZeRO state is replicated (hybrid sharding), or ``None``."""
        return self.get_mesh("dp_replicate") if self.replicated else None

    def fsdp_mesh(self, expert: bool = False) -> DeviceMesh:
        """FSDP2's mesh: the 1-D shard mesh, or 2-D ``(dp_replicate, shard)`` under hybrid sharding (HSDP)."""
        if not self.replicated:
            return self.zero_mesh(expert)
        return self._flattened[("dp_replicate", "edp_cp" if expert else "dp_shard_cp")]
