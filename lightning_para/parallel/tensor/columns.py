"""Column-parallel styles: ``Colwise`` and the fused projections (q|k|v, gate|up).

A fused projection computes several outputs with one ``nn.Linear`` whose output rows are
*blocks*: ``[q | k | v]`` or ``[gate | up]``. A plain ``Shard(0)`` of such a weight gives rank 0 all
of q and part of k. Each rank must hold its slice of *every* block, so that the model's own
``split`` of the local output gives this rank's heads. Two block layouts exist in the wild:

* **contiguous**: ``[b_0 | b_1 | ... ]`` once (nanoGPT's ``c_attn``, Llama-style ``wqkv``, LitGPT's
  ``qkv`` since litgpt 0.5: ``[q (all heads) | k (all groups) | v (all groups)]``). Rank ``r`` holds
  the ``r``-th ``1/tp`` of each block;
* **interleaved**: ``groups`` repetitions of ``[b_0 | b_1 | ...]`` (GPT-NeoX's ``query_key_value``,
  LitGPT's ``attn`` before 0.5: per query group ``[q heads of the group | k | v]``). Rank ``r`` holds
  whole groups ``r * groups/tp ...``: a plain ``Shard(0)``.

:class:`FusedBlocksColwise` takes the block sizes explicitly (grouped-query attention has
``n_head * head_size, n_query_groups * head_size, n_query_groups * head_size``, not three
equal blocks) and the layout; :class:`FusedColwiseParallel` is its equal-blocks, contiguous case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard  # private: see docs/architecture.md

BLOCK_LAYOUTS = ("contiguous", "interleaved")
# The attribute a fused projection gets when its parameters are stored rank-major (see FusedBlocksColwise).
ROWS_ATTRIBUTE = "tensor_parallel_rows"


class Colwise(ColwiseParallel):
    """``ColwiseParallel`` that also gathers a DTensor input sharded along the sequence.

    Torch's style only redistributes inputs that arrive as plain tensors; a sequence-sharded
    DTensor would reach the matmul and be resolved there, once per projection.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            return x if x.placements == desired_input_layouts else x.redistribute(placements=desired_input_layouts)
        # private: see docs/architecture.md
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


class FusedColwiseParallel(Colwise):
    """Column-parallel for a fused projection whose output is ``parts`` equal blocks side by side.

    ``c_attn`` (q|k|v, ``parts=3``) or ``gate_up_proj`` (gate|up, ``parts=2``): a plain
    ``Shard(0)`` would give rank 0 all of q and half of k. The weight is laid out as
    ``_StridedShard(0, split_factor=parts)`` instead: every rank holds its slice of *each*
    block, so ``split(width / tp)`` of the local output gives this rank's q, k and v heads.
    The parameter stays a global-shaped DTensor, so checkpoints remain layout-independent.

    The bias (``parts * width`` numbers) stays replicated over tp and each rank adds its
    slice: a strided 1-D shard could not be sharded again over dp (ZeRO/FSDP split dim 0,
    which no DTensor placement can describe on top of a strided shard).
    """

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        strided = [_StridedShard(0, split_factor=self.parts)]
        for pname, param in module.named_parameters():
            placement = strided if pname == "weight" else [Replicate()]
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _fused_forward(parts: int, module: nn.Linear, x: DTensor) -> torch.Tensor:
        # No communication: a replicated input times a strided weight is a strided output.
        out = torch.nn.functional.linear(x, module.weight).to_local()
        if module.bias is not None:
            out = out + module.bias.redistribute(placements=[_StridedShard(0, split_factor=parts)]).to_local()
        return out

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs  # already this rank's [q_r | k_r | v_r], what the model's own split expects

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwiseParallel applies to nn.Linear, not {type(module).__name__}.")
        module = super()._apply(module, device_mesh)
        # An instance attribute: the module (and every parameter name) stays the same.
        module.forward = partial(self._fused_forward, self.parts, module)
        return module

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(parts={self.parts})"


@dataclass(frozen=True)
class BlockRows:
    """Where each tp rank's rows of a fused projection lie in the global weight.

    ``blocks``: the output sizes of one group, in order (``(q, k, v)``); ``groups``: how many times
    that group repeats (1 for the contiguous layout); ``layout``: ``"contiguous"`` or ``"interleaved"``.
    """

    blocks: tuple[int, ...]
    layout: str = "contiguous"
    groups: int = 1

    @property
    def rows(self) -> int:
        return sum(self.blocks) * self.groups

    def rank_ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """``(global start, length)`` of each row range ``rank`` holds, in its local order."""
        if self.layout == "interleaved":
            per_rank = self.rows // tp
            return [(rank * per_rank, per_rank)]
        ranges, start = [], 0
        for size in self.blocks:
            ranges.append((start + rank * (size // tp), size // tp))
            start += size
        return ranges

    def rank_major_order(self, tp: int) -> torch.Tensor:
        """The global row of each row of the rank-major tensor (rank 0's rows, then rank 1's, ...)."""
        return torch.cat([
            torch.arange(start, start + length) for rank in range(tp) for start, length in self.rank_ranges(rank, tp)
        ])


class FusedBlocksColwise(Colwise):
    """Column-parallel for a fused ``nn.Linear`` whose output is blocks of explicit sizes.

    Args:
        blocks: the sizes of the blocks, in output order: ``(n_head * head_size, n_kv * head_size,
            n_kv * head_size)`` for grouped-query ``[q | k | v]``, ``(ffn, ffn)`` for ``[gate | up]``. With
            ``layout="interleaved"`` the sizes of *one group*.
        layout: ``"contiguous"`` (the default; the blocks once, side by side) or ``"interleaved"``
            (``groups`` repetitions of the blocks). See the module docstring.
        groups: repetitions of the blocks (interleaved layout only; tp must divide it).
        unit: the size every per-rank slice must be a multiple of (the head size: each rank
            computes whole heads). tp must divide every block into whole units.

    Every rank's local output is ``[b_0 slice | b_1 slice | ...]`` (contiguous) or its whole groups
    (interleaved), which the model's own ``split`` with per-rank sizes takes apart. Storage:

    * interleaved: a ``Shard(0)`` DTensor (each rank's rows are contiguous);
    * contiguous, equal blocks: ``_StridedShard(0, len(blocks))`` (:class:`FusedColwiseParallel`);
    * contiguous, unequal blocks (grouped-query attention): no DTensor placement describes "the
      ``r``-th slice of each block" for blocks of different sizes, so the parameter is a ``Shard(0)``
      DTensor of the *rank-major* row order (rank 0's q, k, v slices, then rank 1's). ZeRO, clipping
      and the optimizer see an ordinary sharded parameter; the module gets a ``tensor_parallel_rows``
      attribute (``(BlockRows, tp)``) so that code reading or writing whole tensors (full saves, consolidation,
      loads of one-device checkpoints, LitGPT export) moves rows with :func:`reorder_rows`.
    """

    def __init__(self, blocks: Sequence[int], layout: str = "contiguous", groups: int = 1, unit: int = 1) -> None:
        super().__init__()
        if layout not in BLOCK_LAYOUTS:
            raise ValueError(f"FusedBlocksColwise(layout={layout!r}): use one of {BLOCK_LAYOUTS}.")
        if not blocks or any(int(b) <= 0 for b in blocks):
            raise ValueError(f"FusedBlocksColwise(blocks={tuple(blocks)}): give the positive size of every block.")
        if layout == "contiguous" and groups != 1:
            raise ValueError("FusedBlocksColwise: `groups` applies to layout='interleaved' only.")
        self.rows = BlockRows(tuple(int(b) for b in blocks), layout, int(groups))
        self.unit = int(unit)

    def check(self, name: str, out_features: int, tp: int) -> None:
        """``ValueError`` unless the blocks add up to ``out_features`` and split into whole units over tp."""
        rows = self.rows
        if rows.rows != out_features:
            what = f"{rows.groups} x {list(rows.blocks)}" if rows.layout == "interleaved" else list(rows.blocks)
            raise ValueError(
                f"{name!r} has {out_features} output features, but its FusedBlocksColwise blocks {what} add up to"
                f" {rows.rows}. Give the block sizes of this projection (e.g. (n_head*head_size, n_kv*head_size,"
                " n_kv*head_size) for grouped-query q|k|v)."
            )
        if rows.layout == "interleaved":
            if rows.groups % tp:
                raise ValueError(f"tp={tp} does not divide the {rows.groups} interleaved groups of {name!r}.")
        elif any(b % (tp * self.unit) for b in rows.blocks):
            raise ValueError(
                f"tp={tp} does not split the blocks {list(rows.blocks)} of {name!r} into whole units of {self.unit}"
                f" (heads). Choose a tp that divides every block's head count."
            )

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):  # equal blocks: the strided forward gave this rank's slices already
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    @property
    def equal_blocks(self) -> bool:
        return self.rows.layout == "contiguous" and len(set(self.rows.blocks)) == 1

    def _partition_linear_fn(self, name, module, device_mesh):
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        for pname, param in list(module.named_parameters(recurse=False)):
            if self.rows.layout == "interleaved":
                placed = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            elif self.equal_blocks:
                placements = [_StridedShard(0, split_factor=len(self.rows.blocks))] if pname == "weight" else [Replicate()]
                placed = distribute_tensor(param, device_mesh, placements, src_data_rank=self.src_data_rank)
            else:
                # Every rank holds the whole module before sharding (same seed or loaded weights): take this
                # rank's slice of each block, no communication.
                local = torch.cat([param.detach().narrow(0, s, n) for s, n in self.rows.rank_ranges(rank, tp)])
                placed = DTensor.from_local(local.contiguous(), device_mesh, [Shard(0)], run_check=False)
            module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedBlocksColwise applies to nn.Linear, not {type(module).__name__}.")
        if type(module).__name__ == "Float8Linear":
            raise ValueError(
                "fp8='tensorwise' with tp: a float8 linear planned with FusedBlocksColwise is not supported (torchao's"
                " float8 styles are column-/row-wise only). Keep it in high precision, or plan q/k/v as separate Linears."
            )
        self.check(type(module).__name__, module.out_features, device_mesh.size())
        module = super()._apply(module, device_mesh)
        if self.equal_blocks:
            module.forward = partial(FusedColwiseParallel._fused_forward, len(self.rows.blocks), module)
        elif self.rows.layout == "contiguous" and device_mesh.size() > 1:
            module.tensor_parallel_rows = (self.rows, device_mesh.size())  # ROWS_ATTRIBUTE
        return module

    def __repr__(self) -> str:
        rows = self.rows
        extra = f", groups={rows.groups}" if rows.layout == "interleaved" else ""
        return f"FusedBlocksColwise(blocks={rows.blocks}, layout={rows.layout!r}{extra}, unit={self.unit})"


RowOrder = tuple[tuple[int, ...], int]  # (blocks, tp): a whole tensor's rows in tp's rank-major order


def rank_major_rows(module: nn.Module) -> dict[str, RowOrder]:
    """``{parameter name: (blocks, tp)}`` of every parameter in ``module`` that :class:`FusedBlocksColwise` stores
    rank-major: its whole (``full_tensor()``) value is not in the model's row order until :func:`reorder_rows`."""
    found = {}
    for name, sub in module.named_modules():
        stored = getattr(sub, ROWS_ATTRIBUTE, None)
        for pname, _ in sub.named_parameters(recurse=False) if stored is not None else ():
            found[f"{name}.{pname}" if name else pname] = (stored[0].blocks, stored[1])
    return found


def reorder_rows(value: Any, order: RowOrder, *, to_model: bool, name: str = "tensor") -> Any:
    """The one permutation pair between a whole tensor's rank-major rows (``order``) and the model's own rows:
    ``to_model=True`` undoes the rank-major order (saves, consolidation, export), ``False`` applies it (loads).
    A mapping (a parameter's optimizer state) has each of its tensors moved; scalars stay. ``ValueError`` for a
    tensor whose rows are not the parameter's: it cannot be put in order."""
    if isinstance(value, Mapping):
        return {k: reorder_rows(v, order, to_model=to_model, name=f"{name}[{k!r}]") for k, v in value.items()}
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    blocks, tp = order
    if value.shape[0] != sum(blocks):
        raise ValueError(
            f"{name} of shape {tuple(value.shape)} is stored in tp={tp}'s rank-major row order of blocks {list(blocks)},"
            f" but its rows are not the {sum(blocks)} rows of the parameter: it cannot be put back in the model's order."
        )
    index = BlockRows(tuple(blocks)).rank_major_order(tp).to(value.device)  # row i of the stored tensor is index[i]
    if not to_model:
        return value[index]
    out = torch.empty_like(value)
    out[index] = value
    return out


def reorder_named(state: Mapping[str, Any], orders: Mapping[str, RowOrder], *, to_model: bool) -> dict[str, Any]:
    """``state`` with each entry named in ``orders`` (:func:`rank_major_rows`) moved by :func:`reorder_rows`."""
    return {k: reorder_rows(v, orders[k], to_model=to_model, name=repr(k)) if k in orders else v for k, v in state.items()}


__all__ = [
    "BLOCK_LAYOUTS", "BlockRows", "Colwise", "FusedBlocksColwise", "FusedColwiseParallel", "RowOrder", "rank_major_rows",
    "reorder_named", "reorder_rows",
]
