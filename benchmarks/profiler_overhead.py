"""What ParaProfiler costs: step time with it off, at its defaults, and tracing every step.

Runs the tiny GPT recipe in a pool of real gloo processes three or four times with the same
data and seed and reports each variant's median step time as a ratio to a run without the
callback, measured in the same invocation (timings on a shared machine drift; ratios less).

    python benchmarks/profiler_overhead.py --world 4 --pp 2 --steps 60

* ``none``: no ParaProfiler (the baseline);
* ``off``: ParaProfiler with every sampled feature off (what "keep overhead low" promises);
* ``default``: the CLI's defaults (comm traced 1 step in 25, timeline 1 in 25, memory rarely);
* ``every``: comm tracing and timeline on every step (the worst case; traced steps serialise
  their collectives, see docs/profiling.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "none": None,
    "off": {"comm_every_n_steps": 0, "memory_every_n_steps": 0, "timeline_every_n_steps": 0},
    "default": {},
    "every": {"comm_every_n_steps": 1, "timeline_every_n_steps": 1, "memory_every_n_steps": 0},
}


def run_variant(strategy_kwargs: dict, profiler_kwargs, steps: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_para import ParaStrategy
    from lightning_para.recipes.data import TextDataModule
    from lightning_para.observe.profiler import ParaProfiler
    from lightning_para.recipes.gpt import GPT

    class StepClock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.ends.append(time.perf_counter())

    import torch.distributed as dist

    clock = StepClock()
    callbacks = [clock] + ([ParaProfiler(**profiler_kwargs)] if profiler_kwargs is not None else [])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, log_every_n_steps=5,
    )
    trainer.fit(GPT(sample_tokens=0), datamodule=TextDataModule(max_bytes=500_000, seq_len=64, global_batch_size=16))
    return [b - a for a, b in zip(clock.ends, clock.ends[1:])][5:]  # skip warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.harness import WorkerPool

    strategy_kwargs = {"pp": args.pp, "zero": args.zero}
    pool = WorkerPool(args.world)
    medians = {}
    try:
        for name, kwargs in VARIANTS.items():
            times = pool.run(run_variant, strategy_kwargs, kwargs, args.steps, timeout=900)[0]
            medians[name] = statistics.median(times)
    finally:
        pool.close()
    lines = [
        f"ParaProfiler overhead, tiny GPT, world={args.world} {strategy_kwargs}, {args.steps} steps (median step time)",
        "",
        "| variant | median step ms | ratio to no profiler |",
        "|---|---|---|",
    ]
    for name, median in medians.items():
        lines.append(f"| {name} | {1e3 * median:.1f} | {median / medians['none']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
