"""Checkpointing tensor-parallel shards that one DTensor box cannot describe.

A fused projection (``[q | k | v]``) is split over tp as ``_StridedShard(0, 3)``: each rank
holds its slice of every block, rows that are not contiguous in the global tensor.

* DCP describes a DTensor shard as one box; :class:`StridedBoxes` lists one box per block
  instead (DCP's ``_Checkpointable`` protocol), so saving, loading and consolidation see the
  true global positions.
* ZeRO-1/2 split the local rows of such a shard again over dp, and no placement describes
  that chunk; :func:`lightning_para.checkpoint.optimizer.gather_rows` gathers the dp rows so the
  optimizer state can be saved as the tp shard.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: see docs/architecture.md
from torch.distributed.tensor.placement_types import _StridedShard  # private: see docs/architecture.md

class StridedBoxes(Tensor):
    """A ``_StridedShard`` DTensor as DCP sees it: one box of the global tensor per block.

    Fused tensor-parallel projections (q|k|v) hold, on each rank, its slice of every block:
    rows that are not contiguous in the global tensor. DCP describes a DTensor shard as one
    box and rejects that ("overlapping chunks"), so this alias of the local tensor lists
    its boxes through DCP's ``_Checkpointable`` protocol (what DTensor itself implements).
    Views share storage: DCP loads in place.
    """

    @staticmethod
    def __new__(cls, dtensor: DTensor) -> "StridedBoxes":
        local = dtensor.to_local().detach()
        self = Tensor._make_subclass(cls, local)
        self._global_size = dtensor.shape
        self._boxes = _strided_boxes(dtensor, local)
        return self

    def size(self, dim: Optional[int] = None) -> Any:  # DCP compares the global size on load
        return self._global_size if dim is None else self._global_size[dim]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:  # private: see docs/architecture.md
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view), size=self._global_size,
                ),
            )
            for offsets, view in self._boxes
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=view.shape) for offsets, view in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for offsets, view in self._boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"No strided block at {index.offset} for {index.fqn}.")


def _strided_boxes(dtensor: DTensor, local: Tensor) -> list[tuple[torch.Size, Tensor]]:
    """(global offsets, local view) of each block of a ``_StridedShard(0, k)`` shard."""
    mesh, placements = dtensor.device_mesh, dtensor.placements
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    on_dim0 = [i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == 0]
    if len(strided) != 1 or on_dim0 != strided or placements[strided[0]].dim != 0:
        raise NotImplementedError(f"Cannot checkpoint a DTensor with placements {placements}.")
    i = strided[0]
    blocks, ranks, coord = placements[i].split_factor, mesh.size(i), mesh.get_local_rank(i)
    rows = dtensor.shape[0] // (blocks * ranks)
    # The other dims: their offsets as if dim 0 were replicated.
    others = [Replicate() if j == i else p for j, p in enumerate(placements)]
    _, offsets = compute_local_shape_and_global_offset(dtensor.shape, mesh, others)
    return [
        (torch.Size([b * (dtensor.shape[0] // blocks) + coord * rows, *offsets[1:]]),
         local.narrow(0, b * rows, rows))
        for b in range(blocks)
    ]


def _split_in_blocks(value: Any) -> bool:
    """A DTensor whose only dim-0 placement is a ``_StridedShard``: its rows are several blocks.

    (ZeRO/FSDP's ``_StridedShard`` over dp *followed* by a tp ``Shard(0)`` is one box; DCP
    handles that itself.)
    """
    if not isinstance(value, DTensor) or value.device_mesh.get_coordinate() is None:
        return False
    on_dim0 = [p for p in value.placements if isinstance(p, (Shard, _StridedShard)) and p.dim == 0]
    return len(on_dim0) == 1 and isinstance(on_dim0[0], _StridedShard)


def for_dcp(value: Any) -> Any:
    """Strided-shard DTensors become :class:`StridedBoxes`; everything else as it is."""
    if _split_in_blocks(value):
        return StridedBoxes(value)
    if isinstance(value, dict):
        return {k: for_dcp(v) for k, v in value.items()}
    if isinstance(value, list):
        return [for_dcp(v) for v in value]
    return value


__all__ = ["StridedBoxes", "for_dcp"]
