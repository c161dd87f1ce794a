"""How long a checkpoint save blocks the training loop: ``ParaStrategy(async_save=True)`` against a synchronous save.

dp=2 ZeRO-1 on CPU (two gloo processes), an MLP of ``--layers`` square Linear layers of width ``--width`` trained
with Adam: each rank's checkpoint holds the whole model (replicated) and its half of Adam's two moments, 8 bytes per
parameter, 1.0 GiB at the defaults. A callback saves every ``--every`` steps with ``trainer.save_checkpoint`` (and
removes the previous one, as ``ModelCheckpoint(save_top_k=1)`` does) and times the call: what the loop waits for.
The same fit runs synchronously and asynchronously, alternating, ``--rounds`` times.

    python benchmarks/async_checkpoint.py --out benchmarks/results/async_checkpoint_cpu.md

Asynchronously, a save waits for staging (a copy of the tensors into host memory) and for the previous save if it
is still being written; the write, checksums, marker and swap run in the background, competing with training for
the CPU (reported as the step time while a write is in flight).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fit_and_save(folder: str, async_save: bool, width: int, layers: int, steps: int, every: int) -> dict:
    """Inside every worker: fit, saving every ``every`` steps; the time each save blocked the loop."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_para import ParaStrategy

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = self.net(x).square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Saves(Callback):
        def __init__(self) -> None:
            self.blocked: list[float] = []
            self.step_ends: list[tuple[int, float]] = []
            self.previous = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if step % every == 0:
                path = Path(folder) / f"step={step}.ckpt"
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                if self.previous is not None:
                    trainer.strategy.remove_checkpoint(self.previous)  # after the new one is complete
                self.blocked.append(time.perf_counter() - start)
                self.previous = path
            self.step_ends.append((step, time.perf_counter()))

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * (steps + 1), width))
    saves = Saves()
    strategy = ParaStrategy(dp=2, zero=1, async_save=async_save, watchdog_timeout=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps, callbacks=[saves],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(MLP(), DataLoader(data, batch_size=4))
    total = time.perf_counter() - start
    saver = strategy.core.checkpoints.saver
    staged = saver.staged_bytes if saver is not None else 0
    steps_s = [b - a for (_, a), (_, b) in zip(saves.step_ends, saves.step_ends[1:])]
    return {"blocked": saves.blocked, "steps": steps_s, "fit": total, "staged": staged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.harness import WorkerPool

    params = args.layers * (args.width * args.width + args.width)
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    pool = WorkerPool(2)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            for r in range(args.rounds):
                for name in ("sync", "async"):
                    folder = str(Path(root) / f"{name}{r}")
                    out = pool.run(fit_and_save, folder, name == "async", args.width, args.layers, args.steps, args.every,
                                   timeout=3600)
                    results[name].append(out[0])
    finally:
        pool.close()
    blocked = {name: [b for run in runs for b in run["blocked"]] for name, runs in results.items()}
    # The first async save also makes the save group and allocates the staging copy: reported, not in the median.
    later = {name: [b for run in runs for b in run["blocked"][1:]] for name, runs in results.items()}
    median = {name: statistics.median(values) for name, values in later.items()}
    staged = results["async"][0]["staged"]
    step = {name: statistics.median([s for run in runs for s in run["steps"]]) for name, runs in results.items()}
    lines = [
        f"Checkpoint saves blocking the loop, dp=2 ZeRO-1 on CPU (gloo), MLP {args.layers} x {args.width}^2 ="
        f" {params / 1e6:.0f}M parameters with Adam: {8 * params / 2**30:.2f} GiB of checkpoint state per rank"
        f" (async_save staged {staged / 2**30:.2f} GiB per rank). A save every {args.every} steps, {args.steps} steps,"
        f" {args.rounds} alternating rounds; each save's blocked time is the `trainer.save_checkpoint` call.",
        "",
        "| save | blocked per save, median of later saves (s) | first save (s) | every save (s) | median step (s) |",
        "|---|---|---|---|---|",
    ]
    for name in ("sync", "async"):
        firsts = ", ".join(f"{run['blocked'][0]:.2f}" for run in results[name])
        every = ", ".join(f"{b:.2f}" for b in blocked[name])
        lines.append(f"| {name} | {median[name]:.3f} | {firsts} | {every} | {step[name]:.3f} |")
    ratio = median["sync"] / median["async"]
    lines += ["", f"The loop is blocked {ratio:.1f}x less per save with async_save=True (sync {median['sync']:.3f} s,"
              f" async {median['async']:.3f} s per save)."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
