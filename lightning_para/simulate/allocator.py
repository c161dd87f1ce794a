"""A model of PyTorch's CUDA caching allocator: the *reserved* memory of an allocation trace.

What a GPU job needs is not the bytes of its live tensors (what the planner and the dry run count) but what
the caching allocator has reserved from the driver at its peak: freed blocks stay cached, and a request
that no cached block fits opens a new segment even when enough bytes are free in pieces. torchtitan's
published memory figures are that reserved peak (``torch.cuda.max_memory_reserved``).

This module replays a trace of allocations and frees (the dry run records one: every storage its step
allocates and frees, in order) through the allocator's rules with its default settings, as
``c10/cuda/CUDACachingAllocator.cpp`` implements them (PyTorch 2.x; no ``PYTORCH_CUDA_ALLOC_CONF``):

* sizes round up to multiples of 512 bytes (``kMinBlockSize``);
* requests up to 1 MiB (``kSmallSize``) come from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the large pool, whose segments are 20 MiB (``kLargeBuffer``) for
  requests under 10 MiB (``kMinLargeAlloc``) and the request rounded up to 2 MiB (``kRoundLarge``) above;
* a request takes the smallest cached block of its pool that fits (best fit, lowest address on ties) and
  splits it when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
* a freed block merges with free neighbours of its segment; segments are never given back (the
  allocator releases its cache only when the driver refuses a segment, which this model does not reach);
* each stream has cached blocks of its own: a block allocated on a stream is reused only by that stream's
  requests (FSDP2 makes its gather buffers on its copy-in stream and its reduce-scatter buffers on its
  reduce-scatter stream, so those never serve the compute stream's activations).

:class:`ExpandableSegmentsModel` replays it with ``expandable_segments:True`` instead (one segment per stream and
pool, grown at its end by 20 MiB / 2 MiB pages).

Not modelled: the delayed reuse of a block another stream still reads (``record_stream``), and the driver's
limit. Validated against an H100 and an H200
(``benchmarks/results/gpu_fake_world.md``, ``tests/unit/test_allocator_model.py``): the dry run's trace of four
ZeRO-3 ranks of Llama 3 8B (dp=8 and 128, 8 and 32 layers, bf16-true) gives their reserved peaks within
+0.2% to +2.2% (with ``expandable_segments``, two of them: +0.1%, +0.2%); the allocated peak alone is 9-18% under
them, and one pool for all streams gave -6.5% to +5.6%.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Optional

MIN_BLOCK = 512  # kMinBlockSize: every size rounds up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large-pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment of their size rounded up to this


def rounded_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes (``round_size``)."""
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def segment_size(size: int) -> int:
    """Bytes the allocator asks the driver for when no cached block fits ``size`` (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class _Block:
    __slots__ = ("size", "address", "pool", "prev", "next", "free")

    def __init__(self, size: int, address: int, pool: tuple[Hashable, bool]) -> None:
        self.size, self.address, self.pool = size, address, pool
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None
        self.free = True


class CachingAllocatorModel:
    """The allocator's bookkeeping: :meth:`malloc` and :meth:`free` by a caller's key, bytes reserved
    (segments) and allocated (blocks in use, as ``memory_allocated`` counts them: rounded sizes)."""

    def __init__(self) -> None:
        # Cached blocks per (stream, small pool?), sorted by (size, address): a stream reuses only its own.
        self._pools: dict[tuple[Hashable, bool], list[tuple[int, int]]] = {}
        self._cached: dict[tuple[tuple[Hashable, bool], int, int], _Block] = {}
        self._in_use: dict[Hashable, _Block] = {}
        self._next_address = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._pools.setdefault(block.pool, []), (block.size, block.address))
        self._cached[(block.pool, block.size, block.address)] = block

    def _uncache(self, block: _Block) -> None:
        pool = self._pools[block.pool]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._cached[(block.pool, block.size, block.address)]

    def malloc(self, key: Hashable, nbytes: int, stream: Hashable = 0) -> None:
        """Allocate ``nbytes`` for ``key`` on ``stream`` (a key already in use is freed first, as a resized
        storage is)."""
        if key in self._in_use:
            self.free(key)
        size = rounded_size(nbytes)
        small = size <= SMALL_SIZE
        pool_key = (stream, small)
        block = self._best_fit(pool_key, size) or self._new_block(pool_key, size)
        rest = block.size - size
        if self._should_split(rest, small):
            remainder = _Block(rest, block.address + size, pool_key)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._list(remainder)
        block.free = False
        self._in_use[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """Return ``key``'s block to the cache, merged with its free neighbours (unknown keys are ignored)."""
        block = self._in_use.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        before, after = block.prev, block.next
        if before is not None and before.free:
            self._unlist(before)
            block = self._absorb(before, block)
        if after is not None and after.free:
            self._unlist(after)
            block = self._absorb(block, after)
        self._list(block)

    @staticmethod
    def _absorb(left: _Block, right: _Block) -> _Block:
        """Merge ``right`` into its free neighbour ``left`` (``try_merge_blocks``); returns ``left``."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def _best_fit(self, pool_key: tuple[Hashable, bool], size: int) -> Optional[_Block]:
        """The smallest listed free block of this stream and pool that holds ``size``, taken off the list."""
        pool = self._pools.get(pool_key, [])
        at = bisect.bisect_left(pool, (size, -1))
        if at == len(pool):
            return None
        block = self._cached[(pool_key,) + pool[at]]
        self._uncache(block)
        return block

    def _new_block(self, pool_key: tuple[Hashable, bool], size: int) -> _Block:
        """A new segment from the driver (``alloc_block``), counted as reserved."""
        new = segment_size(size)
        # Segments are far apart: blocks of different segments never merge.
        block = _Block(new, self._next_address, pool_key)
        self._next_address += new + SMALL_BUFFER
        self._reserve(new)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    @staticmethod
    def _should_split(rest: int, small: bool) -> bool:
        """``should_split``: a small block splits if 512 bytes remain, a large one if more than 1 MiB does."""
        return rest >= MIN_BLOCK if small else rest > SMALL_SIZE

    def _list(self, block: _Block) -> None:
        """Make a free block available to :meth:`_best_fit`."""
        self._cache(block)

    def _unlist(self, block: _Block) -> None:
        """Take a free block that is about to merge off the list."""
        self._uncache(block)

    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``: the peaks restart from what is held now."""
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated


class ExpandableSegmentsModel(CachingAllocatorModel):
    """The allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's launcher sets it).

    Each (stream, pool) has one segment that grows by mapping pages at its end: 20 MiB pages in the large
    pool, 2 MiB in the small one (``ExpandableSegment``). A request takes the smallest free block that holds
    it, the growable free block at the segment's end last (``get_free_block`` orders it by its size plus the
    unmapped space after it); when none holds it, the segment's end grows by the missing pages, from that
    free end block if there is one (``try_allocate_expandable_block``), so freed space at the end is reused
    whole. A block splits when at least 512 bytes remain, in both pools. Reserved bytes are the mapped pages;
    nothing is unmapped before ``empty_cache`` or an out-of-memory retry, which this model does not reach."""

    def __init__(self) -> None:
        super().__init__()
        self._end: dict[tuple[Hashable, bool], _Block] = {}  # the last block of each (stream, pool) segment

    def _new_block(self, pool_key: tuple[Hashable, bool], size: int) -> _Block:
        """Grow the segment's end by the pages the request lacks: from its free end block if there is one."""
        page = SMALL_BUFFER if pool_key[1] else LARGE_BUFFER
        end = self._end.get(pool_key)
        if end is not None and end.free:
            grow = page * -(-max(0, size - end.size) // page)
            end.size += grow
            block = end
        else:
            grow = page * -(-size // page)
            if end is None:
                address = self._next_address
                self._next_address += 1 << 50  # each segment has an address space of its own
            else:
                address = end.address + end.size
            block = _Block(grow, address, pool_key)
            block.prev = end
            if end is not None:
                end.next = block
            self._end[pool_key] = block
        self._reserve(grow)
        return block

    @staticmethod
    def _should_split(rest: int, small: bool) -> bool:
        return rest >= MIN_BLOCK  # with expandable segments large blocks split as small ones do

    def _list(self, block: _Block) -> None:
        if block.next is None:  # the segment's free end: reached by growing, not by best fit
            self._end[block.pool] = block
        else:
            self._cache(block)

    def _unlist(self, block: _Block) -> None:
        if block.next is not None:
            self._uncache(block)


@dataclass
class AllocationTrace:
    """One training step's storages, in order: ``("alloc", key, nbytes, stream)``, ``("free", key, nbytes, 0)``
    and ``("mark", name, 0, 0)`` events (marks: ``"forward_end"``, ``"optimizer_start"``, ``"step_end"``), beside
    the sizes of the storages that exist before the step and stay (``states``: weights, masters). ``stream``: the
    stream the storage was allocated on (FSDP2 gathers and reduce-scatters on streams of its own), 0 the default."""

    events: list[tuple[str, Hashable, int, Hashable]] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    # Storages the step made that a later step does not make again, beside the optimizer state (e.g. the pipeline
    # stage's receive buffers, made when its schedule first runs): kept, not freed at `zero_grad`.
    made_once: set[Hashable] = field(default_factory=set)

    def alloc(self, key: Hashable, nbytes: int, stream: Hashable = 0) -> None:
        self.events.append(("alloc", key, nbytes, stream))

    def free(self, key: Hashable, nbytes: int) -> None:
        self.events.append(("free", key, nbytes, 0))

    def mark(self, name: str) -> None:
        self.events.append(("mark", name, 0, 0))

    def _index(self, name: str) -> Optional[int]:
        return next((i for i, (op, key, _, _) in enumerate(self.events) if op == "mark" and key == name), None)


@dataclass(frozen=True)
class ReservedPeak:
    """The modelled steady-state step: peaks of allocated (rounded blocks) and reserved bytes."""

    allocated: int
    reserved: int


def steady_state_peaks(trace: AllocationTrace, steps: int = 3, gradients_freed_at: str = "forward_end",
                       expandable_segments: bool = False) -> ReservedPeak:
    """Replay ``trace`` as ``steps`` consecutive training steps and return the last one's peaks.

    The storages alive when the step ends are carried into the next step as a real loop carries them:
    the optimizer state made in the first step's ``optimizer.step()`` and the storages named ``made_once`` stay
    (they are not made again), and the
    gradients made before it are freed at the next step's ``gradients_freed_at`` mark: Lightning calls
    ``zero_grad`` between the training step and ``backward``, so after the forward (``"forward_end"``), and
    under a pipeline, whose runner keeps them aside while its schedule runs, after the schedule
    (``"schedule_end"``). The states exist before the first step. ``expandable_segments``: replay through
    :class:`ExpandableSegmentsModel`."""
    end = trace._index("step_end")
    events: Sequence[tuple[str, Hashable, int, Hashable]] = trace.events[:end] if end is not None else trace.events
    optimizer_start = trace._index("optimizer_start")
    if optimizer_start is None:
        raise ValueError("The trace has no 'optimizer_start' mark: the optimizer state cannot be told apart.")
    # Name each allocation by the event that made it: a key (a storage's identity) is reused by later storages.
    live_alloc: dict[Hashable, int] = {}
    # ("alloc" | "free" | "zero_grad", allocation index, bytes, stream)
    replayed: list[tuple[str, int, int, Hashable]] = []
    for index, (op, key, nbytes, stream) in enumerate(events):
        if op == "alloc":
            live_alloc[key] = index
            replayed.append(("alloc", index, nbytes, stream))
        elif op == "free" and key in live_alloc:
            replayed.append(("free", live_alloc.pop(key), nbytes, 0))
        elif op == "mark" and key == gradients_freed_at:
            replayed.append(("zero_grad", -1, 0, 0))
    survivors = set(live_alloc.values())
    kept = {live_alloc[key] for key in trace.made_once if key in live_alloc}
    optimizer_state = {index for index in survivors if index > optimizer_start} | kept
    gradients = survivors - optimizer_state
    model = ExpandableSegmentsModel() if expandable_segments else CachingAllocatorModel()
    for index, nbytes in enumerate(trace.states):
        model.malloc(("state", index), nbytes)
    for step in range(steps):
        model.reset_peaks()
        for op, index, nbytes, stream in replayed:
            if op == "zero_grad":
                if step > 0:
                    for grad in gradients:
                        model.free((step - 1, grad))
            elif index in optimizer_state:
                if step == 0:  # made once, kept
                    model.malloc(("optimizer", index), nbytes, stream)
            elif op == "alloc":
                model.malloc((step, index), nbytes, stream)
            else:
                model.free((step, index))
    return ReservedPeak(model.peak_allocated, model.peak_reserved)

