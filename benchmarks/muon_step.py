"""Muon's training step and optimizer step against AdamW's at the same layout and width (lightning_para.optim.Muon).

Trains an MLP of ``--layers`` square ``--width`` matrices under ``ParaStrategy(zero=1)`` on ``--world`` gloo CPU
processes, ``--tokens`` rows per rank and step, once with ``lightning_para.optim.Muon`` and once with
``torch.optim.AdamW``, alternating over rounds. Two ratios to AdamW, measured in the same run:

* the **training step** (forward, backward, gradient reduction, optimizer step, ZeRO's all-gather): what a run
  pays, and what Megatron-FSDP's published 1.5-2.7x compares. Newton-Schulz costs about ``30 d^3`` FLOPs per
  ``d x d`` matrix, once per step on its owner, against ``6 tokens d^2`` for its forward and backward, so the
  ratio depends on the tokens per step: ``--tokens`` should be what a run would use (16384 per rank here, at
  the low end of GPU runs: nanochat puts 65536 on each GPU);
* the **optimizer step** alone (from ``on_before_optimizer_step``, gradients reduced, to the end of the batch:
  the step and ZeRO's all-gather), where Muon's Newton-Schulz meets AdamW's few elementwise passes.

Each is reported in wall time and in the CPU time of the rank's training thread (its compute: what a loaded
host stretches least). ``--ns-dtype float32`` (the default here) runs Newton-Schulz in float32
(``Muon(ns_dtype=torch.float32)``): torch's bfloat16 has no fast matmul on CPUs without bfloat16 instructions
(one 1024 x 1024 product 29 s against 0.16 s).

Run:  nice -n 5 python benchmarks/muon_step.py --world 2 --width 1024 --layers 2 --tokens 16384 --rounds 2 \
          --out benchmarks/results/muon_step_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import Comparison, alternate, load_average, machine_header  # noqa: E402
from tests.harness import WorkerPool  # noqa: E402
from tests.parity import trainer_kwargs  # noqa: E402


def _clocks() -> tuple[float, float]:
    """Wall time, and the CPU time of this thread: the rank's compute (one intra-op thread; gloo's waits run on
    its own threads), which a loaded host stretches far less than the wall time."""
    return time.perf_counter(), time.thread_time()


class _Timer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.step, self.total, self._t0, self._opt = warmup, [], [], (0.0, 0.0), (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = _clocks()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._opt = _clocks()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            now = _clocks()
            self.step.append([a - b for a, b in zip(now, self._opt)])
            self.total.append([a - b for a, b in zip(now, self._t0)])


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int, optimizer: str, ns_dtype: torch.dtype) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        self.optimizer, self.ns_dtype = optimizer, ns_dtype

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        if self.optimizer == "muon":
            from lightning_para.optim import Muon

            return Muon(self, lr=1e-3, ns_dtype=self.ns_dtype)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Rows(torch.utils.data.Dataset):
    """One random ``[tokens, width]`` batch, served ``length`` times (the data costs nothing)."""

    def __init__(self, length: int, tokens: int, width: int) -> None:
        self.length, self.rows = length, torch.randn(tokens, width)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows


def _run(width: int, layers: int, tokens: int, optimizer: str, ns_dtype: str, steps: int,
         warmup: int) -> list[float]:
    """Inside a worker: this rank's median optimizer-step and training-step seconds, wall and CPU."""
    import torch.distributed as dist

    from lightning_para import ParaStrategy

    torch.set_num_threads(1)
    timer = _Timer(warmup)
    data = _Rows(steps * dist.get_world_size(), tokens, width)
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=1), max_steps=steps,
                        callbacks=[timer], **trainer_kwargs())
    trainer.fit(MLP(width, layers, optimizer, getattr(torch, ns_dtype)),
                torch.utils.data.DataLoader(data, batch_size=None))
    return [statistics.median(s[k] for s in steps) for steps in (timer.step, timer.total) for k in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384, help="rows per rank and step")
    parser.add_argument("--ns-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_before = load_average()
    d, n = args.width, args.world
    title = (f"dp{n} ZeRO-1, {args.layers} x Linear({d}, {d}), {args.tokens} tokens per rank, "
             f"Newton-Schulz in {args.ns_dtype}")
    step = Comparison(f"Optimizer step: {title}", baseline="adamw", what="optimizer step")
    total = Comparison(f"Training step: {title}", baseline="adamw")
    step_cpu = Comparison(f"Optimizer step, CPU time: {title}", baseline="adamw", what="optimizer step CPU")
    total_cpu = Comparison(f"Training step, CPU time: {title}", baseline="adamw", what="step CPU")
    total.notes.append(f"FLOPs per rank and step: forward and backward {6 * args.tokens * d * d * args.layers:.3g}, "
                       f"Newton-Schulz {30 * d ** 3 * args.layers / n:.3g} (5 quintic steps on "
                       f"{args.layers / n:g} of the {args.layers} matrices): the FLOP ratio alone predicts {1 + 5 * d / (n * args.tokens):.3f}.")
    pool = WorkerPool(n)
    try:
        def run_side(side: str) -> float:
            seconds = pool.run(_run, d, args.layers, args.tokens, side, args.ns_dtype, args.steps, args.warmup)
            step_cpu.add(side, max(s[1] for s in seconds))
            total.add(side, max(s[2] for s in seconds))
            total_cpu.add(side, max(s[3] for s in seconds))
            return max(s[0] for s in seconds)

        alternate(["adamw", "muon"], args.rounds, run_side, step)
    finally:
        pool.close()
    report = machine_header(" ".join(["python", *sys.argv]), load_before) + "\n".join(
        c.markdown() for c in (total, total_cpu, step, step_cpu))
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
