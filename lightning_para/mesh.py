"""One :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions, built once.

Layout (outermost to innermost)::

    ("pp", "edp", "ep", "tp")        flattened: "dp" = ("edp", "ep")

* ``tp`` is innermost, so tensor-parallel groups are consecutive ranks: on GPUs that is
  one node and its NVLink (Megatron's rule: TP within a node).
* ``pp`` is outermost, so pipeline neighbours sit in different nodes and only their
  point-to-point activations cross the slow links (PP across nodes).
* ``dp`` fills the rest. Expert parallelism borrows the inner ``ep`` ranks of ``dp``: experts
  are sharded over ``ep`` and replicated over ``edp`` ("expert data parallel"), while dense
  parameters are replicated over the whole flattened ``dp``.

Every dimension exists even at size 1, so code asks for ``mesh["tp"]`` without branching.
Sub-meshes are handed to each ``apply_*`` function explicitly; there is no global state.

Lightning's names: the mesh also answers to ``"data_parallel"`` and ``"tensor_parallel"``
(:data:`LIGHTNING_ALIASES`), the dims of Lightning's ``ModelParallelStrategy`` mesh, so a
``configure_model`` written for it (``self.device_mesh["tensor_parallel"]``) runs unchanged.
Each alias is a flattened copy of its dim (same ranks, its own process group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_para._dtensor import divisors

MESH_DIM_NAMES = ("pp", "edp", "ep", "tp")
FLATTENED_DIMS = {"dp": ("edp", "ep")}
# Lightning's ModelParallelStrategy names -> ours (each alias is flattened from its target once the mesh exists).
LIGHTNING_ALIASES = {"data_parallel": "dp", "tensor_parallel": "tp"}


def check_expert_degree(ep: int, dp: int) -> None:
    """``ep`` must divide ``dp``: expert parallelism splits the data-parallel ranks (raises ``ValueError``)."""
    if dp % ep:
        raise ValueError(
            f"`ep={ep}` must divide `dp={dp}`: expert parallelism splits the data-parallel ranks."
            f" Choose ep in {divisors(dp)} or a dp that is a multiple of {ep}."
        )


@dataclass
class ParallelDims:
    """The degrees of each dimension for one world size, and the mesh built from them."""

    pp: int
    dp: int
    tp: int
    ep: int
    world_size: int
    mesh: Optional[DeviceMesh] = field(default=None, repr=False, compare=False)
    _flattened: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        product = self.pp * self.dp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"The parallel degrees pp={self.pp} x dp={self.dp} x tp={self.tp} = {product} do not match"
                f" the world size {self.world_size} (devices x num_nodes). Change the degrees so their product is"
                f" {self.world_size}, or set dp='auto'."
            )
        check_expert_degree(self.ep, self.dp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: how many ranks hold the same experts."""
        return self.dp // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.edp, self.ep, self.tp)

    pp_enabled = property(lambda self: self.pp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    ep_enabled = property(lambda self: self.ep > 1)

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
        # Keep the flattened meshes: torch deprecates re-slicing a flattened dim from the root.
        self._flattened = {name: mesh[dims]._flatten(name) for name, dims in FLATTENED_DIMS.items()}
        for alias, target in LIGHTNING_ALIASES.items():
            source = self._flattened.get(target) or mesh[target]
            self._flattened[alias] = source._flatten(alias)
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
        return self.mesh[names[0] if len(names) == 1 else names]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one (possibly flattened) mesh dimension."""
        return self.get_mesh(name).get_group()

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along one (possibly flattened) mesh dimension."""
        return self.get_mesh(name).get_local_rank()
