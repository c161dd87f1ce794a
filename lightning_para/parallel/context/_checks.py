"""Input checks shared by ring and Ulysses attention (run before any collective, so every rank raises)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from lightning_para.parallel.context.documents import check_document_ids


def cp_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """This process's rank in the cp ``group`` and the group's size (``None``: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "context-parallel attention needs an initialized process group; call "
            "torch.distributed.init_process_group first and pass the cp group as group="
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the cp group passed as group=; pass a group that contains it")
    return rank, dist.get_world_size(group)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, load_balance: bool) -> None:
    """Validate local shards ``[batch, heads, local_seq, head_dim]`` for self-attention under cp."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, heads, local_seq, head_dim] (the layout of "
                f"F.scaled_dot_product_attention), got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"context-parallel attention is self-attention: q and k must hold the same local sequence "
            f"length, got {q.shape[2]} and {k.shape[2]}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        divisors = [h for h in range(1, q.shape[1] + 1) if q.shape[1] % h == 0]
        raise ValueError(
            f"the number of kv heads ({k.shape[1]}) must divide the number of query heads ({q.shape[1]}) "
            f"for grouped-query attention; choose num_kv_heads in {divisors}"
        )
    if load_balance and q.shape[2] % 2:
        raise ValueError(
            f"load-balanced sharding gives each cp rank two equal chunks, but the local sequence length is "
            f"{q.shape[2]} (odd), so 2*cp={2 * cp} does not divide the sequence length {q.shape[2] * cp}; "
            f"pad the sequence to a multiple of {2 * cp} or pass load_balance=False"
        )


def default_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    """SDPA's default softmax scale, ``1 / sqrt(head_dim)`` (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def check_key_valid(key_valid: Optional[torch.Tensor], q: torch.Tensor, cp: int) -> Optional[torch.Tensor]:
    """A key padding mask ``[batch, seq]`` for the whole sequence, as bool on q's device (``None`` stays ``None``)."""
    if key_valid is None:
        return None
    expected = (q.shape[0], q.shape[2] * cp)
    if key_valid.dim() != 2 or tuple(key_valid.shape) != expected:
        raise ValueError(
            f"key_valid must be the whole sequence's key padding [batch, seq] = {list(expected)} (True: a real "
            f"token), got shape {tuple(key_valid.shape)}"
        )
    return key_valid.to(device=q.device, dtype=torch.bool)


def check_global_document_ids(document_ids: Optional[torch.Tensor], q: torch.Tensor, cp: int) -> Optional[torch.Tensor]:
    """The whole sequence's document ids ``[batch, seq]`` on q's device (``None`` stays ``None``)."""
    if document_ids is None:
        return None
    return check_document_ids(document_ids, q.shape[0], q.shape[2] * cp).to(q.device)
