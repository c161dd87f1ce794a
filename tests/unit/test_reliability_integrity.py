"""The integrity check's pieces without processes: checksums, replica groups, option validation."""

from __future__ import annotations

import pytest
import torch

from lightning_para import ParaStrategy
from lightning_para.mesh import ParallelDims
from lightning_para.reliability.integrity import replica_groups, tensor_checksums


def test_checksums_see_one_flipped_bit_and_two_swapped_values_but_not_the_reduction_order():
    w = torch.randn(1000)
    base = tensor_checksums(w)
    flipped = w.clone()
    flipped.view(torch.int32)[417] ^= 1  # the lowest mantissa bit: a relative change of ~1e-7
    assert not torch.equal(tensor_checksums(flipped), base)
    swapped = w.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert tensor_checksums(swapped)[0] == base[0] and tensor_checksums(swapped)[1] != base[1]
    assert torch.equal(tensor_checksums(w.view(10, 100).t().contiguous().t()), base)  # same values, same bits
    assert torch.equal(tensor_checksums(w.to(torch.bfloat16)), tensor_checksums(w.to(torch.bfloat16).clone()))


@pytest.mark.parametrize(
    "dp, tp, ep, fully_sharded, is_expert, expected, cp, dp_replicate",
    [
        (4, 1, 1, False, False, ["dp"], 1, 1),  # ZeRO-0/1/2: whole parameters on every dp rank
        (2, 2, 1, False, False, ["dp", "tp"], 1, 1),  # a plain parameter (a norm) is also whole on every tp rank
        (4, 1, 2, False, True, ["edp"], 1, 1),  # experts: replicated over the expert-data-parallel ranks only
        (2, 1, 2, False, True, [], 1, 1),  # ep = dp: each expert has one copy
        (4, 1, 1, True, False, [], 1, 1),  # ZeRO-3 shards it: no replica to compare
        (1, 1, 1, False, False, [], 1, 1),
        (2, 1, 1, False, False, ["dp", "cp"], 2, 1),  # context parallel: whole parameters on every cp rank
        (4, 1, 2, False, True, ["dp_replicate"], 1, 2),  # HSDP, ep = dp_shard: one copy per replica
        (4, 1, 1, True, False, [], 2, 2),  # ZeRO-3 (HSDP's replicas are a DTensor placement, read from it)
    ],
)
def test_replica_groups_of_plain_parameters(dp, tp, ep, fully_sharded, is_expert, expected, cp, dp_replicate):
    dims = ParallelDims(pp=1, dp=dp, tp=tp, ep=ep, world_size=dp * tp * cp, cp=cp, dp_replicate=dp_replicate)
    assert replica_groups(torch.zeros(2), dims, fully_sharded=fully_sharded, is_expert=is_expert) == expected


def test_bad_integrity_options_raise_before_any_process_starts():
    with pytest.raises(ValueError, match=r"`integrity_check_every_n_steps=0` must be a positive integer"):
        ParaStrategy(integrity_check_every_n_steps=0)
    with pytest.raises(ValueError, match=r"`integrity_action='ignore'` is unknown. Choose one of 'raise', 'warn'"):
        ParaStrategy(integrity_check_every_n_steps=10, integrity_action="ignore")
