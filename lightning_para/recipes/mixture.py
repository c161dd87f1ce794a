"""A weighted mixture of sample sources, as a pure function of the global sample position.

Position ``g`` of the training stream is draw ``k`` of source ``d``; both follow from ``(seed, g)`` alone:

* positions are cut into blocks of ``B`` samples (1,024, or more for a weight below 1/1,024). The first ``b``
  blocks hold ``w_d * b * B`` samples of source ``d``, rounded by largest remainders so the counts add up: the
  realised share is the weight to within one sample at every block boundary. Inside a block the sources' samples
  come in a seeded random order.
* Draw ``k`` of a source of ``n`` samples is sample ``perm_e[k % n]`` of its pass ``e = k // n``: a permutation
  seeded by the seed, the source's name and the pass. A source that runs out starts its next pass (``repeat``),
  or (``stop``) the epoch ends where the first source runs out and every source starts a new pass the next epoch.

Why a function and not a stateful sampler (LitData, MosaicML Streaming): the resume state is then one number, the
global sample position, which is the same at any data-parallel degree or micro-batch, and every source's position
follows from it. Megatron's ``BlendedDataset`` index is the same idea, precomputed for the whole run; here a
block is computed when it is read. A mixture changed on resume (a weight, a source) continues from every source's
position under the new weights only when asked (:meth:`Mixture.resume`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

BLOCK = 1024
EXHAUSTED = ("repeat", "stop")
ON_CHANGE = ("error", "restart_mixture")


@dataclass(frozen=True)
class Segment:
    """Positions from ``start`` on follow the block order from scratch, after ``offsets[d]`` draws of source ``d``;
    ``order`` seeds the blocks (0 for every epoch of ``stop``, so each has the length of the first)."""

    start: int
    offsets: tuple[int, ...]
    order: int = 0


class Mixture:
    """Sources ``names`` of ``sizes`` samples, drawn in proportion to ``weights`` (any positive numbers).

    ``locate(g)`` is ``(source, sample)`` of stream position ``g``; ``epoch_samples`` is a training epoch
    (``repeat``: the sources' samples together; ``stop``: up to the first source's last sample).
    """

    def __init__(
        self, names: Sequence[str], weights: Sequence[float], sizes: Sequence[int], *, seed: int = 0,
        shuffle: bool = True, exhausted: str = "repeat",
    ) -> None:
        if exhausted not in EXHAUSTED:
            raise ValueError(f"`data.exhausted={exhausted!r}` must be one of {EXHAUSTED}.")
        for name, weight, size in zip(names, weights, sizes):
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"`data.sources[{name!r}]` has weight {weight!r}; weights must be positive numbers.")
            if size < 1:
                raise ValueError(f"`data.sources[{name!r}]` holds no training sequence; prepare more text or lower `data.seq_len`.")
        self.names = tuple(names)
        self.weights = np.asarray(weights, dtype=np.float64) / float(sum(weights))
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.seed, self.shuffle, self.exhausted = int(seed) % 2**63, shuffle, exhausted
        self.block = max(BLOCK, math.ceil(1 / self.weights.min()))  # every source in every block: counts never fall
        self.restart: Optional[Segment] = None
        self._zero = Segment(0, (0,) * len(self.names))
        self._blocks: dict[tuple[int, int], np.ndarray] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.epoch_samples = int(self.sizes.sum()) if exhausted == "repeat" else min(
            self._position_of_draw(d, int(n)) for d, n in enumerate(self.sizes)
        )

    # -- the order -------------------------------------------------------------------------------------------
    def _cumulative(self, blocks: int) -> np.ndarray:
        """Draws of each source in the first ``blocks`` blocks of a segment (largest remainders of the weights)."""
        exact = self.weights * (blocks * self.block)
        counts = np.floor(exact).astype(np.int64)
        short = blocks * self.block - int(counts.sum())
        counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
        return counts

    def _block(self, order: int, b: int) -> np.ndarray:
        """Block ``b`` of a segment of block order ``order``: the source of each of its positions."""
        key = (order, b)
        if key not in self._blocks:
            if len(self._blocks) > 16:
                self._blocks.clear()
            counts = self._cumulative(b + 1) - self._cumulative(b)
            rng = np.random.default_rng([self.seed, order, b])
            self._blocks[key] = rng.permutation(np.repeat(np.arange(len(self.names)), counts))
        return self._blocks[key]

    def _segment(self, g: int) -> Segment:
        restart, length = self.restart, self.epoch_samples
        if restart is not None and g >= restart.start and (self.exhausted == "repeat" or g // length == restart.start // length):
            return restart
        if self.exhausted == "stop":  # each epoch: every source on its next pass, from its start
            epoch = g // length
            return Segment(epoch * length, tuple(int(n) * epoch for n in self.sizes))
        return self._zero

    def draws(self, g: int) -> np.ndarray:
        """Draws of each source before stream position ``g`` (its position within the source)."""
        segment = self._segment(g)
        b, j = divmod(g - segment.start, self.block)
        seen = np.bincount(self._block(segment.order, b)[:j], minlength=len(self.names))
        return np.asarray(segment.offsets, dtype=np.int64) + self._cumulative(b) + seen

    def locate(self, g: int) -> tuple[int, int]:
        """``(source, sample)``: position ``g`` is sample ``sample`` of source ``source``."""
        segment = self._segment(g)
        b, j = divmod(g - segment.start, self.block)
        block = self._block(segment.order, b)
        d = int(block[j])
        draw = segment.offsets[d] + int(self._cumulative(b)[d]) + int(np.count_nonzero(block[:j] == d))
        epoch, index = divmod(draw, int(self.sizes[d]))
        return d, int(self._permutation(d, epoch)[index]) if self.shuffle else index

    def _permutation(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key not in self._perms:
            for old in [k for k in self._perms if k[0] == d and k[1] < epoch - 1]:
                del self._perms[old]  # a source needs its current pass and the next (a block may wrap it)
            rng = np.random.default_rng([self.seed, zlib.crc32(self.names[d].encode()), epoch])
            self._perms[key] = rng.permutation(int(self.sizes[d]))
        return self._perms[key]

    def _position_of_draw(self, d: int, m: int) -> int:
        """The position of source ``d``'s draw ``m`` in a segment from scratch (``stop``'s epoch length)."""
        lo, hi = 0, math.ceil((m + 1) / (self.weights[d] * self.block)) + 1
        while lo < hi:  # the first block whose end holds more than m draws of d
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self._cumulative(mid + 1)[d] <= m else (lo, mid)
        return lo * self.block + int(np.flatnonzero(self._block(0, lo) == d)[m - self._cumulative(lo)[d]])

    def proportions(self, start: int, stop: int) -> dict[str, float]:
        """Each source's share of the positions ``[start, stop)``."""
        counts = self.draws(stop) - self.draws(start)
        return {name: float(c) / max(stop - start, 1) for name, c in zip(self.names, counts)}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_blocks": {}, "_perms": {}}  # DataLoader workers recompute what they read

    # -- resume ----------------------------------------------------------------------------------------------
    def state(self, g: int) -> dict[str, Any]:
        """What a checkpoint needs: the mixture, its restart point, and every source's position at ``g``."""
        draws = self.draws(g)
        return {
            "exhausted": self.exhausted, "seed": self.seed, "shuffle": self.shuffle,
            "sources": {n: {"weight": float(w), "samples": int(s), "draws": int(k)}
                        for n, w, s, k in zip(self.names, self.weights, self.sizes, draws)},
            "restart": None if self.restart is None else {"start": self.restart.start, "offsets": list(self.restart.offsets)},
        }

    def changes(self, saved: dict[str, Any]) -> list[str]:
        """How this mixture differs from a checkpoint's (an empty list: none)."""
        before = saved["sources"]
        out = [f"`data.{key}` was {saved[key]!r}, now {now!r}" for key, now in
               (("exhausted", self.exhausted), ("seed", self.seed), ("shuffle", self.shuffle)) if saved[key] != now]
        for name, weight, size in zip(self.names, self.weights, self.sizes):
            old = before.get(name)
            if old is None:
                out.append(f"source {name!r} was added")
            elif not math.isclose(old["weight"], weight, rel_tol=1e-9):
                out.append(f"source {name!r} has weight {weight:.4g} (share), {old['weight']:.4g} in the checkpoint")
            elif old["samples"] != size:
                out.append(f"source {name!r} has {size} sequences, {old['samples']} in the checkpoint")
        out += [f"source {name!r} was removed" for name in before if name not in self.names]
        return out

    def check(self, saved: dict[str, Any], on_change: str) -> list[str]:
        """The changes since a checkpoint's mixture; ``ValueError`` naming them unless ``restart_mixture``."""
        changes = self.changes(saved)
        if changes and on_change != "restart_mixture":
            raise ValueError(
                f"The checkpoint's data mixture differs from this one: {'; '.join(changes)}. Resuming would put the"
                " sources at other positions than the checkpoint's. Restore the mixture, or set"
                " `data.on_mixture_change='restart_mixture'` to continue every source from its saved position"
                " under the new weights."
            )
        return changes

    def resume(self, saved: dict[str, Any], g: int, on_change: str) -> None:
        """Continue a checkpoint's stream at position ``g``; a changed mixture raises (:meth:`check`), or with
        ``restart_mixture`` starts its block order at ``g``, every source where the checkpoint left it (a new one
        at its start)."""
        if self.check(saved, on_change):
            draws = {name: s["draws"] for name, s in saved["sources"].items()}
            self.restart = Segment(g, tuple(int(draws.get(name, 0)) for name in self.names), order=g + 1)
        else:
            restart = saved["restart"]
            self.restart = None if restart is None else Segment(restart["start"], tuple(restart["offsets"]), restart["start"] + 1)
        self._blocks.clear()


__all__ = ["EXHAUSTED", "Mixture", "ON_CHANGE", "Segment"]
