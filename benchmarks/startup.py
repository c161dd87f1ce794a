"""How long the planner's command takes to start: ``lightning-para plan --help`` against ``python -c "import torch"``
on the same machine, each in fresh interpreters, alternating over rounds (medians; also ``import lightning_para`` and
``import lightning_para.plan``). The acceptance: ``plan --help`` within 1.5 s of ``import torch``.

``python benchmarks/startup.py [--rounds 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "lightning-para plan --help": [sys.executable, "-c", "import sys; from lightning_para.cli import main;"
                                   " sys.argv = ['lightning-para', 'plan', '--help']; main()"],
    "python -c 'import lightning_para'": [sys.executable, "-c", "import lightning_para"],
    "python -c 'import lightning_para.plan'": [sys.executable, "-c", "import lightning_para.plan"],
}


def seconds(command: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            times[name].append(seconds(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:42s} {median:6.2f} s  (median of {args.rounds}; min {min(times[name]):.2f} s)")
    gap = medians["lightning-para plan --help"] - medians["python -c 'import torch'"]
    print(f"plan --help - import torch: {gap:+.2f} s ({'within' if gap <= 1.5 else 'NOT within'} 1.5 s)")


if __name__ == "__main__":
    main()
