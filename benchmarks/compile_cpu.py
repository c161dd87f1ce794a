"""Compiled against eager step time of the GPT recipe on CPU (issue 25: "a CPU ratio, whatever it is").

The benchmark transformer of ``benchmarks/common.py`` (Llama-style, 4 layers, hidden 256, sequence
64) trains under ``ParaStrategy`` at ``devices=1`` in this process, fp32, with each side in turn:

* ``eager``: ``ParaStrategy()``;
* ``compile``: ``ParaStrategy(compile=True)``, each block compiled by inductor (C++ on CPU);
* ``compile aot_eager``: ``ParaStrategy(compile={"backend": "aot_eager"})``, dynamo and AOTAutograd
  without code generation (what the parity tests use): the cost of tracing without the benefit.

Protocol of ``benchmarks/common.py``: alternating rounds, a fresh ``Trainer.fit`` per side per round,
``--warmup`` steps (compilation included) before the timed ones, median of paired ratios to ``eager``.
``torch._dynamo.reset()`` runs before every side, so each compiled round compiles afresh (inductor's
on-disk cache may make later rounds compile faster; the timed steps exclude compilation anyway).

    python benchmarks/compile_cpu.py --rounds 3 --steps 12 --out benchmarks/results/compile_cpu.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Comparison, StepClock, TokenData, alternate, bench_gpt, load_average, machine_header, quiet_trainer_kwargs,
)

SIDES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compile": {"compile": True},
    "compile aot_eager": {"compile": {"backend": "aot_eager"}},
}


def run_side(side: str, args: argparse.Namespace) -> float:
    """One fresh fit of ``side``; its mean step time after warm-up (seconds)."""
    from lightning_para import ParaStrategy

    torch._dynamo.reset()
    L.seed_everything(0, verbose=False)
    clock = StepClock(args.warmup)
    trainer = L.Trainer(devices=1, strategy=ParaStrategy(**SIDES[side]), max_steps=args.warmup + args.steps,
                        callbacks=[clock], **quiet_trainer_kwargs())
    data = TokenData(samples=args.batch * (args.warmup + args.steps), batch_size=args.batch)
    trainer.fit(bench_gpt(), datamodule=data)
    return clock.step_time


def main(argv: "list[str] | None" = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (torch.set_num_threads)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, from: " + ", ".join(SIDES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",")]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or "eager" not in sides:
        parser.error(f"--sides must name sides of {list(SIDES)} and include 'eager' (the baseline); got {sides}")
    torch.set_num_threads(args.threads)
    load_before = load_average()
    comparison = Comparison("GPT recipe (benchmark transformer), devices=1, fp32: compiled vs eager", "eager")
    alternate(sides, args.rounds, lambda side: run_side(side, args), comparison)
    comparison.notes.append(f"batch {args.batch} x sequence 64, {args.warmup} warm-up steps (compilation) then "
                            f"{args.steps} timed steps per fit; {args.threads} intra-op thread(s).")
    command = "python benchmarks/compile_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = machine_header(command, load_before, threads=f"{args.threads} intra-op thread(s)") + comparison.markdown()
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
