"""What the reliability features of issue 14 cost, as step-time ratios to a baseline in the same run.

Runs the GPT recipe (``preset="tiny"``) on ``TextDataModule`` in a pool of real gloo processes,
one variant after another within each round, for several rounds (alternating, so drift from other
jobs on the machine hits every variant alike). A variant's figure is the median over rounds of its
ratio to the baseline *of the same round* (each fit's median step time), so slow drift between
rounds cancels; the spread of those per-round ratios is reported beside it.

    python benchmarks/reliability_overhead.py --world 4 --dp 2 --tp 2 --steps 25 --rounds 7

Variants (``baseline``: every feature off, a plain ``DataLoader`` + ``DistributedSampler``,
``self.log`` without ``sync_dist``):

* ``watchdog``: ``watchdog_timeout=60`` (the default);
* ``resumable_loader``: the recipes' ``ResumableDataLoader``;
* ``sync_dist_logging``: ``train_loss`` logged with ``sync_dist=True`` (one scalar all-reduce per step);
* ``integrity_every_10`` / ``integrity_every_1``: ``integrity_check_every_n_steps`` 10 and 1;
* ``straggler``: straggler detection (the default: one comparison every 5 steps riding the step guard);
* ``spike_guard``: the spike guard in skip mode (the recipe's AdamW is not fused: one host read per step);
* ``defaults``: what ParaStrategy and the recipes do now (watchdog, resumable loader, sync_dist, straggler).

Checkpoint saves are timed separately: the atomic save (hidden sibling, barriers, marker,
exchange) against writing the same DCP directory straight into place (the old behaviour).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS: dict[str, dict] = {
    "baseline": {},
    "watchdog": {"watchdog": True},
    "resumable_loader": {"resumable": True},
    "sync_dist_logging": {"sync_dist": True},
    "integrity_every_10": {"integrity": 10},
    "integrity_every_1": {"integrity": 1},
    "straggler": {"straggler": True},
    "spike_guard": {"spike_guard": "skip"},
    "defaults": {"watchdog": True, "resumable": True, "sync_dist": True, "straggler": True},
}


def run_variant(layout: dict, options: dict, steps: int) -> list[float]:
    """Inside every worker: fit ``steps`` steps; rank 0's step times after 5 warm-up steps."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_para import ParaStrategy
    from lightning_para.recipes import GPT, TextDataModule

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.ends.append(time.perf_counter())

    class Model(GPT):
        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = self.loss_fn(self(inputs), targets)
            self.log("train_loss", loss, sync_dist=bool(options.get("sync_dist")))
            return loss

    class Data(TextDataModule):
        def train_dataloader(self):
            if options.get("resumable"):
                return super().train_dataloader()
            self.setup()
            kwargs = self.trainer.strategy.distributed_sampler_kwargs
            sampler = DistributedSampler(self.splits["train"], shuffle=True, seed=self.seed, drop_last=True, **kwargs)
            return DataLoader(self.splits["train"], batch_size=self.per_rank_batch_size(), sampler=sampler, drop_last=True)

    clock = Clock()
    strategy = ParaStrategy(
        **layout, watchdog_timeout=60.0 if options.get("watchdog") else None,
        integrity_check_every_n_steps=options.get("integrity"), straggler=bool(options.get("straggler")),
        spike_guard=options.get("spike_guard"),
    )
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock], log_every_n_steps=1,
    )
    trainer.fit(Model(sample_tokens=0), datamodule=Data(max_bytes=500_000, seq_len=64, global_batch_size=16))
    return [b - a for a, b in zip(clock.ends, clock.ends[1:])][5:]


def time_saves(layout: dict, rounds: int, folder: str) -> dict[str, list[float]]:
    """Inside every worker: alternate an atomic save of the trained model's checkpoint and a direct write."""
    import lightning as L
    import torch.distributed as dist

    from lightning_para import ParaStrategy
    from lightning_para.checkpoint import save as ckpt_save
    from lightning_para.checkpoint.format import save_sharded
    from lightning_para.recipes import GPT, TextDataModule

    strategy = ParaStrategy(**layout, watchdog_timeout=None)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=2,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(GPT(sample_tokens=0), datamodule=TextDataModule(max_bytes=200_000, seq_len=64, global_batch_size=16))
    times: dict[str, list[float]] = {"atomic": [], "direct": []}
    for i in range(rounds):
        for name in ("direct", "atomic"):
            checkpoint = trainer._checkpoint_connector.dump_checkpoint()
            dist.barrier()
            start = time.perf_counter()
            if name == "atomic":
                token = strategy.broadcast(f"bench{i}")
                ckpt_save.save_checkpoint(Path(folder) / "last.ckpt", checkpoint, token=token)
            else:
                tensors = {"state_dict": checkpoint.pop("state_dict")}
                for j, state in enumerate(checkpoint.pop("optimizer_states", [])):
                    tensors[f"optimizer_{j}"] = state
                save_sharded(Path(folder) / f"direct{i}.ckpt", tensors, checkpoint)
                dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.harness import WorkerPool

    layout = {"dp": args.dp, "tp": args.tp, "pp": args.pp}
    pool = WorkerPool(args.world)
    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        for _ in range(args.rounds):
            for name, options in VARIANTS.items():
                times = pool.run(run_variant, layout, options, args.steps, timeout=1800)[0]
                per_round[name].append(statistics.median(times))
        with tempfile.TemporaryDirectory() as folder:
            saves = pool.run(time_saves, layout, 2 * args.rounds + 1, folder, timeout=1800)[0]
    finally:
        pool.close()
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    base = medians["baseline"]
    lines = [
        f"Reliability overhead, GPT tiny (4 layers, d=128), world={args.world} {layout}, {args.steps} steps per fit,"
        f" {args.rounds} alternating rounds. Ratio: median over rounds of (variant / baseline of the same round),"
        " each fit's median step time after 5 warm-up steps.",
        "",
        "| variant | median step ms | ratio to baseline | per-round ratios (min - max) |",
        "|---|---|---|---|",
    ]
    for name, median in medians.items():
        ratios = [v / b for v, b in zip(per_round[name], per_round["baseline"])]
        lines.append(f"| {name} | {1e3 * median:.1f} | {statistics.median(ratios):.3f} | {min(ratios):.2f} - {max(ratios):.2f} |")
    atomic, direct = statistics.median(saves["atomic"]), statistics.median(saves["direct"])
    lines += [
        "",
        "| checkpoint save (same state) | median s | ratio |",
        "|---|---|---|",
        f"| direct DCP write into place (before issue 14) | {direct:.3f} | 1.000 |",
        f"| atomic (sibling, barriers, marker, exchange, delete the old) | {atomic:.3f} | {atomic / direct:.3f} |",
        "",
        f"A save costs {atomic / base:.1f} baseline steps here (atomic) against {direct / base:.1f} (direct).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"per_round": per_round, "saves": saves, "layout": layout}, indent=1))


if __name__ == "__main__":
    main()
