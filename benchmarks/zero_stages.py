"""ZeRO stages side by side with Lightning's own DDP and FSDP2 (ModelParallelStrategy) strategies.

For each strategy, trains the same MLP for a few steps on ``--world`` CPU processes (gloo)
and reports, per rank:

* the median step time as a **ratio to Lightning's DDP measured in the same run** (never an
  absolute pass/fail number: CPU timings move with the machine's load);
* the bytes of parameters, gradients and optimizer state held (from
  ``ParaStrategy.memory_breakdown()``; counted directly for Lightning's strategies);
* the bytes passed to collectives per optimizer step (a dispatch-mode counter).

Run:  python benchmarks/zero_stages.py --world 2 --hidden 512 --steps 12
Writes a Markdown table to stdout and, with --out, to a file.
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
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from tests.comm_counter import CollectiveCounter  # noqa: E402
from tests.harness import WorkerPool  # noqa: E402
from tests.models import RegressionNet, regression_dataset  # noqa: E402
from tests.parity import ShardedData, trainer_kwargs  # noqa: E402


class _Timer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.counter = warmup, [], CollectiveCounter()
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.counter.__enter__()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)
        if batch_idx == trainer.max_steps - 1:
            self.counter.__exit__(None, None, None)
            # Measured at the end of the last step, before Lightning's teardown frees anything.
            if hasattr(trainer.strategy, "memory_breakdown"):
                breakdown = trainer.strategy.memory_breakdown()
                self.memory = {k: getattr(breakdown, k) for k in ("params", "grads", "optimizer")}
            else:
                self.memory = _bytes(pl_module, trainer.optimizers[0])


def _bytes(module, optimizer) -> dict:
    seen = set()

    def nbytes(t):
        if t is None:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return 0
        seen.add(key)
        return t.numel() * t.element_size()

    return {
        "params": sum(nbytes(p.data) for p in module.parameters()),
        "grads": sum(nbytes(p.grad) for p in module.parameters()),
        "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


class _FSDP2Net(RegressionNet):
    """Lightning's documented ModelParallelStrategy recipe: FSDP2 applied in `configure_model`."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.body, self.head]:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)


def _run(name: str, hidden: int, steps: int, batch: int) -> dict:
    from lightning_para import ParaStrategy

    world = dist.get_world_size()
    if name.startswith("para"):
        strategy = ParaStrategy(zero=int(name[-1]))
    elif name == "lightning-ddp":
        strategy = "ddp"
    else:  # Lightning's FSDP strategy needs a GPU; its ModelParallelStrategy runs FSDP2 anywhere
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    timer = _Timer(warmup=2)
    L.seed_everything(0, verbose=False)
    net = _FSDP2Net if name == "lightning-modelparallel-fsdp2" else RegressionNet
    module = net(d_in=hidden, d_hidden=hidden, d_out=hidden, depth=4)
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[timer],
                        use_distributed_sampler=False, **trainer_kwargs(gradient_clip_val=1.0))
    data = ShardedData(lambda: regression_dataset(batch * steps * world, d_in=hidden, d_out=hidden), batch)
    trainer.fit(module, datamodule=data)
    return {"step": statistics.median(timer.times), "memory": timer.memory,
            "comm": timer.counter.total / max(len(timer.times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["lightning-ddp", "para-zero0", "para-zero1", "para-zero2", "para-zero3", "lightning-modelparallel-fsdp2"]
    pool = WorkerPool(args.world)
    try:
        results = {n: pool.run(_run, n, args.hidden, args.steps, args.batch, timeout=1200)[0] for n in names}
    finally:
        pool.close()
    psi = sum(p.numel() for p in RegressionNet(d_in=args.hidden, d_hidden=args.hidden, d_out=args.hidden, depth=4).parameters())
    base = results["lightning-ddp"]["step"]
    lines = [
        f"ZeRO stages vs Lightning strategies: {args.world} CPU processes (gloo), MLP with {psi:,} parameters"
        f" (psi = {4 * psi / 2**20:.2f} MiB fp32), AdamW, per-rank batch {args.batch}, median of {args.steps - 2} steps.",
        "",
        "| strategy | step time / Lightning DDP | params MiB | grads MiB | optimizer MiB | comm per step / psi |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        r = results[n]
        m = {k: v / 2**20 for k, v in r["memory"].items()}
        lines.append(
            f"| {n} | {r['step'] / base:.2f} | {m['params']:.2f} | {m['grads']:.2f} | {m['optimizer']:.2f} |"
            f" {r['comm'] / (4 * psi):.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
