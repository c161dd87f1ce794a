"""Whole matrices from their shards: each matrix's pieces travel to one owner rank, which transforms the
whole matrix and sends every rank its piece of the result back.

A matrix the optimizer steps may be a piece of a global one: a DTensor shard (ZeRO-3, HSDP, tensor
parallelism) or a ZeRO-1/2 row shard described as one. Only the mesh dimensions that shard it take part: for
each of them in turn, one ``all_to_all`` moves every matrix's pieces to its owner's coordinate on that
dimension, so after the last one each owner holds all the pieces of its matrices (replicas along the other
dimensions do the same work). The way back reverses the hops. Which global element each arriving value is
comes from routing the element indices once (``distribute_tensor`` of an ``arange`` with the matrix's own
placements, so strided shards are placed by torch's own rule) and is kept only where it is not the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_para._dtensor import is_sharded_placement


def sharded_mesh_dims(view: Tensor) -> tuple[int, ...]:
    """The mesh dimensions that split ``view`` (a DTensor) into different pieces; none for a plain tensor."""
    if not isinstance(view, DTensor):
        return ()
    return tuple(d for d, p in enumerate(view.placements) if is_sharded_placement(p))


def _owners(numels: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Each matrix's owner coordinates: largest first to the least-loaded rank (the same on every rank)."""
    ranks = 1
    for s in sizes:
        ranks *= s
    load = [0] * ranks
    flat = [0] * len(numels)
    for m in sorted(range(len(numels)), key=lambda m: -numels[m]):
        flat[m] = min(range(ranks), key=load.__getitem__)
        load[flat[m]] += numels[m]
    coords = []
    for f in flat:
        c = []
        for s in reversed(sizes):
            c.append(f % s)
            f //= s
        coords.append(tuple(reversed(c)))
    return coords


@dataclass
class _Hop:
    """One mesh dimension's exchange: who owns what along it, and the piece sizes it moves."""

    group: dist.ProcessGroup
    world: int
    me: int
    owner: list[int]  # per matrix, the owner's coordinate on this dimension
    sent: list[int] = field(default_factory=list)  # per matrix, the elements this rank sends
    received: Optional[Tensor] = None  # [source rank, owned matrix] elements received (CPU int64)

    @property
    def mine(self) -> list[int]:
        return [m for m, o in enumerate(self.owner) if o == self.me]

    def forward(self, held: list[Tensor]) -> list[Tensor]:
        """Every matrix's pieces to its owner along this dimension (concatenated in source-rank order)."""
        mine = self.mine
        if self.received is None:  # first use: learn the piece sizes once
            self.sent = [t.numel() for t in held]
            counts = [sum(1 for o in self.owner if o == j) for j in range(self.world)]
            device = held[0].device  # the group's backend may need device tensors (NCCL)
            sizes = torch.tensor([self.sent[m] for j in range(self.world) for m, o in enumerate(self.owner) if o == j],
                                 dtype=torch.int64, device=device)
            out = torch.empty(self.world * len(mine), dtype=torch.int64, device=device)
            _all_to_all(out, sizes, [len(mine)] * self.world, counts, self.group)
            self.received = out.view(self.world, len(mine)).cpu()  # once, at the first step
        order = sorted(range(len(held)), key=lambda m: self.owner[m])
        send = torch.cat([held[m].reshape(-1) for m in order])
        in_splits = [sum(self.sent[m] for m in order if self.owner[m] == j) for j in range(self.world)]
        out = send.new_empty(int(self.received.sum()))
        _all_to_all(out, send, self.received.sum(1).tolist(), in_splits, self.group)
        pieces = out.split(self.received.reshape(-1).tolist())
        result = [held[0].new_empty(0)] * len(held)
        for k, m in enumerate(mine):
            result[m] = torch.cat([pieces[i * len(mine) + k] for i in range(self.world)])
        return result

    def backward(self, held: list[Tensor]) -> list[Tensor]:
        """The reverse of :meth:`forward`: each source rank gets back the part it sent."""
        mine, received = self.mine, self.received
        parts = [held[m].split(received[:, k].tolist()) for k, m in enumerate(mine)]
        send = torch.cat([parts[k][i] for i in range(self.world) for k in range(len(mine))] + [held[0][:0]])
        order = sorted(range(len(held)), key=lambda m: self.owner[m])
        out_splits = [sum(self.sent[m] for m in order if self.owner[m] == j) for j in range(self.world)]
        out = send.new_empty(sum(out_splits))
        _all_to_all(out, send, out_splits, received.sum(1).tolist(), self.group)
        result = [held[0].new_empty(0)] * len(held)
        for m, piece in zip(order, out.split([self.sent[m] for m in order])):
            result[m] = piece
        return result


def _all_to_all(out: Tensor, send: Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)


def _check_same_matrices(views: Sequence[DTensor], groups: list[dist.ProcessGroup]) -> None:
    """Raise on every rank, rather than hang, where the ranks that route together step different matrices."""
    mine = torch.tensor([len(views), sum((i + 1) * v.numel() for i, v in enumerate(views))], device=views[0].device)
    for group in groups:  # once per route: routes are cached
        seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(seen, mine, group=group)
        if any(not torch.equal(s, mine) for s in seen):
            raise ValueError(f"Muon: the ranks of one sharded matrix group step different matrices (matrices with a "
                             f"gradient, count and size per rank: {[s.tolist() for s in seen]}). Every rank must "
                             "have a gradient for the same parameters: give unused ones zero gradients, or freeze them "
                             "(`requires_grad=False`) on every rank.")


class MatrixRoute:
    """The matrices of one mesh and one set of sharding dimensions, routed whole to their owners."""

    def __init__(self, views: Sequence[DTensor]) -> None:
        first = views[0]
        mesh = first.device_mesh
        dims = sharded_mesh_dims(first)
        sizes = [mesh.size(d) for d in dims]
        owners = _owners([v.numel() for v in views], sizes)
        _check_same_matrices(views, [mesh.get_group(d) for d in dims])
        self.views = list(views)
        self.hops = [_Hop(mesh.get_group(d), mesh.size(d), mesh.get_local_rank(d), [o[i] for o in owners])
                     for i, d in enumerate(dims)]
        self.owned = [m for m, o in enumerate(owners) if all(h.me == c for h, c in zip(self.hops, o))]
        # Where each arriving element belongs (routed once); None where arrival order is row-major already.
        held = [distribute_tensor(torch.arange(v.numel(), device=v.device).view(v.shape), v.device_mesh,
                                  v.placements, src_data_rank=None).to_local().reshape(-1) for v in views]
        for hop in self.hops:
            held = hop.forward(held)
        self.order: dict[int, Optional[Tensor]] = {}
        for m in self.owned:
            index = held[m]
            identity = bool((index == torch.arange(index.numel(), device=index.device)).all())
            self.order[m] = None if identity else index

    def apply(self, pieces: Sequence[Tensor], transform: Callable[[int, Tensor], Tensor]) -> list[Tensor]:
        """``transform(m, whole matrix m)`` on its owner, for each matrix; returns this rank's pieces of the results.

        ``pieces[m]`` is this rank's part of matrix ``m`` (any shape); the results come back flat.
        """
        held = [p.reshape(-1) for p in pieces]
        for hop in self.hops:
            held = hop.forward(held)
        for m in self.owned:
            flat, index = held[m], self.order[m]
            if index is not None:
                flat = flat.new_empty(flat.numel()).index_copy_(0, index, flat)
            result = transform(m, flat.view(self.views[m].shape)).reshape(-1)
            held[m] = result if index is None else result[index]
        for hop in reversed(self.hops):
            held = hop.backward(held)
        return held


__all__ = ["MatrixRoute", "sharded_mesh_dims"]
