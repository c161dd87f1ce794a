"""``ParallelDims.coordinate``: a rank's place in the mesh from the degrees alone (before the mesh exists, e.g.
while ``layout="auto"`` reads the first batch through a loader that asks for ``distributed_sampler_kwargs``).
Checked against the layout ``init_device_mesh`` gives (``arange(world).view(shape)``, row-major), and in
``tests/distributed/test_plan_tools.py`` against the real mesh's ``get_local_rank``."""

from __future__ import annotations

import pytest
import torch

from lightning_para.mesh import ParallelDims
from lightning_para.spec.dims import FLATTENED as FLATTENED_DIMS
from lightning_para.spec.dims import MESH_DIMS as MESH_DIM_NAMES


def _expected(dims: ParallelDims, name: str, rank: int) -> int:
    grid = torch.arange(dims.world_size).view(dims.shape)
    parts = FLATTENED_DIMS.get(name, (name,))
    axes = [MESH_DIM_NAMES.index(p) for p in parts]
    others = [i for i in range(len(MESH_DIM_NAMES)) if i not in axes]
    # The ranks that share this rank's other coordinates, in the flattened dimension's order.
    group = grid.permute(*others, *axes).reshape(-1, int(torch.tensor([dims.shape[a] for a in axes]).prod()))
    row = next(r for r in group.tolist() if rank in r)
    return row.index(rank)


@pytest.mark.parametrize("degrees", [
    dict(pp=2, dp=2, tp=2, ep=1, world_size=8),
    dict(pp=1, dp=4, tp=1, ep=2, world_size=8, cp=2),
    dict(pp=2, dp=4, tp=2, ep=2, world_size=16, dp_replicate=2),
    dict(pp=1, dp=2, tp=1, ep=1, world_size=4, cp=2),
])
def test_coordinates_from_degrees_are_the_meshs(degrees):
    dims = ParallelDims(**degrees)
    for rank in range(dims.world_size):
        for name in (*MESH_DIM_NAMES, *FLATTENED_DIMS):
            assert dims.coordinate(name, rank) == _expected(dims, name, rank), (name, rank)
        assert dims.coordinate("data_parallel", rank) == dims.coordinate("dp", rank)
    with pytest.raises(ValueError, match="Unknown mesh dimension 'xp'"):
        dims.coordinate("xp", 0)
    with pytest.raises(ValueError, match="outside the world"):
        dims.coordinate("dp", dims.world_size)
