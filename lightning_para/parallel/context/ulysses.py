"""DeepSpeed-Ulysses all-to-all attention (Jacobs et al. 2023, "DeepSpeed Ulysses").

Attention is independent per head, so instead of moving K/V blocks around a ring, Ulysses
re-shards q, k and v from the sequence to the heads with one all-to-all each:
``[b, h, s/c, d] -> [b, h/c, s, d]``, runs ordinary full-sequence attention on its ``h/c``
heads, and sends the output back with a fourth all-to-all, ``[b, h/c, s, d] -> [b, h, s/c, d]``.

Communication per call, ``c`` = cp group size: forward 4 all-to-alls (q, k, v, out), each
moving ``(c - 1)/c`` of the tensor; backward 4 (the reverse all-to-all of each). The head
counts (query and kv) must be divisible by ``c``.

After the all-to-all a rank holds the whole sequence in *rank order* (rank 0's shard first).
Under the load-balanced layout that is not the natural order, so for causal attention the
tokens are permuted into natural order before SDPA and back after it (local copies, no
communication). Non-causal attention is permutation-equivariant and needs no reorder.

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_para.parallel.context._checks import (
    check_global_document_ids, check_key_valid, check_qkv, cp_rank_and_size,
)
from lightning_para.parallel.context.documents import document_attention
from lightning_para.parallel.context.sharding import natural_to_rank_order, rank_order_to_natural

__all__ = ["all_to_all", "ulysses_attention", "validate_ulysses_heads"]


def _all_to_all_forward(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    cp = dist.get_world_size(group)
    # all_to_all_single exchanges equal slices of dim 0: stack the c pieces there (gloo has no list all_to_all).
    send = torch.stack(x.chunk(cp, dim=scatter_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: Optional[dist.ProcessGroup], scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all_forward(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
        return _all_to_all_forward(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(
    x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Differentiable all-to-all: split ``x`` into ``c`` pieces along ``scatter_dim``, send piece ``j``
    to rank ``j``, and concatenate what arrives along ``gather_dim`` in rank order.

    One collective forward, one backward (none for a group of one rank, where it is the
    identity). ``x.shape[scatter_dim]`` must be divisible by ``c``.
    """
    cp = dist.get_world_size(group)
    if cp == 1:
        return x
    if x.shape[scatter_dim] % cp:
        raise ValueError(
            f"all_to_all splits dim {scatter_dim} (size {x.shape[scatter_dim]}) over {cp} ranks; "
            f"it must be divisible by the group size {cp}"
        )
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def validate_ulysses_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Raise ``ValueError`` unless ``cp`` divides both the query and the kv head counts (local to this rank)."""
    for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if heads % cp:
            choices = [c for c in range(1, heads + 1) if heads % c == 0]
            raise ValueError(
                f"cp_method='all_to_all' (Ulysses) shards attention heads over the cp group, but {name}={heads} "
                f"is not divisible by cp={cp}; choose cp in {choices} (with tensor parallel, the heads per tp "
                f"rank must be divisible by cp), or use method='ring'"
            )


def _mask(
    key_valid: Optional[torch.Tensor], document_ids: Optional[torch.Tensor], is_causal: bool, cp: int, rank_order: bool
) -> Optional[torch.Tensor]:
    """SDPA's boolean mask from the padding and the document ids (natural order), for keys in natural or rank order."""
    if key_valid is None and document_ids is None:
        return None
    if rank_order:
        key_valid, document_ids = (natural_to_rank_order(t, cp, dim=1) if t is not None else t for t in (key_valid, document_ids))
    mask = key_valid[:, None, None, :] if key_valid is not None else True
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
    if is_causal:
        seq = mask.shape[-1]
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    return mask


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    load_balance: bool = True,
    key_valid: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Context-parallel attention by re-sharding from sequence to heads (DeepSpeed-Ulysses).

    Args:
        q: local query shard ``[batch, heads, local_seq, head_dim]``; ``heads`` divisible by ``c``.
        k, v: local key/value shards ``[batch, kv_heads, local_seq, head_dim]``; ``kv_heads``
            divisible by ``c`` and dividing ``heads`` (grouped-query attention).
        group: the cp process group (``None``: the default group).
        is_causal: causal mask over global positions.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
        load_balance: whether the shards follow the head-tail layout of ``shard_sequence``.
        key_valid: the whole sequence's key padding ``[batch, seq]`` (bool, natural order; False:
            padding), applied with the causal mask; ``None``: none.
        document_ids: the whole sequence's document ids ``[batch, seq]`` (natural order): a query sees only keys
            of its own document; ``None``: one document.

    Returns:
        This rank's shard of the output, ``[batch, heads, local_seq, head_dim]``.

    Communication: 4 all-to-alls forward (q, k, v, out) and 4 backward; none when ``c = 1``.
    """
    _, cp = cp_rank_and_size(group)
    check_qkv(q, k, v, cp, load_balance)
    validate_ulysses_heads(q.shape[1], k.shape[1], cp)
    key_valid = check_key_valid(key_valid, q, cp)
    document_ids = check_global_document_ids(document_ids, q, cp)
    # [b, h, s/c, d] -> [b, h/c, s, d]: scatter heads, gather sequence (rank order).
    q_h, k_h, v_h = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    reorder = is_causal and load_balance and cp > 1
    if reorder:
        q_h, k_h, v_h = (rank_order_to_natural(t, cp, dim=2) for t in (q_h, k_h, v_h))
    gqa = q_h.shape[1] != k_h.shape[1]
    if document_ids is not None and key_valid is None and is_causal:  # natural order: FlexAttention on CUDA
        out = document_attention(q_h, k_h, v_h, document_ids, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(
            q_h, k_h, v_h, attn_mask=_mask(key_valid, document_ids, is_causal, cp, load_balance and not reorder),
            is_causal=is_causal and key_valid is None and document_ids is None, scale=scale, enable_gqa=gqa,
        )
    if reorder:
        out = natural_to_rank_order(out, cp, dim=2)
    # [b, h/c, s, d] -> [b, h, s/c, d]: scatter sequence (rank order), gather heads.
    return all_to_all(out, group, scatter_dim=2, gather_dim=1)
