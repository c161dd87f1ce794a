"""Muon's optimizer step against AdamW's at the same layout and width (lightning_para.optim.Muon).

Trains an MLP of ``--layers`` square ``--width`` matrices under ``ParaStrategy(zero=1)`` on ``--world`` gloo CPU
processes, once with ``lightning_para.optim.Muon`` and once with ``torch.optim.AdamW``, alternating over rounds.
Times, per rank, from ``on_before_optimizer_step`` (gradients reduced) to the end of the batch: the optimizer
step and ZeRO's all-gather after it, the same for both. Reports the ratio to AdamW measured in the same run, and
the whole training step's ratio beside it.

Run:  python benchmarks/muon_step.py --world 2 --width 1024 --layers 4 --rounds 3 --out benchmarks/results/muon_step_cpu.md
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


class _Timer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.step, self.total, self._t0, self._opt = warmup, [], [], 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._opt = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            now = time.perf_counter()
            self.step.append(now - self._opt)
            self.total.append(now - self._t0)


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int, optimizer: str) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        if self.optimizer == "muon":
            from lightning_para.optim import Muon

            return Muon(self, lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _run(width: int, layers: int, optimizer: str, steps: int, warmup: int) -> tuple[float, float]:
    """Inside a worker: median optimizer-step and training-step seconds of this rank."""
    import torch.distributed as dist

    from lightning_para import ParaStrategy

    torch.set_num_threads(1)
    timer = _Timer(warmup)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 8, width))
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=ParaStrategy(zero=1), max_steps=steps,
                        callbacks=[timer], **trainer_kwargs())
    trainer.fit(MLP(width, layers, optimizer), torch.utils.data.DataLoader(data, batch_size=8))
    return statistics.median(timer.step), statistics.median(timer.total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_before = load_average()
    title = f"dp{args.world} ZeRO-1, {args.layers} x Linear({args.width}, {args.width}), batch 8 per rank"
    step = Comparison(f"Optimizer step: {title}", baseline="adamw", what="optimizer step")
    total = Comparison(f"Training step: {title}", baseline="adamw")
    pool = WorkerPool(args.world)
    try:
        def run_side(side: str) -> float:
            seconds = pool.run(_run, args.width, args.layers, side, args.steps, args.warmup)
            total.add(side, max(s[1] for s in seconds))
            return max(s[0] for s in seconds)

        alternate(["adamw", "muon"], args.rounds, run_side, step)
    finally:
        pool.close()
    report = machine_header(" ".join(["python", *sys.argv]), load_before) + step.markdown() + "\n" + total.markdown()
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
