"""A training DataLoader that resumes exactly mid-epoch, also into another data-parallel degree.

Lightning saves the state of a training dataloader that has ``state_dict``/``load_state_dict``
in every checkpoint (``loops.fit_loop.state_dict.combined_loader``) and hands it back before
the first batch of a resumed fit. :class:`ResumableDataLoader` uses that hook. Its state is
*global*, not per rank:

* the epoch, the shuffle seed and the dataset length (together they fix the epoch's order:
  a permutation seeded with ``seed + epoch``, as ``DistributedSampler`` draws it);
* how many samples of that order all data-parallel ranks together have consumed.

Why global: with ``global_batch_size = G`` over ``dp`` ranks, global batch ``b`` is exactly the
samples ``order[b*G : (b+1)*G]``, whatever ``dp`` is (rank ``r`` takes every ``dp``-th of them,
as ``DistributedSampler`` does). So a checkpoint written at ``dp=2`` resumes at ``dp=4`` with
the same sequence of global batches, and the per-step losses continue as in the uninterrupted
run. A per-rank state (torchdata's ``StatefulDataLoader``) cannot move to another ``dp``.

A *stream* dataset (``stream=True``) orders itself: an endless sequence indexed by global position,
each epoch the next ``len(dataset)`` positions (epoch ``e`` reads ``e * len + i``), split over the ranks
the same way; the recipes' weighted mixtures are one.

Only rank 0's state reaches the checkpoint (Lightning saves loop state from rank 0); being
global, it is every rank's. The loader also gives the DataLoader its own generator, seeded per
epoch, so starting an iterator never draws from the global torch RNG that dropout uses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

STATE_FORMAT = 1


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (same order, same split over ranks) whose next epoch can start part-way.

    ``resume_from(epoch, samples)`` makes the next iteration of ``epoch`` skip the first ``samples``
    of the epoch's *global* order. ``len()`` stays the full epoch's share, as Lightning expects:
    it counts the batches already done itself. ``stream``: epoch ``e`` yields positions
    ``e * len(dataset) + i`` of a dataset that orders itself (no shuffle).
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
        stream: bool = False,
    ) -> None:
        if stream and shuffle:
            raise ValueError("A stream dataset orders itself: pass `shuffle=False` with `stream=True`.")
        # drop_last: every rank gets the same number of samples and no sample is repeated as padding.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.stream = stream
        self._resume: Optional[tuple[int, int]] = None

    def resume_from(self, epoch: int, samples: int) -> None:
        if samples % self.num_replicas:
            raise ValueError(
                f"Cannot resume {samples} samples into the epoch with num_replicas={self.num_replicas}: the position must"
                " be a multiple of the data-parallel degree (keep the global batch a multiple of dp)."
            )
        self.set_epoch(epoch)
        self._resume = (epoch, samples)

    def pending_start(self) -> int:
        """Global samples the next iteration skips (0 unless :meth:`resume_from` targeted this epoch)."""
        resume = self._resume
        return resume[1] if resume is not None and resume[0] == self.epoch else 0

    def __iter__(self):
        per_rank = list(super().__iter__())
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == self.epoch:
            # Skipping S global samples is skipping S / num_replicas of this rank's (interleaved) share.
            per_rank = per_rank[resume[1] // self.num_replicas :]
        if self.stream:
            offset = self.epoch * len(self.dataset)  # type: ignore[arg-type]
            return iter([i + offset for i in per_rank])
        return iter(per_rank)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over one data-parallel rank's share, with a global, resumable position.

    Args:
        dataset: a map-style dataset.
        global_batch_size: samples per step over all ``num_replicas`` ranks (each loads
            ``global_batch_size // num_replicas``).
        num_replicas, rank: the data-parallel degree and this rank's coordinate; pass
            ``**trainer.strategy.distributed_sampler_kwargs``.
        shuffle, seed: the epoch order (a permutation seeded with ``seed + epoch``).
        stream: the dataset orders itself, one endless sequence of positions (see the module docstring).
        **kwargs: anything else ``DataLoader`` takes (``num_workers``, ``collate_fn``, ...);
            not ``sampler``, ``batch_sampler``, ``shuffle`` or ``drop_last``.

    Lightning calls :meth:`state_dict` when it saves a checkpoint and :meth:`load_state_dict`
    before the first batch of a resumed fit; nothing else is needed.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        stream: bool = False,
        **kwargs: Any,
    ) -> None:
        for name in ("sampler", "batch_sampler", "drop_last", "generator"):
            if name in kwargs:
                raise ValueError(f"ResumableDataLoader sets `{name}` itself (its order must be resumable); remove it.")
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"`global_batch_size={global_batch_size!r}` must be a positive integer.")
        if global_batch_size % num_replicas:
            raise ValueError(
                f"`global_batch_size={global_batch_size}` is not divisible by the data-parallel degree"
                f" num_replicas={num_replicas}. Choose a multiple of {num_replicas}."
            )
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, stream=stream)
        super().__init__(
            dataset, batch_size=global_batch_size // num_replicas, sampler=sampler, drop_last=True,
            generator=torch.Generator(), **kwargs,
        )
        self.global_batch_size = global_batch_size
        self._epoch = 0
        self._start = 0  # global samples of `_epoch` consumed before this iteration began
        self._yielded = 0  # batches handed out by this iteration

    @property
    def resumable_sampler(self) -> ResumableSampler:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        return sampler

    @property
    def samples_per_epoch(self) -> int:
        """Global samples in one epoch's full batches (the same for every ``num_replicas`` dividing the batch)."""
        return len(self) * self.global_batch_size

    def __iter__(self):
        # A generator: its body runs at the first `next()`, after Lightning has set the epoch.
        sampler = self.resumable_sampler
        self._epoch = sampler.epoch
        self._start = sampler.pending_start()
        self._yielded = 0
        assert self.generator is not None
        self.generator.manual_seed(sampler.seed + sampler.epoch)  # worker seeds: per epoch, not from the global RNG
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The global position: epoch, samples consumed in it, and what fixes the order."""
        sampler = self.resumable_sampler
        return {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "samples": self._start + self._yielded * self.global_batch_size,
            "global_batch_size": self.global_batch_size,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; raises ``ValueError`` if the data settings changed."""
        sampler = self.resumable_sampler
        now = {"seed": sampler.seed, "shuffle": sampler.shuffle, "dataset_len": len(sampler.dataset),  # type: ignore[arg-type]
               "global_batch_size": self.global_batch_size}
        changed = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if changed:
            described = ", ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
            raise ValueError(
                f"The checkpoint's data position cannot continue with this data loader ({described}). Resume with the"
                " same dataset, seed, shuffle and global batch size (the data-parallel degree may change)."
            )
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if samples >= self.samples_per_epoch:  # saved at the end of an epoch: the next one starts from its beginning
            epoch, samples = epoch + 1, 0
        sampler.resume_from(epoch, samples)
        self._epoch, self._start, self._yielded = epoch, samples, 0


__all__ = ["ResumableDataLoader", "ResumableSampler"]
