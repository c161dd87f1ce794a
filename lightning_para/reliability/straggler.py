"""Straggler detection: name the rank every other rank waits for, with no collective or sync of its own
(``docs/reliability.md``, "Stragglers").

In a synchronous step every rank takes as long as the slowest (the others wait for it in a collective), so step
times name nobody; the work a rank does before it waits does. Each rank measures its *own time* per optimizer
step: from the step guard's check of the previous step (the gradients were synchronised: the ranks met) to the
start of this step's backward (whose gradient reduction waits at its end): its optimizer step, callbacks, data
loading and forward, on the host clock on CPU, between events on its stream on an accelerator (read once
complete). Every ``every_n_steps`` steps each rank puts its median own time into its slot of a world-sized vector
riding the step guard's all-reduce; a rank above ``factor`` x the median over ranks at ``patience`` consecutive
comparisons is named. Collectives inside the span (tp, cp, ep, ZeRO-3's all-gathers, pipeline sends) make a slow
rank's peers in those groups wait inside it: they look as slow, so its group is named (or nobody).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_para.mesh import ParallelDims
from lightning_para.reliability.spike_guard import option

_DIMS = (("pp", "pp stage"), ("dp", "dp rank"), ("tp", "tp rank"), ("ep", "ep rank"), ("cp", "cp rank"))


def mesh_coordinates(dims: ParallelDims, rank: int) -> str:
    """``"pp stage 0, dp rank 2, tp rank 0, ep rank 0, cp rank 0"``: where ``rank`` sits in the mesh."""
    return ", ".join(f"{label} {dims.coordinate(name, rank)}" for name, label in _DIMS)


class StragglerDetector:
    """Name a rank whose own time per step stays above ``factor`` x the median over ranks (module docstring).

    Args:
        factor: how many times the median over ranks makes a rank slow (> 1).
        patience: consecutive comparisons a rank must be slow at before it is named.
        every_n_steps: optimizer steps between comparisons (each compares the median own time since the last).
    """

    def __init__(self, factor: float = 1.5, patience: int = 3, every_n_steps: int = 5) -> None:
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 1 < factor < math.inf:
            raise ValueError(f"`straggler` factor={factor!r} must be a number > 1 (times the median over ranks).")
        for name, value in (("patience", patience), ("every_n_steps", every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`straggler` {name}={value!r} must be an int >= 1.")
        self.factor, self.patience, self.every_n_steps = float(factor), patience, every_n_steps
        # Called with every rank's figure (seconds) and the ranks named, at each comparison (the Trainer logs them).
        self.publish: Optional[Callable[[list[float], list[int]], None]] = None
        self.connect(torch.device("cpu"), 0, 1, str)

    def connect(self, device: torch.device, rank: int, world: int, describe: Callable[[int], str]) -> None:
        """Start a fit: this rank's clock on ``device``; ``describe(rank)`` names a rank's mesh coordinates."""
        self.device, self.rank, self.world, self.describe = torch.device(device), rank, world, describe
        self.figures: Optional[list[float]] = None  # every rank's median own time at the last comparison (seconds)
        self.stragglers: list[int] = []  # the ranks named now
        self.named_at: dict[int, int] = {}  # rank -> the step it was first named at, in its current episode
        self._own: list[float] = []  # own times since the last comparison (seconds), and the spans not read yet
        self._spans: list[tuple[Any, Any]] = []
        self._depart: Any = None  # marks: the last optimizer step's check (gradients synchronised), the last backward
        self._arrive: Any = None
        self._due = self.every_n_steps  # the first comparison's step
        self._streak = [0] * world

    # ---------------------------------------------------------------- the clock (no sync)
    def _mark(self) -> Any:
        if self.device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(self.device, enable_timing=True)
        event.record()
        return event

    def arrive(self) -> None:
        """A backward starts: this rank's own work of the step (since the last synchronisation) is done."""
        self._arrive = self._mark()

    def _read_spans(self) -> None:
        done = [(a, b) for a, b in self._spans if isinstance(b, float) or b.query()]  # events: once complete (no sync)
        self._own += [b - a if isinstance(b, float) else a.elapsed_time(b) / 1e3 for a, b in done]
        self._spans = [span for span in self._spans if span not in done]

    # ---------------------------------------------------------------- the step guard's rider
    def payload(self, step: int, stepping: bool) -> Optional[Tensor]:
        """An optimizer step's gradients are synchronised: close this step's span; at a comparison step, this rank's
        median own time in its slot of a world-sized vector (SUM)."""
        if not stepping or self.world < 2:
            return None
        if self._depart is not None and self._arrive is not None:
            self._spans.append((self._depart, self._arrive))
        self._depart, self._arrive = self._mark(), None
        if step < self._due:
            return None
        self._due = step + self.every_n_steps
        self._read_spans()
        vector = torch.zeros(self.world, device=self.device)
        if self._own:
            vector[self.rank] = statistics.median(self._own)
        self._own = []
        return vector

    def agreed(self, step: int, values: list[float]) -> None:
        """Every rank's figure (a step late): who is slow, for how long; rank 0 warns once per episode."""
        if len(values) != self.world:
            return
        known = [v for v in values if v > 0]
        if len(known) < 2:
            return
        median = statistics.median(known)
        for r, v in enumerate(values):
            self._streak[r] = self._streak[r] + 1 if v > self.factor * median else 0
        self.figures = values
        self.stragglers = [r for r in range(self.world) if self._streak[r] >= self.patience]
        self.named_at = {r: self.named_at.get(r, step) for r in self.stragglers}
        new = [r for r in self.stragglers if self.named_at[r] == step]
        if new and self.rank == 0:
            named = "; ".join(f"rank {r} ({self.describe(r)}): {1e3 * values[r]:.1f} ms, {values[r] / median:.2f}x" for r in new)
            warnings.warn(
                f"lightning-para: straggler at step {step}: {named} the median over ranks ({1e3 * median:.1f} ms) of the"
                f" work before each gradient synchronisation, at {self.patience} consecutive comparisons of"
                f" {self.every_n_steps} steps. Every other rank waits for it: look for a throttled or shared device, a slow"
                " host or data loader there (`ParaStrategy(straggler=False)` switches this off).", RuntimeWarning,
            )
        if self.publish is not None:
            self.publish(values, self.stragglers)


def straggler_option(value: Union[None, bool, Mapping[str, Any], StragglerDetector]) -> Optional[StragglerDetector]:
    """``ParaStrategy(straggler=...)``: ``True`` (the defaults), ``None``/``False`` (off), a mapping of
    :class:`StragglerDetector`'s arguments (YAML) or a :class:`StragglerDetector`."""
    return option("straggler", value, StragglerDetector)


__all__ = ["StragglerDetector", "mesh_coordinates", "straggler_option"]
