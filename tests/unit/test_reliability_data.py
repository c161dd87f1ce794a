"""ResumableDataLoader: a global data position that resumes mid-epoch, also into another dp degree."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_para import ResumableDataLoader

N, GLOBAL_BATCH = 100, 8  # 12 global batches per epoch (4 samples dropped), for every dp dividing 8


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N))


def _loaders(dp: int, **kwargs) -> list[ResumableDataLoader]:
    return [ResumableDataLoader(_dataset(), GLOBAL_BATCH, num_replicas=dp, rank=r, seed=3, **kwargs) for r in range(dp)]


def _global_batches(loaders: list[ResumableDataLoader], epoch: int = 0, limit: int = 10**9) -> list[set[int]]:
    """Each step's samples over all ranks (a set: the global batch a one-device run would see)."""
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    iterators = [iter(loader) for loader in loaders]
    out = []
    while len(out) < limit:  # fetch exactly `limit` batches per rank (no batch taken and dropped)
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        out.append({int(i) for (b,) in batches for i in b})
    return out


def test_global_batches_do_not_depend_on_dp():
    one = _global_batches(_loaders(1))
    assert len(one) == N // GLOBAL_BATCH == len(_loaders(4)[0])
    assert _global_batches(_loaders(2)) == one == _global_batches(_loaders(4)) == _global_batches(_loaders(8))
    assert _global_batches(_loaders(2), epoch=1) != one  # a new order each epoch


@pytest.mark.parametrize("dp_before, dp_after", [(2, 2), (2, 4), (4, 1)])
def test_resume_mid_epoch_continues_the_global_batch_sequence(dp_before, dp_after):
    uninterrupted = _global_batches(_loaders(dp_before), epoch=1)
    before = _loaders(dp_before)
    assert _global_batches(before, epoch=1, limit=5) == uninterrupted[:5]
    state = before[0].state_dict()  # Lightning saves rank 0's; it is global
    assert state["epoch"] == 1 and state["samples"] == 5 * GLOBAL_BATCH
    assert all(loader.state_dict() == state for loader in before)
    after = _loaders(dp_after)
    for loader in after:
        loader.load_state_dict(state)
        assert len(loader) == N // GLOBAL_BATCH  # Lightning counts the done batches itself
    rng = torch.get_rng_state()
    assert _global_batches(after, epoch=1) == uninterrupted[5:]
    assert torch.equal(rng, torch.get_rng_state()), "iterating must not draw from the global RNG (dropout's)"
    # The same dp resumes each rank's exact batches, in order.
    if dp_after == dp_before:
        fresh = _loaders(dp_before)
        for loader in fresh:
            loader.sampler.set_epoch(1)
        expected = [b.tolist() for (b,) in list(fresh[0])[5:]]
        again = _loaders(dp_before)
        again[0].load_state_dict(state)
        assert [b.tolist() for (b,) in again[0]] == expected


def test_state_at_epoch_end_starts_the_next_epoch_and_positions_accumulate():
    loaders = _loaders(2)
    _global_batches(loaders, epoch=0)
    end = loaders[0].state_dict()
    assert end["samples"] == 12 * GLOBAL_BATCH
    resumed = _loaders(2)
    for loader in resumed:
        loader.load_state_dict(end)
    assert resumed[0].sampler.epoch == 1
    assert _global_batches(resumed, epoch=1) == _global_batches(_loaders(2), epoch=1)
    # Resumed, then saved again later: the position counts from the epoch start, not from the resume.
    mid = _loaders(2)
    for loader in mid:
        loader.load_state_dict({**end, "epoch": 1, "samples": 3 * GLOBAL_BATCH})
    _global_batches(mid, epoch=1, limit=2)
    assert mid[0].state_dict()["samples"] == 5 * GLOBAL_BATCH


def test_changed_data_settings_and_bad_arguments_raise():
    state = _loaders(2)[0].state_dict()
    with pytest.raises(ValueError, match=r"seed: 3 in the checkpoint, 4 now"):
        ResumableDataLoader(_dataset(), GLOBAL_BATCH, num_replicas=2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"global_batch_size: 8 in the checkpoint, 16 now"):
        ResumableDataLoader(_dataset(), 16, num_replicas=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"dataset_len: 100 in the checkpoint, 50 now"):
        ResumableDataLoader(TensorDataset(torch.arange(50)), GLOBAL_BATCH, num_replicas=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"`global_batch_size=8` is not divisible by the data-parallel degree num_replicas=3"):
        ResumableDataLoader(_dataset(), GLOBAL_BATCH, num_replicas=3)
    with pytest.raises(ValueError, match="sets `sampler` itself"):
        ResumableDataLoader(_dataset(), GLOBAL_BATCH, sampler=None)


def test_workers_resume_too():
    """With worker processes the sampler is consumed when the iterator starts; the position still holds."""
    uninterrupted = _global_batches(_loaders(2), epoch=0)
    state = {**_loaders(2)[0].state_dict(), "samples": 7 * GLOBAL_BATCH}
    after = _loaders(2, num_workers=1)
    for loader in after:
        loader.load_state_dict(state)
    assert _global_batches(after, epoch=0) == uninterrupted[7:]


class _Stream(torch.utils.data.Dataset):
    """Position g is (g,): an endless stream whose epoch is N positions."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, g: int):
        return (torch.tensor(g),)


def test_a_stream_dataset_reads_the_next_positions_each_epoch():
    """``stream=True``: the dataset orders itself; epoch e reads positions e * len + i, split over the ranks as ever."""
    loaders = [ResumableDataLoader(_Stream(), GLOBAL_BATCH, num_replicas=2, rank=r, shuffle=False, stream=True) for r in range(2)]
    epochs = [_global_batches(loaders, epoch) for epoch in (0, 1)]
    assert epochs[0][0] == set(range(8)) and epochs[1][0] == set(range(N, N + 8)) and len(epochs[1]) == N // GLOBAL_BATCH
    with pytest.raises(ValueError, match="pass `shuffle=False` with `stream=True`"):
        ResumableDataLoader(_Stream(), GLOBAL_BATCH, stream=True)
