"""Kernels per optimizer step against Lightning's strategy for the same semantics (``benchmarks/kernel_counts.py``).

A TinyLlama-size ``LlamaForCausalLM``, ``AdamW(foreach=True)``; the aten operators one training step dispatches
after warm-up (views, aliases, allocations and profiler markers left out: each is a kernel launch on a GPU),
counted on rank 0 of real gloo groups; gradient clipping by norm too. ParaStrategy's only kernels beyond Lightning's are its finite check's
(``GUARD_KERNELS``: Lightning's strategies check nothing); everything else -- master weights, ZeRO's buckets,
casts -- is held to the targets of ``CASES`` (at most Lightning's count; ``bf16-true`` with fp32 masters at most
1.05x Lightning's all-bf16). Without the step guard (Lightning's semantics) ParaStrategy dispatches no more than
Lightning. A per-parameter copy planted back into ZeRO's bucket packing is caught.
"""

from __future__ import annotations

import pytest

kernel_counts = pytest.importorskip("benchmarks.kernel_counts")
CASES, GUARD_KERNELS, count_side = kernel_counts.CASES, kernel_counts.GUARD_KERNELS, kernel_counts.count_side

_lightning: dict[tuple[str, str, int, bool], int] = {}  # Lightning's count per (side, precision, world), run once


def _count(pools, side: str, precision: str, world: int, clip: bool = False, fn=None) -> int:  # noqa: ANN001
    return sum(pools.get(world).run(fn or count_side, side, precision, world, clip, timeout=600)[0].values())


def _lightning_count(pools, case) -> int:  # noqa: ANN001
    key = (case.lightning, case.precision, case.world, case.clip)
    if key not in _lightning:
        _lightning[key] = _count(pools, *key)
    return _lightning[key]


@pytest.mark.parametrize("name", list(CASES))
def test_no_more_kernels_than_lightning_beyond_the_finite_check(pools, name):
    case = CASES[name]
    theirs = _lightning_count(pools, case)
    ours = _count(pools, case.para, case.precision, case.world, case.clip)
    assert ours - GUARD_KERNELS[case.world] <= case.target * theirs, (name, ours, theirs)


def test_without_the_step_guard_no_more_kernels_than_lightning(pools):
    """Lightning's semantics (no finite check, no SIGTERM agreement): no kernel more than Lightning's, and the
    guard costs exactly its budget."""
    case = CASES["single-32-true"]
    unguarded = _count(pools, case.para + "-unguarded", case.precision, 1)
    assert unguarded <= _lightning_count(pools, case)
    assert _count(pools, case.para, case.precision, 1) - unguarded == GUARD_KERNELS[1]


def _count_with_per_parameter_copies(side: str, precision: str, world: int, clip: bool):  # noqa: ANN202
    """The planted bug: ZeRO-1/2's bucket packing and unpacking back to copies per parameter (what they were)."""
    import torch

    from lightning_para.parallel.data import zero, zero_optimizer

    pack, unpack = zero.pack_rank_major, zero_optimizer.unpack_rank_major

    def pack_each(rows, out):  # noqa: ANN001
        offset = 0
        for t in rows:
            chunk = torch._chunk_cat([t], 0, out.shape[0])
            out[:, offset : offset + chunk.shape[1]].copy_(chunk)
            offset += chunk.shape[1]

    def unpack_each(src, rows):  # noqa: ANN001
        offset = 0
        for t in rows:
            size = -(-t.shape[0] // src.shape[0]) * t.shape[1]
            unpack(src[:, offset : offset + size], [t])
            offset += size

    zero.pack_rank_major, zero_optimizer.unpack_rank_major = pack_each, unpack_each
    try:
        return count_side(side, precision, world, clip)
    finally:
        zero.pack_rank_major, zero_optimizer.unpack_rank_major = pack, unpack


def test_a_per_parameter_copy_on_the_step_path_is_counted(pools):
    case = CASES["dp2-zero1"]
    planted = _count(pools, case.para, case.precision, case.world, fn=_count_with_per_parameter_copies)
    assert planted - GUARD_KERNELS[case.world] > case.target * _lightning_count(pools, case)
