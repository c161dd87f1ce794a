"""Module tensors that the weights files store in pieces: ``[E, ...]`` stacks of per-index tensors.

Mixture-of-experts libraries keep their experts stacked (``gate_up_proj[E, 2I, H]``) while checkpoints keep
one tensor per expert (``experts.{e}.w1`` and ``experts.{e}.w3``, ``[I, H]`` each). :class:`Stacked`
describes such a tensor; :func:`load_stacked` reads only the box of the stack this rank holds (its experts
under ``ep``, its rows under ZeRO-3) from the pieces, with safetensors' ``get_slice``, so a rank never holds
more than its shard plus one piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: see docs/architecture.md
from torch.distributed.tensor.placement_types import _StridedShard  # private: see docs/architecture.md


@dataclass(frozen=True)
class Stacked:
    """A tensor ``[count, rows, ...]`` whose index ``e`` is the concatenation over rows of the files' tensors
    ``part.format(e)`` for each of ``parts`` (``"...experts.{}.w1.weight"``)."""

    count: int
    parts: tuple[str, ...]

    def names(self) -> list[str]:
        return [p.format(e) for e in range(self.count) for p in self.parts]

    def global_shape(self, stored: Mapping[str, Any]) -> tuple[int, ...]:
        """The shape the pieces make (``stored``: name -> object with ``.shape``)."""
        first = [tuple(stored[p.format(0)].shape) for p in self.parts]
        return (self.count, sum(s[0] for s in first), *first[0][1:])


def _local_box(target: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, global offset)`` of this rank's part of ``target`` (whole for a plain tensor)."""
    if not isinstance(target, DTensor):
        return tuple(target.shape), (0,) * target.dim()
    # A strided shard alone on its dim holds several blocks of rows (a fused q|k|v over tp), not one box;
    # ZeRO-3's strided shard over dp followed by ep's / tp's Shard on the same dim is one box (as DCP sees it).
    dims = [p.dim for p in target.placements if isinstance(p, (Shard, _StridedShard))]
    if any(isinstance(p, _StridedShard) and dims.count(p.dim) == 1 for p in target.placements):
        raise ValueError(
            f"A stacked weight placed as {target.placements} holds several blocks of rows, which per-index pieces"
            " cannot be read into yet. Use another layout for its experts, or convert the files to the model's names."
        )
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(shape), tuple(offset)


def load_stacked(target: Tensor, stacked: Stacked, folder: Path, files: Mapping[str, str]) -> None:
    """Read this rank's box of ``target`` from its pieces (``files``: piece name -> file name) in place."""
    from safetensors import safe_open  # optional: comes with transformers

    local = target.to_local() if isinstance(target, DTensor) else target
    shape, offset = _local_box(target)
    if local.numel() == 0:
        return
    rows = [0]
    opened: dict[str, Any] = {}
    try:
        def piece(name: str) -> Any:
            file = files[name]
            if file not in opened:
                opened[file] = safe_open(str(folder / file), framework="pt").__enter__()
            return opened[file].get_slice(name)

        for part in stacked.parts:
            rows.append(rows[-1] + piece(part.format(0)).get_shape()[0])
        row_lo, row_hi = offset[1], offset[1] + shape[1]
        rest = tuple(slice(o, o + s) for o, s in zip(offset[2:], shape[2:]))
        with torch.no_grad():
            for i in range(shape[0]):
                index = offset[0] + i
                pieces = []
                for part, start, end in zip(stacked.parts, rows[:-1], rows[1:]):
                    lo, hi = max(row_lo, start), min(row_hi, end)
                    if lo < hi:
                        pieces.append(piece(part.format(index))[(slice(lo - start, hi - start), *rest)])
                local[i].copy_(torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0])
    finally:
        for handle in opened.values():
            handle.__exit__(None, None, None)


__all__ = ["Stacked", "load_stacked"]
