"""Pure sharding math of context parallelism (no process group): layouts, positions, balance, errors."""

from __future__ import annotations

import pytest
import torch

from lightning_para.parallel.context.sharding import (
    chunk_ids_for_rank,
    natural_to_rank_order,
    position_ids_for_rank,
    rank_order_positions,
    rank_order_to_natural,
    shard_sequence,
    valid_cp_sizes,
    validate_cp_sequence_length,
)


def test_head_tail_chunks_and_positions_for_cp4():
    # 16 tokens, 8 chunks of 2: rank r holds chunks r and 7 - r.
    assert [chunk_ids_for_rank(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert position_ids_for_rank(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert position_ids_for_rank(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert position_ids_for_rank(16, 1, 4, load_balance=False).tolist() == [4, 5, 6, 7]
    assert position_ids_for_rank(16, 1, 4).dtype == torch.int64


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_shards_partition_the_sequence_and_match_positions(cp, load_balance):
    seq = 24
    x = torch.arange(2 * seq).view(2, seq) * 10  # [batch, seq]
    shards = [shard_sequence(x, r, cp, dim=1, load_balance=load_balance) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert shard.shape == (2, seq // cp)
        assert torch.equal(shard, x[:, position_ids_for_rank(seq, r, cp, load_balance)])
    gathered = torch.cat(shards, dim=1)  # what an all-gather yields: rank order
    assert torch.equal(gathered, natural_to_rank_order(x, cp, dim=1, load_balance=load_balance))
    assert torch.equal(rank_order_to_natural(gathered, cp, dim=1, load_balance=load_balance), x)
    assert sorted(rank_order_positions(seq, cp, load_balance).tolist()) == list(range(seq))


def test_shard_sequence_other_dims_and_autograd():
    x = torch.randn(2, 3, 8, 4, requires_grad=True)  # attention layout: sequence is dim 2
    shard = shard_sequence(x, 1, 2, dim=2)
    assert torch.equal(shard, x[:, :, [2, 3, 4, 5]])
    assert torch.equal(shard_sequence(x, 1, 2, dim=-2), shard)
    shard.sum().backward()
    expected = torch.zeros(8)
    expected[2:6] = 1
    assert torch.equal(x.grad[0, 0, :, 0], expected)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balanced_layout_gives_equal_causal_work(cp):
    """Visible (query, key) pairs per rank under the causal mask: equal only when load-balanced."""
    seq = 64

    def work(rank, load_balance):
        return int((position_ids_for_rank(seq, rank, cp, load_balance) + 1).sum())  # token i sees i + 1 keys

    balanced = {work(r, True) for r in range(cp)}
    assert len(balanced) == 1
    assert balanced.pop() * cp == seq * (seq + 1) // 2
    contiguous = [work(r, False) for r in range(cp)]
    assert contiguous == sorted(contiguous) and contiguous[-1] > contiguous[0]


def test_cp_one_is_the_identity():
    x = torch.randn(3, 10)
    assert torch.equal(shard_sequence(x, 0, 1), x)
    assert torch.equal(rank_order_to_natural(x, 1), x)


def test_valid_choices():
    assert valid_cp_sizes(16) == [1, 2, 4, 8]
    assert valid_cp_sizes(12, load_balance=False) == [1, 2, 3, 4, 6, 12]


def test_errors_name_cp_and_the_valid_choices():
    with pytest.raises(ValueError, match=r"cp=3 .*2\*cp=6 .*choose cp in \[1, 2, 4, 8\].*load_balance=False"):
        validate_cp_sequence_length(16, 3)
    divide = r"cp=3 does not divide the sequence length 16; choose cp in \[1, 2, 4, 8, 16\]"
    with pytest.raises(ValueError, match=divide):
        validate_cp_sequence_length(16, 3, load_balance=False)
    with pytest.raises(ValueError, match=r"2\*cp=8 .*choose cp in \[1, 3\]"):
        shard_sequence(torch.zeros(1, 6), 0, 4)
    validate_cp_sequence_length(6, 3, load_balance=False)  # no raise
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        validate_cp_sequence_length(16, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 is out of range for cp=2"):
        chunk_ids_for_rank(2, 2)
    with pytest.raises(ValueError, match="dim=3 is out of range"):
        shard_sequence(torch.zeros(2, 8), 0, 2, dim=3)
