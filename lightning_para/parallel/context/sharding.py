"""Sequence sharding for context parallelism, with the load-balanced (head-tail) causal layout.

Under causal attention, token ``i`` attends to the ``i + 1`` tokens before it, so cutting the
sequence into ``cp`` contiguous slices gives the last rank ~``2cp - 1`` times the work of the
first. The load-balanced layout (the "zig-zag" / head-tail split of Megatron-Core and
torchtitan; Liu et al. 2023 motivate it for Ring Attention) cuts the sequence into ``2 * cp``
equal chunks and gives cp rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: one early and one late
chunk, so every rank holds the same number of (query, key) pairs under the causal mask.

Vocabulary used across ``lightning_para.parallel.context``:

* *natural order*: the sequence as the data loader produced it (global positions 0..S-1);
* *rank order*: the concatenation of every rank's local shard, rank 0 first; this is what an
  all-gather of the shards, or Ulysses' all-to-all, yields. :func:`rank_order_positions`
  maps between the two.

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ContextParallelShard",
    "chunk_ids_for_rank",
    "natural_to_rank_order",
    "position_ids_for_rank",
    "rank_order_positions",
    "rank_order_to_natural",
    "shard_sequence",
    "unshard_sequence",
    "valid_cp_sizes",
    "validate_cp_sequence_length",
]


def valid_cp_sizes(seq_len: int, *, load_balance: bool = True) -> list[int]:
    """Every ``cp`` that can shard a sequence of ``seq_len`` tokens (``2 * cp`` chunks if load-balanced)."""
    chunks_per_rank = 2 if load_balance else 1
    return [cp for cp in range(1, seq_len + 1) if seq_len % (chunks_per_rank * cp) == 0]


def validate_cp_sequence_length(seq_len: int, cp: int, *, load_balance: bool = True) -> None:
    """Raise ``ValueError`` naming ``cp`` and the valid choices unless ``cp`` can shard ``seq_len``.

    Load-balanced sharding needs ``2 * cp`` to divide the sequence length (two equal chunks per
    rank); plain sharding needs ``cp`` to divide it.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer (the context-parallel degree), got cp={cp!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"the sequence length must be a positive integer, got {seq_len!r}")
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks == 0:
        return
    choices = valid_cp_sizes(seq_len, load_balance=load_balance)
    if load_balance:
        raise ValueError(
            f"cp={cp} cannot shard a sequence of {seq_len} tokens with load-balanced causal sharding, which "
            f"splits it into 2*cp={chunks} equal chunks; choose cp in {choices}, pad the sequence length to a "
            f"multiple of {chunks}, or pass load_balance=False"
        )
    raise ValueError(
        f"cp={cp} does not divide the sequence length {seq_len}; choose cp in {choices} "
        f"or pad the sequence length to a multiple of {cp}"
    )


def _check_rank(cp_rank: int, cp: int) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer (the context-parallel degree), got cp={cp!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank!r} is out of range for cp={cp}; choose cp_rank in 0..{cp - 1}")


def chunk_ids_for_rank(cp_rank: int, cp: int, load_balance: bool = True) -> tuple[int, ...]:
    """The sequence chunks cp rank ``cp_rank`` holds, in local order.

    Load-balanced: ``(r, 2cp - 1 - r)`` out of ``2cp`` chunks; otherwise ``(r,)`` out of ``cp``.
    """
    _check_rank(cp_rank, cp)
    return (cp_rank, 2 * cp - 1 - cp_rank) if load_balance else (cp_rank,)


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """This cp rank's shard of ``x`` along the sequence dimension ``dim``.

    Load-balanced: chunks ``r`` and ``2cp - 1 - r`` of ``2cp`` (a new tensor); otherwise the
    ``r``-th of ``cp`` contiguous slices (a view). Differentiable. ``dim=1`` suits ``[batch, seq, ...]``
    batches; attention's ``[batch, heads, seq, head_dim]`` layout uses ``dim=2``.
    """
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor with {x.dim()} dimensions")
    dim = dim % x.dim()
    chunk_ids = chunk_ids_for_rank(cp_rank, cp, load_balance)
    validate_cp_sequence_length(x.shape[dim], cp, load_balance=load_balance)
    chunk = x.shape[dim] // (len(chunk_ids) * cp)
    parts = [x.narrow(dim, c * chunk, chunk) for c in chunk_ids]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def position_ids_for_rank(
    seq_len: int,
    cp_rank: int,
    cp: int,
    load_balance: bool = True,
    *,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Global positions (int64, shape ``[seq_len // cp]``) of the tokens cp rank ``cp_rank`` holds.

    Feed these to RoPE or a learned position embedding: a local shard's ``arange(local_len)``
    would be wrong on every rank but the first.
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp, dim=0, load_balance=load_balance)


def rank_order_positions(
    seq_len: int, cp: int, load_balance: bool = True, *, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Global position of each token in rank order (rank 0's shard, then rank 1's, ...)."""
    return torch.cat([position_ids_for_rank(seq_len, r, cp, load_balance, device=device) for r in range(cp)])


def natural_to_rank_order(x: torch.Tensor, cp: int, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """Permute a full sequence from natural order into rank order (differentiable)."""
    if not load_balance or cp == 1:
        return x  # without load balancing the two orders coincide
    return x.index_select(dim, rank_order_positions(x.shape[dim], cp, True, device=x.device))


def rank_order_to_natural(x: torch.Tensor, cp: int, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """Permute a full sequence from rank order back into natural order (differentiable)."""
    if not load_balance or cp == 1:
        return x
    positions = rank_order_positions(x.shape[dim], cp, True, device=x.device)
    # positions[i] is where token i belongs; argsort gives, for each natural position, its source index.
    return x.index_select(dim, torch.argsort(positions))


def unshard_sequence(
    local: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    dim: int = 1,
    load_balance: bool = True,
) -> torch.Tensor:
    """All-gather every cp rank's shard over ``group`` and return the full sequence in natural order.

    One all-gather. Not differentiable (for outputs, metrics and tests); ``group=None`` is the
    default process group, whose size is ``cp``.
    """
    cp = dist.get_world_size(group)
    dim = dim % local.dim()
    local = local.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(pieces, local, group=group)
    return rank_order_to_natural(torch.cat(pieces, dim), cp, dim, load_balance)


@dataclass(frozen=True)
class ContextParallelShard:
    """This rank's place in its cp group: what a batch hook or a position-aware module needs.

    Attributes:
        cp_rank: this rank's index in the cp group.
        cp: the cp degree.
        load_balance: the head-tail layout (chunks ``r`` and ``2cp-1-r`` of ``2cp``); otherwise
            the ``r``-th of ``cp`` contiguous slices.
    """

    cp_rank: int
    cp: int
    load_balance: bool = True

    def split(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's chunks of ``tensor`` along ``dim`` (``ValueError`` naming ``cp`` if they do not divide it)."""
        self.check_length(tensor.shape[dim])
        return shard_sequence(tensor, self.cp_rank, self.cp, dim=dim, load_balance=self.load_balance)

    def check_length(self, seq_len: int) -> None:
        """Raise ``ValueError`` naming ``cp`` and the valid choices unless ``seq_len`` can be split."""
        chunks = 2 * self.cp if self.load_balance else self.cp
        if seq_len % chunks == 0:
            return
        choices = sorted({1, *valid_cp_sizes(seq_len, load_balance=self.load_balance)})  # cp=1 splits nothing
        how = f"2*cp={chunks} equal chunks (load-balanced, for causal attention)" if self.load_balance else f"{chunks} equal chunks"
        hint = ", or set cp_load_balance=False (then cp alone must divide it)" if self.load_balance else ""
        raise ValueError(
            f"ParaStrategy(cp={self.cp}) splits every sequence (dim 1 of the batch tensors) into {how}, but a"
            f" sequence has {seq_len} tokens. Choose cp in {choices}, pad sequences to a multiple of {chunks}{hint}."
        )

    def split_batch(self, batch: Any) -> Any:
        """The default split: every tensor with at least two dims, along dim 1 (nested lists, tuples, dicts)."""
        if isinstance(batch, Tensor):
            return self.split(batch, 1) if batch.dim() >= 2 else batch
        if isinstance(batch, Mapping):
            return type(batch)({k: self.split_batch(v) for k, v in batch.items()})  # type: ignore[call-arg]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(self.split_batch(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.split_batch(v) for v in batch)
        return batch

    def position_ids(
        self, seq_len: int, *, batch_size: Optional[int] = None, device: Optional[torch.device] = None
    ) -> Tensor:
        """Global positions of this rank's tokens of a ``seq_len``-token sequence: ``[seq_len / cp]``,
        or ``[batch_size, seq_len / cp]`` (what HF models take as ``position_ids``)."""
        self.check_length(seq_len)
        positions = position_ids_for_rank(seq_len, self.cp_rank, self.cp, self.load_balance, device=device)
        return positions if batch_size is None else positions.expand(batch_size, -1)

    def local_positions(self, local_len: int, device: Optional[torch.device] = None) -> Tensor:
        """Global positions of a local shard of ``local_len`` tokens (for RoPE / position embeddings)."""
        return self.position_ids(local_len * self.cp, device=device)
