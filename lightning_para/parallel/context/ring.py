"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Each of the ``c`` cp ranks keeps its query shard and passes key/value blocks peer-to-peer
around the ring: at step ``i`` rank ``r`` holds the K/V of rank ``(r - i) mod c``. Partial
results are merged with the online softmax (Milakov & Gimelshein 2018): keep each query row's
log-sum-exp ``lse`` and rescale when a new block arrives, so the result equals softmax over the
whole sequence without ever materialising it.

Causal masking uses global positions. A rank's tokens are whole chunks of the sequence
(:mod:`.sharding`); for every (query chunk, key chunk) pair the mask is all-visible, all-masked
(skipped: no compute) or the diagonal ``q_pos >= k_pos``. With the load-balanced layout every
rank therefore computes the same number of pairs.

Communication per call, ``c`` = cp group size, counted in point-to-point receives per rank:

* forward: ``2(c - 1)`` block exchanges, ``c - 1`` for K and ``c - 1`` for V;
* backward: the same ``2(c - 1)`` K/V exchanges (blocks are recomputed from the saved q, k, v
  and ``lse``, FlashAttention-2 style, Dao 2023) plus ``2c`` dK/dV accumulator hops: each
  block's gradient accumulator travels with it and takes one last hop home. Accumulators
  travel in fp32.

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_para.parallel.context._checks import (
    check_global_document_ids, check_key_valid, check_qkv, cp_rank_and_size, default_scale,
)
from lightning_para.parallel.context.sharding import chunk_ids_for_rank
from lightning_para.spec.tiles import score_tile_rows

__all__ = ["ring_attention"]

# Distinct tags keep K, V, dK and dV messages between the same two peers apart (for c = 2 the
# next and previous rank coincide, and a backward step has K/V and dK/dV exchanges in flight).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4

_FULL, _DIAGONAL, _SKIP = "full", "diagonal", "skip"


class _Ring:
    """The cp group's ring: this rank, its neighbours (as group ranks) and the chunk layout."""

    def __init__(self, group: Optional[dist.ProcessGroup], local_len: int, load_balance: bool) -> None:
        self.group = group
        self.rank, self.size = cp_rank_and_size(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.load_balance = load_balance
        self.chunk_len = local_len // (2 if load_balance else 1)

    def chunks(self, cp_rank: int) -> tuple[int, ...]:
        return chunk_ids_for_rank(cp_rank, self.size, self.load_balance)

    def exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], tags: list[int]) -> list[Any]:
        """Send ``sends`` to the next rank and receive ``recvs`` from the previous one, asynchronously."""
        # group_peer: neighbours are ranks *in the cp group*, which differ from global ranks in a sub-mesh.
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next, tag=tag) for t, tag in zip(sends, tags)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev, tag=tag) for t, tag in zip(recvs, tags)
        ]
        if sends and sends[0].is_meta:
            # The dry run (fake process group, meta tensors): batching looks up a backend for the tensors'
            # device, and meta has none; one op at a time reaches the group's (fake) backend directly.
            sent = [dist.isend(t, group=self.group, group_dst=self.next, tag=tag) for t, tag in zip(sends, tags)]
            return sent + [dist.irecv(t, group=self.group, group_src=self.prev, tag=tag) for t, tag in zip(recvs, tags)]
        return dist.batch_isend_irecv(ops)


def _pair_kind(q_chunk: int, k_chunk: int, is_causal: bool) -> str:
    """How the causal mask covers a (query chunk, key chunk) pair of equal-length chunks."""
    if not is_causal or k_chunk < q_chunk:
        return _FULL  # every key precedes every query
    return _DIAGONAL if k_chunk == q_chunk else _SKIP  # later keys are all masked


def _scores(
    q5: torch.Tensor, k: torch.Tensor, scale: float, kind: str, visible: Optional[torch.Tensor] = None, row0: int = 0,
) -> torch.Tensor:
    """Scaled scores ``[b, hkv, g, sq, sk]`` of grouped queries ``q5`` against ``k`` ``[b, hkv, sk, d]``;
    ``visible`` ``[b, sq | 1, sk]`` (False: a padding key, or one of another document) masks keys as well.
    ``row0``: the first query row's index in its chunk (a tile of rows; the diagonal's mask depends on it)."""
    # In place on the fresh matmul output: one score block alive, not three (an fp32 [b, h, c, c] block is
    # 1 GiB per 16 heads at 4K-token chunks: Llama 3 405B's 131K under cp=16; the dry run measured it).
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if kind == _DIAGONAL:  # same chunk: query i sees keys j <= i (global positions differ by a constant)
        rows, n = s.shape[-2], s.shape[-1]
        query = torch.arange(row0, row0 + rows, device=s.device)
        hidden = torch.arange(n, device=s.device)[None, :] > query[:, None]
        s.masked_fill_(hidden, float("-inf"))
    if visible is not None:
        s.masked_fill_(~visible[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key at all (``-inf``) set to 0, so ``exp(s - lse)`` is 0 there, not NaN.

    Such rows (queries before the first real token of a left-padded sequence) output 0, as
    ``F.scaled_dot_product_attention`` does for a fully masked row."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _visible(
    key_valid: Optional[torch.Tensor], document_ids: Optional[torch.Tensor], ring: "_Ring", q_chunk: int, k_chunk: int,
    row0: int, rows: int,
) -> Optional[torch.Tensor]:
    """Which keys of natural chunk ``k_chunk`` the query rows ``row0 : row0 + rows`` of chunk ``q_chunk`` may see
    besides the causal mask: ``[b, rows | 1, c]`` bool from the whole sequence's padding and document ids (natural
    order, global positions), or ``None`` for all."""
    c = ring.chunk_len
    keys = slice(k_chunk * c, (k_chunk + 1) * c)
    visible = None if key_valid is None else key_valid[:, None, keys]
    if document_ids is not None:
        queries = document_ids[:, q_chunk * c + row0 : q_chunk * c + min(row0 + rows, c)]
        same = queries[:, :, None] == document_ids[:, None, keys]
        visible = same if visible is None else visible & same
    return visible


def _merge(
    acc: Optional[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two normalised partial results (Milakov & Gimelshein 2018).

    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
    """
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    safe = _finite(new_lse)  # both -inf (no key seen yet): weights exp(-inf) = 0, not NaN
    merged = acc_out * torch.exp(acc_lse - safe).unsqueeze(-1) + out * torch.exp(lse - safe).unsqueeze(-1)
    return merged, new_lse


def _split(x: torch.Tensor, ring: _Ring, dim: int) -> list[torch.Tensor]:
    return list(x.split(ring.chunk_len, dim=dim))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Optional[dist.ProcessGroup],
        is_causal: bool,
        scale: float,
        load_balance: bool,
        key_valid: Optional[torch.Tensor],
        document_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        ring = _Ring(group, n, load_balance)
        rows = score_tile_rows(b, hq, ring.chunk_len)
        # Grouped-query attention without copying K/V: query head i uses kv head i // g, the
        # repeat_interleave convention of SDPA's enable_gqa.
        q5 = q.float().reshape(b, hkv, hq // hkv, n, d)
        q_chunks = _split(q5, ring, dim=3)
        acc: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * len(q_chunks)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(ring.size):
            pending = []
            if step + 1 < ring.size:  # start the next hop before computing on this block
                k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
                pending = ring.exchange([k_cur, v_cur], [k_next, v_next], [_TAG_K, _TAG_V])
            source = (ring.rank - step) % ring.size
            k_chunks, v_chunks = _split(k_cur.float(), ring, 2), _split(v_cur.float(), ring, 2)
            for qi, q_chunk in enumerate(ring.chunks(ring.rank)):
                for ki, k_chunk in enumerate(ring.chunks(source)):
                    kind = _pair_kind(q_chunk, k_chunk, is_causal)
                    if kind == _SKIP:
                        continue
                    outs, lses = [], []
                    for r0 in range(0, ring.chunk_len, rows):
                        visible = _visible(key_valid, document_ids, ring, q_chunk, k_chunk, r0, rows)
                        s = _scores(q_chunks[qi][..., r0:r0 + rows, :], k_chunks[ki], scale, kind, visible, row0=r0)
                        lse_tile = torch.logsumexp(s, dim=-1)
                        p = s.sub_(_finite(lse_tile).unsqueeze(-1)).exp_()  # the scores' tile becomes P, in place
                        del s
                        outs.append(torch.matmul(p, v_chunks[ki].unsqueeze(2)))
                        lses.append(lse_tile)
                        del p
                    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 3), torch.cat(lses, 3))
                    acc[qi] = _merge(acc[qi], out, lse)
            for work in pending:
                work.wait()
            if pending:
                k_cur, v_cur = k_next, v_next
        # Every query chunk met its own diagonal at step 0, so no accumulator is empty.
        out5 = torch.cat([a[0] for a in acc], dim=3)  # type: ignore[index]
        lse = torch.cat([a[1] for a in acc], dim=3)  # type: ignore[index]
        out = out5.reshape(b, hq, n, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.is_causal, ctx.scale, ctx.key_valid, ctx.document_ids = ring, is_causal, scale, key_valid, document_ids
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        scale: float = ctx.scale
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        rows = score_tile_rows(b, hq, ring.chunk_len)
        shape5 = (b, hkv, hq // hkv, n, d)
        q5 = q.float().reshape(shape5)
        dout5 = grad_out.float().reshape(shape5)
        # FlashAttention-2's D = rowsum(dO * O): the softmax Jacobian term (Dao 2023, Alg. 2).
        delta = (dout5 * out.float().reshape(shape5)).sum(-1)
        q_chunks, dout_chunks = _split(q5, ring, 3), _split(dout5, ring, 3)
        lse_chunks, delta_chunks = _split(_finite(lse), ring, 3), _split(delta, ring, 3)
        dq_chunks = [torch.zeros_like(c) for c in q_chunks]

        k_cur, v_cur = k.contiguous(), v.contiguous()
        grad_pending: list[Any] = []
        dk_in = dv_in = None
        for step in range(ring.size):
            kv_pending = []
            if step + 1 < ring.size:
                k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
                kv_pending = ring.exchange([k_cur, v_cur], [k_next, v_next], [_TAG_K, _TAG_V])
            source = (ring.rank - step) % ring.size
            k_chunks, v_chunks = _split(k_cur.float(), ring, 2), _split(v_cur.float(), ring, 2)
            dk_block = torch.zeros(b, hkv, n, d, dtype=torch.float32, device=q.device)
            dv_block = torch.zeros_like(dk_block)
            dk_chunks, dv_chunks = _split(dk_block, ring, 2), _split(dv_block, ring, 2)
            for qi, q_chunk in enumerate(ring.chunks(ring.rank)):
                for ki, k_chunk in enumerate(ring.chunks(source)):
                    kind = _pair_kind(q_chunk, k_chunk, ctx.is_causal)
                    if kind == _SKIP:
                        continue
                    # Recompute P from the saved global lse; masked entries give exp(-inf) = 0.
                    for r0 in range(0, ring.chunk_len, rows):
                        # In place, two [b, h, rows, c] fp32 tiles at most (P and dP; dS overwrites dP).
                        tile = slice(r0, r0 + rows)
                        q_tile, dout_tile = q_chunks[qi][..., tile, :], dout_chunks[qi][..., tile, :]
                        visible = _visible(ctx.key_valid, ctx.document_ids, ring, q_chunk, k_chunk, r0, rows)
                        s = _scores(q_tile, k_chunks[ki], scale, kind, visible, row0=r0)
                        p = s.sub_(lse_chunks[qi][..., tile].unsqueeze(-1)).exp_()
                        del s
                        dv_chunks[ki].add_(torch.matmul(p.transpose(-1, -2), dout_tile).sum(2))
                        dp = torch.matmul(dout_tile, v_chunks[ki].unsqueeze(2).transpose(-1, -2))
                        ds = dp.sub_(delta_chunks[qi][..., tile].unsqueeze(-1)).mul_(p)
                        del p, dp
                        dq_chunks[qi][..., tile, :].add_(torch.matmul(ds, k_chunks[ki].unsqueeze(2)), alpha=scale)
                        dk_chunks[ki].add_(torch.matmul(ds.transpose(-1, -2), q_tile).sum(2), alpha=scale)
                        del ds
            # The accumulator of block `source` arrived from the previous rank (which held the
            # block one step earlier); add this rank's share and pass it on. After step c - 1
            # the hop lands on the block's owner.
            for work in grad_pending:
                work.wait()
            if dk_in is not None:
                dk_block.add_(dk_in)
                dv_block.add_(dv_in)
            if ring.size == 1:  # no ring: the block's gradient is already home
                dk_in, dv_in = dk_block, dv_block
                break
            dk_in, dv_in = torch.empty_like(dk_block), torch.empty_like(dv_block)
            grad_pending = ring.exchange([dk_block, dv_block], [dk_in, dv_in], [_TAG_DK, _TAG_DV])
            for work in kv_pending:
                work.wait()
            if kv_pending:
                k_cur, v_cur = k_next, v_next
        for work in grad_pending:
            work.wait()
        dq = torch.cat(dq_chunks, dim=3).reshape(q.shape).to(q.dtype)
        return dq, dk_in.to(k.dtype), dv_in.to(v.dtype), None, None, None, None, None, None  # type: ignore[union-attr]


def ring_attention(
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
    """Context-parallel attention by passing K/V blocks around the cp ring.

    Args:
        q: local query shard ``[batch, heads, local_seq, head_dim]`` (SDPA's layout).
        k, v: local key/value shards ``[batch, kv_heads, local_seq, head_dim]``; ``kv_heads``
            must divide ``heads`` (grouped-query attention, SDPA's ``enable_gqa`` convention).
        group: the cp process group (``None``: the default group).
        is_causal: causal mask over *global* positions.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)`` as in SDPA.
        load_balance: whether the shards follow the head-tail layout of
            :func:`~lightning_para.parallel.context.sharding.shard_sequence` (``True``) or are
            contiguous slices (``False``). It must match how the inputs were sharded.
        key_valid: the whole sequence's key padding ``[batch, seq]`` (bool, natural order; False:
            padding), the same on every cp rank, applied on top of the causal mask (a padding
            key is seen by no query; a query that sees no key outputs 0, as SDPA's). ``None``: none.
        document_ids: the whole sequence's document ids ``[batch, seq]`` (natural order), the same on every cp
            rank: a query sees only keys of its own document (each K/V block is masked by the ids of its global
            positions; a block a query row sees nothing of adds nothing). ``None``: one document.

    Returns:
        This rank's shard of the attention output, ``[batch, heads, local_seq, head_dim]``,
        equal to the matching rows of full-sequence SDPA.

    Communication: ``2(c - 1)`` point-to-point K/V receives forward (``c - 1`` K, ``c - 1`` V);
    backward ``2(c - 1)`` K/V plus ``2c`` dK/dV receives; none when ``c = 1``. Computation is in
    fp32 whatever the input dtype; the output has the input dtype.
    """
    _, cp = cp_rank_and_size(group)
    check_qkv(q, k, v, cp, load_balance)
    key_valid = check_key_valid(key_valid, q, cp)
    document_ids = check_global_document_ids(document_ids, q, cp)
    return _RingAttention.apply(
        q, k, v, group, bool(is_causal), default_scale(q, scale), bool(load_balance), key_valid, document_ids
    )
