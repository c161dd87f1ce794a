"""ZeRO-2 under a pipeline: one reduction per microbatch (``zero_accumulation="reduce_each_microbatch"``).
The rest of the engine is :mod:`lightning_para.parallel.data.zero`.

One reduction per pipeline microbatch (``zero_accumulation="reduce_each_microbatch"``, stage 2):
under a pipeline, no sync means every stage's whole gradients exist until the schedule ends.
Inside :meth:`ZeroDataParallel.reduce_each_microbatch` a bucket never spans two of the rank's
stages (``part_of``); a stage's buckets launch as its backward of one microbatch fills them, the
runner calls :meth:`ZeroDataParallel.reduce_part` after that backward (zeros where a gradient is
missing: every rank issues the same collectives), and the shards add up in ``Bucket.pending``, in
the masters' dtype. The rank then holds one stage's whole gradients at most, plus its fp32 shards
(the Llama 3 paper, Sec. 3.3.2: FSDP shards the gradients under pipelining, FP32 accumulation),
for ``m`` times the gradient traffic. :meth:`ZeroDataParallel.commit_pending` hands the sum to the
masters once Lightning's ``zero_grad`` has run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class MicrobatchReduction:
    """The per-microbatch half of :class:`~lightning_para.parallel.data.zero.ZeroDataParallel` (its base
    class): it reads the engine's buckets and launches and finishes them with the engine's own methods."""

    @contextlib.contextmanager
    def reduce_each_microbatch(self) -> Iterator[None]:
        """Around a pipeline schedule: reduce each stage's gradients after each of its microbatch
        backwards (:meth:`reduce_part`) into ``Bucket.pending``; :meth:`commit_pending` afterwards."""
        if self.stage == 0:
            raise ValueError("One reduction per microbatch keeps gradients sharded: it needs ZeRO stage 2, not 0.")
        previous, self._each_microbatch = self._each_microbatch, True
        self._discard_pending()  # nothing of an earlier schedule that failed before its commit
        try:
            yield
            self._settle(block=True)
        except BaseException:
            # A failed schedule: its partial sums are no step's gradients, and waiting for collectives that other
            # ranks may never issue would turn the error into a hang.
            self._discard_pending()
            raise
        finally:
            self._each_microbatch = previous

    def _discard_pending(self) -> None:
        # Reductions still on the wire stay referenced until done: a backend may still write into their buffers, and
        # gloo's point-to-point transfers are cancelled with their work objects (the peer's would then never match).
        still = [(work, buffer) for work, buffer in self._abandoned if not work.is_completed()]
        self._abandoned = still + [(b.work, b.buffer) for b in self._in_flight if b.work is not None]
        self._in_flight = []
        for bucket in self.buckets:
            bucket.pending = bucket.work = bucket.buffer = None
            bucket.ready, bucket.launched = 0, False

    def reduce_part(self, part: int) -> None:
        """End one microbatch's backward of this rank's stage ``part`` (inside :meth:`reduce_each_microbatch`):
        reduce what its buckets hold and add the shards to ``Bucket.pending``; its whole gradients are freed."""
        if not self._each_microbatch:
            raise RuntimeError("reduce_part() runs inside reduce_each_microbatch() only.")
        # The previous microbatch's buckets first (long done by now): a split backward's weight half
        # (zero-bubble schedules) writes `.grad` itself, so no gradient hook settled them.
        self._settle(block=True)
        buckets = self._buckets_of_part.get(part, ())
        for bucket in buckets:
            if not bucket.launched:
                self._launch(bucket)
        # Not waited for here: the last buckets' collectives overlap what the rank runs next. Those already
        # done are added now, so only the few still on the wire keep their whole-gradient buffers.
        self._in_flight.extend(buckets)
        self._settle(block=False)

    def _settle(self, *, block: bool) -> None:
        """Add in-flight buckets to ``Bucket.pending`` in launch order: all of them (``block``), or while
        their collective is done (hybrid sharding's second collective waits for the first: only ``block``)."""
        while self._in_flight:
            bucket = self._in_flight[0]
            if not block and (self.replicate_group is not None or (bucket.work is not None and not bucket.work.is_completed())):
                return
            self._in_flight.pop(0)
            if self.replicate_group is not None:
                self._reduce_over_replicas(bucket)
            self._finish(bucket, into_pending=True)

    def commit_pending(self) -> None:
        """After a schedule under :meth:`reduce_each_microbatch` (and after Lightning's ``zero_grad``): reduce
        the gradients of parameters outside any one stage, then add every bucket's summed shards to its
        masters' gradients and show them in ``.grad``, as :meth:`sync_now` does."""
        self._settle(block=True)
        self._sync([b for b in self.buckets if b.part is None], into_pending=True)
        for bucket in self.buckets:
            if bucket.pending is not None:
                self._accept_shards(bucket, bucket.pending)
                bucket.pending = None
        self._synced_since_step = True


__all__ = ["MicrobatchReduction"]
