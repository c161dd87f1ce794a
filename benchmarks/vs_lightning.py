"""ParaStrategy against Lightning's own strategies and a raw PyTorch loop, on one transformer.

The model is :data:`benchmarks.common.BENCH_GPT` (Llama-style, 4 layers, hidden 256, seq 64,
AdamW with two parameter groups and a warm-up/cosine schedule), the data random byte tokens;
the protocol (alternating rounds, medians, ratios in the same run) is in
:mod:`benchmarks.common`. Suites, each in its own pool of ``world`` gloo processes:

* ``single`` (1 process): ``raw-loop`` (plain PyTorch), ``lightning-default`` (``strategy="auto"``,
  i.e. SingleDeviceStrategy) and ``para`` (``ParaStrategy()`` at ``devices=1``).
* ``ddp`` (2): ``lightning-ddp`` against ``para-zero0/1/2`` and Lightning DDP with torch's
  ``ZeroRedundancyOptimizer`` (``lightning-ddp-zero-redundancy``: DDP's all-reduce, then each
  rank steps its share of the parameters and broadcasts them).
* ``fsdp`` (2): ``lightning-fsdp2`` (``ModelParallelStrategy`` with Lightning's documented
  FSDP2 recipe: ``configure_model`` gives each block ``fully_shard``, then the root) against
  ``para-zero3`` (``zero3_units="auto"``, which picks Lightning's units for this model) and
  ``para-zero3-blocks_and_ends`` (the embedding and the head in units of their own).
* ``tp`` (2): ``lightning-tp`` (``ModelParallelStrategy``, a hand-written plan as in
  Lightning's tensor-parallel examples: colwise q/k/v/fc/gate, rowwise projections, a
  row-parallel embedding and a replicated-output head) against ``para-tp2``.

    python benchmarks/vs_lightning.py --suites single ddp fsdp tp --rounds 5 --steps 14 \
        --out benchmarks/results/vs_lightning_cpu.md

``--profile SIDE`` instead runs that side once under ``cProfile`` on every rank and prints the
heaviest functions of rank 0 (what the optimization work in issue 17 started from).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Comparison,
    Interleaved,
    StepClock,
    TokenData,
    TokenDataset,
    alternate,
    bench_gpt,
    load_average,
    machine_header,
    quiet_trainer_kwargs,
    wait_for_quiet,
)
from lightning_para.recipes import GPT  # noqa: E402

SUITES = {
    "single": (1, "lightning-default", ["lightning-default", "raw-loop", "para"]),
    "ddp": (2, "lightning-ddp", ["lightning-ddp", "para-zero0", "para-zero1", "para-zero2", "lightning-ddp-zero-redundancy"]),
    "fsdp": (2, "lightning-fsdp2", ["lightning-fsdp2", "para-zero3", "para-zero3-blocks_and_ends"]),
    "tp": (2, "lightning-tp", ["lightning-tp", "para-tp2"]),
}
TARGETS = {  # the performance issue's acceptance: ratios to Lightning's strategy for the same semantics
    "single": {"para": "<= 1.00"},
    "ddp": {"para-zero0": "<= 1.00", "para-zero1": "<= 1.05", "para-zero2": "<= 1.05"},
    "fsdp": {"para-zero3": "<= 1.00"},
    "tp": {"para-tp2": "<= 1.00"},
}

# ---------------------------------------------------------------------- Lightning's recipes
def _fsdp2_gpt(**kwargs):
    """Lightning's FSDP2 recipe for ``ModelParallelStrategy``: every block, then the root."""
    from torch.distributed.fsdp import fully_shard

    class FSDP2GPT(GPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    return FSDP2GPT(**{**_gpt_kwargs(), **kwargs})


def _tp_gpt(**kwargs):
    """A hand-written tensor-parallel plan in the style of Lightning's examples."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class HandTPGPT(GPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh["tensor_parallel"]
            parallelize_module(self, mesh, {
                "embed.wte": RowwiseParallel(input_layouts=Replicate()),
                "head.lm_head": ColwiseParallel(output_layouts=Replicate()),
            })
            for block in self.blocks:
                parallelize_module(block, mesh, {
                    "attn.c_q": ColwiseParallel(), "attn.c_k": ColwiseParallel(), "attn.c_v": ColwiseParallel(),
                    "attn.c_proj": RowwiseParallel(),
                    "mlp.c_fc": ColwiseParallel(), "mlp.c_gate": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
                })

    return HandTPGPT(**{**_gpt_kwargs(), **kwargs})


def _zero_redundancy_gpt():
    """Lightning DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` around the same AdamW."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ZeroRedundancyGPT(GPT):
        def configure_optimizers(self):
            config = super().configure_optimizers()  # the recipe's AdamW groups and schedule
            inner, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in inner.param_groups]
            optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=self.hparams.lr,
                                                betas=tuple(self.hparams.betas))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return ZeroRedundancyGPT(**_gpt_kwargs())


def _gpt_kwargs() -> dict:
    from benchmarks.common import BENCH_GPT

    return {**BENCH_GPT, "sample_tokens": 0, "warmup_steps": 2}


# ---------------------------------------------------------------------- one side, on every rank
def _raw_loop(steps: int, batch: int, warmup: int, on_step_end: Optional[Callable[[], None]] = None) -> float:
    """Plain PyTorch: the same model, optimizer groups, schedule and data, no Lightning (``on_step_end`` after each step)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import lightning as L

    L.seed_everything(0, verbose=False)
    model = bench_gpt()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
    decay_ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if id(p) not in decay_ids]
    hp = model.hparams
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr, betas=tuple(hp.betas))

    def lr_factor(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, steps - hp.warmup_steps))
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loader = DataLoader(TokenDataset(batch * steps), batch_size=batch, drop_last=True)
    model.train()
    ends = []
    for inputs, targets in loader:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ends.append(time.perf_counter())
        if on_step_end is not None:
            on_step_end()
    timed = ends[warmup - 1:]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def run_side(side: str, steps: int, batch: int, warmup: int) -> float:
    """Train ``side`` for ``steps`` steps of ``batch`` samples per data-parallel rank; mean step seconds."""
    if side == "raw-loop":
        return _raw_loop(steps, batch, warmup)
    if side.endswith("-native-rs"):  # ZeRO-1/2 with torch's gloo reduce-scatter (the path NCCL takes)
        from lightning_para.parallel.data import layout

        layout.GLOO_SHORTCUTS = False
        try:
            return run_side(side[: -len("-native-rs")], steps, batch, warmup)
        finally:
            layout.GLOO_SHORTCUTS = True
    clock = StepClock(warmup)
    _fit(side, steps, batch, clock)
    return clock.step_time


def run_interleaved(sides: list[str], steps: int, batch: int, warmup: int, block: int) -> dict[str, list[float]]:
    """Train every side for ``steps`` steps in this process, taking turns every ``block`` steps
    (:class:`benchmarks.common.Interleaved`); each side's mean step seconds per timed block."""
    if any(side.endswith("-native-rs") for side in sides):
        raise ValueError("`-native-rs` sides switch a module-wide flag: run them with --block 0.")
    interleaved = Interleaved(sides, block, warmup)

    def loop(side: str) -> Callable[[], Any]:
        if side == "raw-loop":
            return lambda: _raw_loop(steps, batch, warmup, on_step_end=lambda: interleaved.step_end(side))
        return lambda: _fit(side, steps, batch, interleaved.callback(side))

    return interleaved.run({side: loop(side) for side in sides})


def _fit(side: str, steps: int, batch: int, callback: Any) -> None:
    """One ``Trainer.fit`` of ``side`` for ``steps`` steps of ``batch`` samples per data-parallel rank."""
    import torch.distributed as dist

    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_para import ParaStrategy

    world = dist.get_world_size()
    L.seed_everything(0, verbose=False)
    module = bench_gpt()
    if side == "lightning-default":
        strategy = "auto"
    elif side == "para":
        strategy = ParaStrategy()
    elif side.startswith("para-zero3-"):  # a `zero3_units` choice other than "auto"
        strategy = ParaStrategy(zero=3, zero3_units=side[len("para-zero3-"):])
    elif side.startswith("para-zero"):
        strategy = ParaStrategy(zero=int(side[-1]))
    elif side == "para-tp2":
        strategy = ParaStrategy(tp=2)
    elif side == "lightning-ddp":
        strategy = "ddp"
    elif side == "lightning-ddp-zero-redundancy":
        strategy, module = "ddp", _zero_redundancy_gpt()
    elif side == "lightning-fsdp2":
        strategy, module = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), _fsdp2_gpt()
    elif side == "lightning-tp":
        strategy, module = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world), _tp_gpt()
    else:
        raise ValueError(f"unknown side {side!r}")
    dp = 1 if side.endswith("tp") or side.endswith("tp2") else world
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[callback],
                        **quiet_trainer_kwargs())
    trainer.fit(module, datamodule=TokenData(samples=batch * steps * dp, batch_size=batch))


def profile_side(side: str, steps: int, batch: int, warmup: int, top: int, callers: str = "") -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run_side(side, steps, batch, warmup)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    stats.print_stats(top)
    if callers:
        stats.print_callers(callers)
    return out.getvalue()


# ---------------------------------------------------------------------- driver
def _take_turns(pool: Any, sides: list[str], args: argparse.Namespace, comparison: Comparison) -> None:
    """``--block``: each round trains every side in one process per rank, taking turns; the starting side rotates."""
    comparison.paired = f"paired blocks ({args.rounds} rounds)"
    for r in range(args.rounds):
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        blocks = pool.run(run_interleaved, order, args.steps, args.batch, args.warmup, args.block, timeout=3600)[0]
        for side in sides:
            for seconds in blocks[side]:
                comparison.add(side, seconds)
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{side} {1e3 * statistics.median(blocks[side]):.1f}" for side in sides) + " ms/step (median block)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--extra-sides", nargs="*", default=[],
                        help="more sides for the suites that run them, e.g. para-zero2-native-rs (ddp suite)")
    parser.add_argument("--sides", nargs="*", default=None,
                        help="only these sides of each suite (with its baseline): fewer sides, pairs closer in time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=0,
                        help="sides take turns inside one fit each, this many steps per turn (0: one fit per side per round)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="samples per data-parallel rank and step")
    parser.add_argument("--wait-load", type=float, default=0.0, help="wait until the 1-min load is below this")
    parser.add_argument("--profile", default=None, help="profile one side (cProfile) instead of comparing")
    parser.add_argument("--callers", default="", help="with --profile: also print who calls functions matching this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.harness import WorkerPool

    if args.profile:
        world = next(w for w, _, sides in SUITES.values() if args.profile in sides)
        pool = WorkerPool(world)
        try:
            print(pool.run(profile_side, args.profile, args.steps, args.batch, args.warmup, 30, args.callers,
                           timeout=1800)[0])
        finally:
            pool.close()
        return
    if args.wait_load:
        wait_for_quiet(args.wait_load, max_wait_s=3 * 3600)
    load_before = load_average()
    command = "python benchmarks/vs_lightning.py " + " ".join(sys.argv[1:])
    sections = []
    for suite in args.suites:
        world, baseline, sides = SUITES[suite]
        sides = sides + [x for x in args.extra_sides if x.removesuffix("-native-rs") in sides]
        if args.sides:
            sides = [side for side in sides if side == baseline or side in args.sides]
        print(f"suite {suite}: {world} process(es), sides {sides}", flush=True)
        comparison = Comparison(f"{suite}: {world} process(es)", baseline)
        pool = WorkerPool(world)
        try:
            if args.block:
                _take_turns(pool, sides, args, comparison)
            else:
                alternate(sides, args.rounds,
                          lambda side: pool.run(run_side, side, args.steps, args.batch, args.warmup, timeout=1800)[0],
                          comparison, log=lambda line: print(line, flush=True))
        finally:
            pool.close()
        comparison.notes.append(
            f"{args.steps} steps per fit, the first {args.warmup} not timed; {args.batch} sequences of 64 tokens per"
            " data-parallel rank and step."
        )
        if args.block:
            comparison.notes.append(
                f"Sides take turns in one process per rank, {args.block} steps each (`--block`); a row's figures are"
                " per block, paired with the baseline's block of the same turn; a block's first step is not timed."
            )
        sections.append(comparison.markdown(TARGETS.get(suite)))
        print(sections[-1], flush=True)
    text = "# ParaStrategy vs Lightning's strategies and a raw loop\n\n" + machine_header(command, load_before)
    text += "\n" + "\n".join(sections)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
