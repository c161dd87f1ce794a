"""Shared pieces of the benchmarks: the model, the data, the clock, alternating rounds, the report.

Every comparison follows one protocol, so the ratios in ``benchmarks/results/`` mean the same:

* both sides train the **same model on the same data** for the same steps in the same
  processes (a :class:`tests.harness.WorkerPool`, spawned once);
* a *round* runs every side once, one fresh ``Trainer.fit`` (or raw loop) each; the sides'
  order rotates from round to round, so a load that drifts over the run hits each side alike;
* a side's figure in a round is its mean step time over the steps after warm-up (wall time
  from the end of the last warm-up step to the end of the last step: data loading, the
  Lightning loop and the optimizer included);
* the report gives the **median over rounds** of each side's step time and the median of the
  per-round ratios to the baseline (paired in time, so less sensitive to load swings);
* the machine's load average before and after is written next to the numbers.

Nothing here asserts a timing: the figures are for reading, never pass/fail.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

# The comparison model: a Llama-style transformer (RMSNorm, RoPE, SwiGLU), 4 layers,
# hidden 256, sequence 64, byte vocabulary.
BENCH_GPT = dict(preset="tiny", n_layer=4, n_embd=256, n_head=4, block_size=64)


def bench_gpt(**overrides: Any) -> L.LightningModule:
    """The benchmark transformer as a :class:`lightning_para.recipes.GPT` (no sampling, short warm-up)."""
    from lightning_para.recipes import GPT

    return GPT(**{**BENCH_GPT, "sample_tokens": 0, "warmup_steps": 2, **overrides})


class TokenDataset(Dataset):
    """Random byte tokens, ``(inputs, targets)`` shifted by one, the same for every side (seeded)."""

    def __init__(self, samples: int, seq_len: int = 64, vocab: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (samples, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


class TokenData(L.LightningDataModule):
    """``TokenDataset`` split over the strategy's data-parallel ranks (Lightning's own sampler
    kwargs, so DDP, FSDP2, ModelParallelStrategy and ParaStrategy each split it their way)."""

    def __init__(self, samples: int, batch_size: int, seq_len: int = 64, vocab_size: int = 256) -> None:
        super().__init__()
        self.samples, self.batch_size, self.seq_len, self.vocab_size = samples, batch_size, seq_len, vocab_size

    def train_dataloader(self) -> DataLoader:
        dataset = TokenDataset(self.samples, self.seq_len, self.vocab_size)
        strategy = self.trainer.strategy
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(dataset, shuffle=False, **kwargs)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


class StepClock(Callback):
    """Wall time per training step after ``warmup`` steps (end of one batch to the end of the next)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    @property
    def step_time(self) -> float:
        timed = self.ends[self.warmup - 1 :]
        if len(timed) < 2:
            raise RuntimeError(f"Only {len(self.ends)} steps ran; need more than warmup={self.warmup}.")
        return (timed[-1] - timed[0]) / (len(timed) - 1)


def quiet_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """A Trainer that only trains: no logger, checkpoints, progress bar, summary or validation."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    kwargs.update(overrides)
    return kwargs


# ---------------------------------------------------------------------- rounds and report
@dataclass
class Comparison:
    """Step times per side, one entry per round, and the baseline they are compared with."""

    title: str
    baseline: str
    times: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra_columns: dict[str, dict[str, str]] = field(default_factory=dict)  # column -> side -> text
    what: str = "step"  # what one timed unit is, for the column header
    paired: str = "alternating rounds"  # what the entries of a side are, paired by index with the baseline's

    def add(self, side: str, seconds: float) -> None:
        self.times.setdefault(side, []).append(seconds)

    def median(self, side: str) -> float:
        return statistics.median(self.times[side])

    def paired_ratio(self, side: str) -> float:
        """Median over rounds of ``side / baseline`` taken in the same round."""
        return statistics.median(a / b for a, b in zip(self.times[side], self.times[self.baseline]))

    def paired_quartiles(self, side: str) -> str:
        """The first and third quartiles of the paired ratios (how far one pair strays: the run's resolution)."""
        ratios = [a / b for a, b in zip(self.times[side], self.times[self.baseline])]
        if len(ratios) < 4:
            return ""
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return f"{q1:.3f}-{q3:.3f}"

    def markdown(self, target: Optional[dict[str, str]] = None) -> str:
        rounds = min(len(v) for v in self.times.values())
        extra = list(self.extra_columns)
        head = f"| side | median {self.what} ms | ratio of medians | median paired ratio | paired quartiles |"
        head += "".join(f" {c} |" for c in extra) + (" target |" if target else "")
        lines = [f"### {self.title}", "", f"{rounds} {self.paired}; baseline `{self.baseline}`.", "", head,
                 "|" + "---|" * (5 + len(extra) + (1 if target else 0))]
        base = self.median(self.baseline)
        for side in self.times:
            row = (f"| {side} | {1e3 * self.median(side):.1f} | {self.median(side) / base:.3f} |"
                   f" {self.paired_ratio(side):.3f} | {self.paired_quartiles(side)} |")
            row += "".join(f" {self.extra_columns[c].get(side, '')} |" for c in extra)
            if target:
                row += f" {target.get(side, '')} |"
            lines.append(row)
        lines += [""] + [f"* {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"


def alternate(
    sides: Sequence[str], rounds: int, run_side: Callable[[str], float], comparison: Comparison,
    log: Callable[[str], None] = print,
) -> Comparison:
    """Run every side once per round, the order rotated each round; record each side's step time."""
    for r in range(rounds):
        order = list(sides[r % len(sides):]) + list(sides[: r % len(sides)])
        for side in order:
            seconds = run_side(side)
            comparison.add(side, seconds)
            log(f"  round {r + 1}/{rounds} {side}: {1e3 * seconds:.1f} ms/step")
    return comparison


class Interleaved:
    """Several sides' training loops in one process, one running at a time, taking turns every ``block`` steps.

    Fits that alternate (:func:`alternate`) are seconds apart, and on a shared virtual machine the same code's
    step time drifts by tens of percent over seconds; here each side's block of steps is a fraction of a
    second from the other sides' blocks of the same turn. Each side runs in its own thread and calls
    :meth:`step_end` after every step (a Lightning side through :meth:`callback`); the turn passes in a fixed
    order, so every rank of a process group issues the same collectives in the same order. A block's figure
    is the mean of its steps after the first (the first one after a turn starts on caches the other side
    filled), wall time from one step's end to the next's; the first ``warmup`` steps of each side are not timed.
    Outside the main thread neither Lightning nor ParaStrategy installs its signal handlers (a one-time setup
    cost, not a step's).
    """

    def __init__(self, sides: Sequence[str], block: int, warmup: int) -> None:
        if block < 2:
            raise ValueError(f"`block={block}` must be at least 2: a block's first step is not timed.")
        self.sides, self.block, self.warmup = list(sides), block, warmup
        self.blocks: dict[str, list[float]] = {side: [] for side in sides}
        self._turn = 0
        self._done: set[int] = set()
        self._changed = threading.Condition()
        self._steps = dict.fromkeys(sides, 0)
        self._last: dict[str, float] = {}
        self._current: dict[str, list[float]] = {side: [] for side in sides}

    def callback(self, side: str) -> Callback:
        """A Lightning callback that ends ``side``'s steps here."""
        interleaved = self

        class _StepEnd(Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                interleaved.step_end(side)

        return _StepEnd()

    def step_end(self, side: str) -> None:
        now = time.perf_counter()
        self._steps[side] += 1
        step, position = self._steps[side], self._steps[side] % self.block
        if step > self.warmup and position != 1:
            self._current[side].append(now - self._last[side])
        self._last[side] = now
        if position == 0:
            if self._current[side]:
                self.blocks[side].append(statistics.fmean(self._current[side]))
            self._current[side] = []
            self._pass_turn(self.sides.index(side))
            self._last[side] = time.perf_counter()

    def run(self, loops: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
        """Run ``loops`` (side -> a function training that side to its end) taking turns; each side's block means."""
        errors: list[BaseException] = []

        def main(index: int, loop: Callable[[], Any]) -> None:
            try:
                self._wait_for_turn(index)
                loop()
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(error)
            finally:
                with self._changed:
                    self._done.add(index)
                self._pass_turn(index, wait=False)

        threads = [threading.Thread(target=main, args=(self.sides.index(side), loops[side]), name=f"side-{side}")
                   for side in self.sides]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return self.blocks

    def _wait_for_turn(self, index: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._turn == index)

    def _pass_turn(self, index: int, wait: bool = True) -> None:
        with self._changed:
            n = len(self.sides)
            following = [(index + k) % n for k in range(1, n + 1)]
            self._turn = next((i for i in following if i not in self._done), index)
            self._changed.notify_all()
        if wait:
            self._wait_for_turn(index)


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"{one:.2f} {five:.2f} {fifteen:.2f}"
    except OSError:
        return "unknown"


def machine_header(command: str, load_before: str, threads: str = "one intra-op thread per rank") -> str:
    """Where and under what load the figures were taken, for the top of a results file."""
    import lightning

    return "\n".join([
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} logical CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__},"
        f" lightning {lightning.__version__}; gloo on CPU, {threads}.",
        f"Load average (1/5/15 min) before: {load_before}; after: {load_average()}.",
        f"Taken {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
    ])


def wait_for_quiet(threshold: float, max_wait_s: float, log: Callable[[str], None] = print) -> None:
    """Wait (polling every 30 s, at most ``max_wait_s``) until the 1-minute load average is below ``threshold``."""
    deadline = time.time() + max_wait_s
    while os.getloadavg()[0] >= threshold and time.time() < deadline:
        log(f"load average {load_average()} >= {threshold}: waiting")
        time.sleep(30)
