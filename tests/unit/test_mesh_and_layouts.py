"""Mesh layout (on torch's fake process group: no real communication), ZeRO bucket layout,
ZeRO-3 unit choice, and the ZeRO memory formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_para.config import ParallelConfig
from lightning_para.parallel.data.memory import expected, formula
from lightning_para.parallel.data.layout import pack_rank_major as _pack, unpack_rank_major as _unpack
from lightning_para.parallel.data.fsdp import choose_units


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


@pytest.mark.parametrize("rank", [0, 5])
def test_mesh_layout_tp_innermost_pp_outermost(fake_world, rank):
    fake_world(8, rank)
    dims = ParallelConfig(tp=2, pp=2).resolve_dims(8)
    dims.build_mesh("cpu")
    assert (dims.pp, dims.dp, dims.tp, dims.ep, dims.edp) == (2, 2, 2, 1, 2)
    # rank = ((pp * edp + edp_i) * ep + ep_i) * tp + tp_i
    tp_group = [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(dims.get_mesh("tp")) == tp_group  # consecutive ranks: one node's NVLink
    assert _ranks(dims.get_mesh("pp")) == [rank % 4, rank % 4 + 4]
    dp = [(rank // 4) * 4 + (rank % 2), (rank // 4) * 4 + (rank % 2) + 2]
    assert _ranks(dims.get_mesh("dp")) == dp
    assert dims.get_mesh("dp", "tp").mesh.shape == (2, 2)


def test_expert_parallel_borrows_inner_dp_ranks(fake_world):
    fake_world(8)
    dims = ParallelConfig(dp=4, tp=2, ep=2).resolve_dims(8)
    dims.build_mesh("cpu")
    assert (dims.dp, dims.ep, dims.edp) == (4, 2, 2)
    assert _ranks(dims.get_mesh("dp")) == [0, 2, 4, 6]
    assert _ranks(dims.get_mesh("ep")) == [0, 2]  # experts sharded here
    assert _ranks(dims.get_mesh("edp")) == [0, 4]  # same experts replicated here


def test_get_mesh_errors_list_valid_names(fake_world):
    fake_world(2)
    dims = ParallelConfig().resolve_dims(2)
    with pytest.raises(RuntimeError, match="does not exist yet"):
        dims.get_mesh("dp")
    dims.build_mesh("cpu")
    with pytest.raises(ValueError, match=r"Unknown mesh dimension.*Valid names: pp, dp_replicate, edp, ep, cp, tp, dp"):
        dims.get_mesh("sp")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_major_pack_roundtrip(world):
    shapes = [(12, 2), (10, 1), (3, 5), (7, 1), (1, 1)]  # rows x row elements; uneven and short ones too
    tensors = [torch.arange(r * c, dtype=torch.float32).view(r, c) + 100 * i + 1 for i, (r, c) in enumerate(shapes)]
    chunks = [math.ceil(r / world) * c for r, c in shapes]
    dest = torch.full((world, sum(chunks)), -1.0)
    _pack(tensors, dest)
    # Row r holds torch.chunk's r-th piece of each tensor, zero-padded to its chunk, the tensors end to end.
    offset = 0
    for t, (r, c), chunk in zip(tensors, shapes, chunks):
        pieces = list(torch.split(t.reshape(-1), chunk))
        for rank in range(world):
            piece = pieces[rank] if rank < len(pieces) else torch.empty(0)
            assert torch.equal(dest[rank, offset : offset + len(piece)], piece)
            assert torch.all(dest[rank, offset + len(piece) : offset + chunk] == 0)
        offset += chunk
    back = [torch.zeros_like(t) for t in tensors]
    _unpack(dest, back)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_zero3_units_shard_tied_weights_together():
    model = _Tied()
    # embed and head share a weight: one grouped unit, last (it holds the head)
    assert choose_units(model) == [*model.blocks, model.norm, [model.embed, model.head]]
    assert choose_units(model, units="blocks") == [*model.blocks, [model.norm, model.embed, model.head]]


def test_zero3_units_group_every_module_sharing_a_weight_or_leave_it_to_the_root():
    model = _Tied()
    model.embed, model.head = nn.Embedding(8, 8), nn.Linear(8, 8, bias=False)
    model.head.weight = model.embed.weight
    model.blocks[0].weight = model.embed.weight  # a block shares it too: all three form the group
    assert choose_units(model) == [model.blocks[1], model.blocks[2], model.norm,
                                   [model.embed, model.blocks[0], model.head]]
    model.blocks[0].weight = nn.Parameter(torch.zeros(8, 8))
    model.table = model.embed.weight  # the root holds it directly: no unit can own it
    units = choose_units(model)
    assert units == [*model.blocks, model.norm]


def test_zero3_units_descend_wrappers():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.transformer.wpe = nn.Embedding(4, 4)
            self.lm_head = nn.Linear(4, 4)

    model = Outer()
    assert choose_units(model) == [*model.transformer.h, model.transformer.wpe, model.lm_head]


@pytest.mark.parametrize("stage, paper", [(0, 16.0), (1, 4 + 12 / 4), (2, 2 + 14 / 4), (3, 16 / 4)])
def test_zero_formulas_match_the_paper(stage, paper):
    """bf16 weights and grads (2 + 2 B) and Adam with an fp32 master (12 B), N = 4."""
    psi = 1000
    exp = expected(stage=stage, psi_dense=psi, psi_expert=0, dp=4, edp=4, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert exp.total / psi == pytest.approx(paper)
    assert formula(stage, 4).startswith(("16 ", "4+12/N", "2+14/N", "16/N"))


def test_expert_parameters_shard_over_edp():
    exp = expected(stage=1, psi_dense=100, psi_expert=100, dp=4, edp=2, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert exp.optimizer == 8 * (100 / 4 + 100 / 2)


class _Untied(nn.Module):
    def __init__(self, vocab: int, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)


def test_zero3_units_blocks_groups_the_ends_last():
    model = _Untied(vocab=4)
    assert choose_units(model, units="blocks") == [*model.blocks, [model.embed, model.norm, model.head]]
    assert choose_units(model, units="blocks_and_ends") == [model.embed, *model.blocks, model.norm, model.head]
    one_end = _Untied(vocab=4)
    del one_end.embed, one_end.head
    assert choose_units(one_end, units="blocks") == [*one_end.blocks, one_end.norm]  # nothing to group


def test_zero3_units_auto_groups_ends_no_larger_than_a_block():
    small = _Untied(vocab=2)  # ends: 16 + 16 + 16 = 48 parameters, a block 72
    assert choose_units(small, units="auto") == choose_units(small, units="blocks")
    large = _Untied(vocab=64)  # ends: 512 + 16 + 512 parameters, more than a block
    assert choose_units(large, units="auto") == choose_units(large, units="blocks_and_ends")
    with pytest.raises(ValueError, match="zero3_units='layers'.*'blocks_and_ends'"):
        choose_units(small, units="layers")
