"""One :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions, built once.

The dimensions, their order and how flattened groups compose are :mod:`lightning_para.spec.dims`' table (the mesh,
outermost first: ``pp, dp_replicate, edp, ep, cp, tp``; flattened ``dp``, ``dp_shard``, ``dp_shard_cp``,
``edp_cp``); :class:`ParallelDims` is that module's record of degrees with the mesh built from it.

Every dimension exists even at size 1, so code asks for ``mesh["tp"]`` without branching. Flattened names whose
ranks coincide with another name (``dp_shard`` when ``dp_replicate = 1``, ``dp_shard_cp`` when ``cp = 1``) are the
*same* mesh object, so one process group serves both and the comm tracer labels it by the plainer name. Sub-meshes
are handed to each ``apply_*`` function explicitly; there is no global state.

Lightning's names: the mesh also answers to ``"data_parallel"`` and ``"tensor_parallel"``
(:data:`LIGHTNING_ALIASES`), the dims of Lightning's ``ModelParallelStrategy`` mesh, so a
``configure_model`` written for it (``self.device_mesh["tensor_parallel"]``) runs unchanged.
Each alias is a flattened copy of its dim (same ranks, its own process group).
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_para.spec.dims import DIM, FLATTENED, MESH_DIMS, Degrees, check_dim
from lightning_para.spec.options import check_rules, data_parallel_factors_problem, expert_degree_problem

# Lightning's ModelParallelStrategy names -> ours (each alias is flattened from its target once the mesh exists).
LIGHTNING_ALIASES = {"data_parallel": "dp", "tensor_parallel": "tp"}


def zero_group(expert: bool = False) -> str:
    """The flattened dimension ZeRO shards a parameter's state over: ``dp_shard x cp`` (dense) or ``edp x cp``."""
    return "edp_cp" if expert else "dp_shard_cp"


@dataclass(kw_only=True)
class ParallelDims(Degrees):
    """The degrees of each dimension for one world size (:class:`~lightning_para.spec.dims.Degrees`), and the mesh
    built from them.

    ``dp`` counts every data-parallel rank; ``dp_replicate`` of them hold replicas of the ZeRO state and
    ``dp_shard = dp / dp_replicate`` shard it (hybrid sharding). ``cp`` ranks split each sequence.
    """

    world_size: InitVar[int]  # checked against the degrees' product (:attr:`Degrees.world_size`)
    mesh: Optional[DeviceMesh] = field(default=None, repr=False, compare=False)
    # Flattened meshes by name, and FSDP2's 2-D hybrid meshes by ("dp_replicate", shard name).
    _flattened: dict[Union[str, tuple[str, str]], DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self, world_size: int) -> None:
        product = self.pp * self.dp * self.cp * self.tp
        if product != world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"The parallel degrees pp={self.pp} x dp={self.dp}{cp} x tp={self.tp} = {product} do not match"
                f" the world size {world_size} (devices x num_nodes). Change the degrees so their product is"
                f" {world_size}, or set dp='auto'."
            )
        check_rules(vars(self), (data_parallel_factors_problem, expert_degree_problem))

    @property
    def zero_shards(self) -> int:
        """Ranks that share (shard) the ZeRO state of a dense parameter: ``dp_shard x cp``."""
        return self.size("dp_shard_cp")

    @property
    def expert_zero_shards(self) -> int:
        """Ranks that share the ZeRO state of an expert parameter: ``edp x cp``."""
        return self.size("edp_cp")

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
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        # Keep the flattened meshes: torch deprecates re-slicing a flattened dim from the root.
        flattened: dict[Union[str, tuple[str, str]], DeviceMesh] = {}
        for name, parts in FLATTENED.items():
            degree, same = DIM[name].same_as or ("", "")
            if degree and getattr(self, degree) == 1:  # the same ranks as `same`: the same mesh and group
                flattened[name] = flattened[same] if same in flattened else mesh[same]
            else:
                flattened[name] = mesh[parts]._flatten(name)  # private: see docs/architecture.md
        if self.dp_replicate > 1:
            # FSDP2's hybrid-sharding meshes (replicate, shard), built once and kept: the one 2-D
            # slice of a flattened dim from the root, which torch warns it will deprecate.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flattened dim from root mesh.*")
                for shard in map(zero_group, (False, True)):
                    flattened[("dp_replicate", shard)] = mesh["dp_replicate", flattened[shard].mesh_dim_names[0]]
        for alias, target in LIGHTNING_ALIASES.items():
            source = flattened[target] if target in flattened else mesh[target]
            flattened[alias] = source._flatten(alias)  # private: see docs/architecture.md
        self._flattened = flattened
        self.mesh = mesh
        return mesh

    @property
    def valid_mesh_names(self) -> tuple[str, ...]:
        return MESH_DIMS + tuple(FLATTENED) + tuple(LIGHTNING_ALIASES)

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
        """``global_rank``'s coordinate along ``name`` (or a Lightning alias) in the mesh :meth:`build_mesh` builds,
        computed from the degrees alone (:meth:`Degrees.coordinate`)."""
        check_dim(LIGHTNING_ALIASES.get(name, name), self.valid_mesh_names)
        return super().coordinate(LIGHTNING_ALIASES.get(name, name), global_rank)

    def zero_mesh(self, expert: bool = False) -> DeviceMesh:
        """The 1-D mesh ZeRO shards a parameter's state over: ``dp_shard x cp`` (dense) or ``edp x cp`` (experts).

        Without hybrid sharding it is also the whole gradient-averaging group (``dp x cp``); with
        ``cp = 1`` and ``dp_replicate = 1`` it is the ``dp`` (``edp``) mesh itself.
        """
        return self.get_mesh(zero_group(expert))

    def replicate_mesh(self) -> Optional[DeviceMesh]:
        """The 1-D mesh over which ZeRO state is replicated (hybrid sharding), or ``None``."""
        return self.get_mesh("dp_replicate") if self.replicated else None

    def fsdp_mesh(self, expert: bool = False) -> DeviceMesh:
        """FSDP2's mesh: the 1-D shard mesh, or 2-D ``(dp_replicate, shard)`` under hybrid sharding (HSDP)."""
        if not self.replicated:
            return self.zero_mesh(expert)
        return self._flattened[("dp_replicate", zero_group(expert))]
