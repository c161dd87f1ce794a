"""The planner's predicted step time against the measured one, for the GPT demo config on CPU layouts.

For each layout, runs ``lightning-para fit --config recipes/gpt-cpu-demo.yaml`` with ``--trainer.devices N``
and the layout's degrees for ``--steps`` steps, and reads what the ParaProfiler's prediction check wrote to
``para_summary.json``: the planner's step time (priced with this machine's cached calibration, see
``lightning-para calibrate``) and the measured median untraced step, the slowest rank's. Run
``lightning-para calibrate 1`` and ``lightning-para calibrate 2`` first (the one-device run uses two threads).
A comparison of a model with measurements, not a pass/fail timing test (docs/planner.md, issue 23 item 3).

    python benchmarks/step_prediction.py --rounds 2 --steps 40 --out benchmarks/results/step_prediction_cpu.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_average, machine_header  # noqa: E402

# (name, devices, tp, pp): the layouts of docs/planner.md's table, the README demo's last.
LAYOUTS = [
    ("1 device", 1, 1, 1), ("dp=2", 2, 1, 1), ("pp=2", 2, 1, 2), ("tp=2", 2, 2, 1), ("dp=4", 4, 1, 1),
    ("dp=2 x tp=2", 4, 2, 1), ("dp=2 x pp=2", 4, 1, 2), ("tp=2 x pp=2 (the demo's layout)", 4, 2, 2),
]


def run_layout(devices: int, tp: int, pp: int, steps: int, timeout: float) -> tuple[float, float]:
    """``(predicted, measured)`` step seconds of one run, the slowest rank's measurement."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="step-prediction-") as tmp:
        command = [
            sys.executable, "-m", "lightning_para.cli", "fit", "--config", str(ROOT / "recipes" / "gpt-cpu-demo.yaml"),
            "--trainer.devices", str(devices), "--trainer.strategy.init_args.tp", str(tp),
            "--trainer.strategy.init_args.pp", str(pp), "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps), "--trainer.default_root_dir", tmp,
        ]
        done = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        summary = json.loads(Path(glob.glob(f"{tmp}/**/para_summary.json", recursive=True)[0]).read_text())
    rows = [r for r in summary["prediction"]["rows"] if r["kind"] == "step"]
    return rows[0]["predicted"], max(r["measured"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = load_average()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in LAYOUTS}
    for _ in range(args.rounds):
        for name, devices, tp, pp in LAYOUTS:
            results[name].append(run_layout(devices, tp, pp, args.steps, args.timeout))
            print(name, results[name][-1], flush=True)
    lines = [
        machine_header(f"python benchmarks/step_prediction.py --rounds {args.rounds} --steps {args.steps}", load_before),
        "",
        "| layout | ranks | predicted | measured per round | predicted / measured - 1 |",
        "|---|---|---|---|---|",
    ]
    for name, devices, *_ in LAYOUTS:
        predicted = results[name][0][0]
        measured = " / ".join(f"{m * 1e3:.0f} ms" for _, m in results[name])
        errors = " / ".join(f"{p / m - 1:+.0%}" for p, m in results[name])
        lines.append(f"| {name} | {devices} | {predicted * 1e3:.0f} ms | {measured} | {errors} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
