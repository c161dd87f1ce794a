"""The README demo's throughput with ``OMP_NUM_THREADS`` unset (a fresh clone) and set to 1.

Runs ``lightning-para fit --config recipes/gpt-cpu-demo.yaml`` (4 processes, tp=2 x pp=2) for
``--steps`` steps, alternating between the two environments for ``--rounds`` rounds, and
reads the tokens/s the CLI prints at the end (``ParaProfiler``'s summary: training steps
only, the first one excluded). Without a thread budget, four ranks on a 2-core machine each
started one intra-op thread per core; :mod:`lightning_para.threads` now gives each rank
``cores // ranks`` threads unless the user chose, so both columns should agree.

    python benchmarks/demo_threads.py --rounds 5 --steps 40 --out benchmarks/results/demo_threads_cpu.md
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_average, machine_header  # noqa: E402

SIDES = {"OMP_NUM_THREADS unset": None, "OMP_NUM_THREADS=1": "1"}
_TOKENS = re.compile(r"([0-9.]+) tokens/s")


def run_demo(omp: "str | None", steps: int, timeout: float) -> float:
    """One CLI run in a scratch directory; returns the tokens/s it reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [
        sys.executable, "-m", "lightning_para.cli", "fit", "--config", str(ROOT / "recipes" / "gpt-cpu-demo.yaml"),
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.enable_progress_bar=false",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    found = _TOKENS.findall(output)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"demo failed (exit {done.returncode}):\n{output[-3000:]}")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = load_average()
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    names = list(SIDES)
    for r in range(args.rounds):
        for side in names[r % 2:] + names[: r % 2]:  # alternate which side goes first
            results[side].append(run_demo(SIDES[side], args.steps, args.timeout))
            print(f"round {r + 1}/{args.rounds} {side}: {results[side][-1]:.0f} tokens/s", flush=True)
    unset, one = (results[s] for s in names)
    lines = [
        "# README demo throughput: thread budget per rank", "",
        machine_header("python benchmarks/demo_threads.py " + " ".join(sys.argv[1:]), load_before,
                       threads="intra-op threads as each environment leaves them"),
        f"`lightning-para fit --config recipes/gpt-cpu-demo.yaml` (4 processes: tp=2 x pp=2), {args.steps} steps per run,"
        f" {args.rounds} alternating rounds; tokens/s as the CLI reports it.", "",
        "| environment | tokens/s per round | median tokens/s |", "|---|---|---|",
    ]
    for side in names:
        lines.append(f"| {side} | {', '.join(f'{v:.0f}' for v in results[side])} | {statistics.median(results[side]):.0f} |")
    paired = statistics.median(a / b for a, b in zip(unset, one))
    lines += ["", f"Unset / set to 1: ratio of medians **{statistics.median(unset) / statistics.median(one):.3f}**,"
              f" median paired ratio **{paired:.3f}** (target >= 0.9)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
