"""The reliability acceptance campaign of issue 14 (too slow for the test suite: run it once).

1. **Kills during a save** (``pp=2 x dp=2``, separately started ranks): 12 steps, ``ModelCheckpoint``
   every 4 steps with ``save_last=True`` (saves 1-2 at step 4: ``step=4.ckpt`` then ``last.ckpt``;
   saves 3-4 at step 8). Rank 0 or rank 3 SIGKILLs itself at one of the points of
   ``tests/integration/reliability_train.KILL_POINTS`` in save 3 (a new step checkpoint) or save 4
   (``last.ckpt`` replacing the previous one). Then ``fit(ckpt_path="last")`` must resume from a
   complete checkpoint and log, step for step, bit for bit, the losses of the uninterrupted run.
2. **A rank killed at a random time** (``pp=2 x dp=2`` and ``dp=2 x tp=2``; Lightning's launcher and
   separately started ranks): every survivor must exit non-zero within ``watchdog_timeout + 10`` s,
   naming the lost rank.

    python scripts/kill_campaign.py --out /tmp/campaign [--random-runs 10] [--only save|random]

Writes ``benchmarks/results/kill_campaign.json`` and ``kill_campaign.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker  # noqa: E402
from tests.integration.kill_helpers import launch, names_rank  # noqa: E402
from tests.integration.reliability_train import KILL_POINTS  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
WATCHDOG_TIMEOUT = 10.0
STEPS, SAVE_EVERY = 12, 4
SAVE_ARGS = ["--layout", "pp2dp2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
             "--watchdog-timeout", str(WATCHDOG_TIMEOUT)]


def save_cases() -> list[tuple[str, int, int]]:
    """(point, rank, nth save): rank 0 passes every point; rank 3 only its own DCP write."""
    cases = []
    for nth in (3, 4):
        for point in KILL_POINTS:
            if point == "swapped-old-not-deleted" and nth == 3:
                continue  # a new step checkpoint has no previous copy to delete
            cases.append((point, 0, nth))
        for point in KILL_POINTS[:4]:
            cases.append((point, 3, nth))
    return cases


def lightning_observer_named(output: str) -> list[int]:
    """Ranks Lightning's launcher reported dead before it SIGKILLed the others (its child observer
    polls every 5 s; when it acts before the watchdog, survivors die with -9 and only this line names
    the lost rank)."""
    return [int(r) for r in re.findall(r"\[rank: (\d+)\] Child process with PID \d+ terminated with code", output)]


def survivors_report(run, victim: int, killed_at: float, ended: dict) -> dict:
    codes, verdicts = run.exit_codes(), run.verdicts()
    survivors = [r for r in ended if r != victim]
    return {
        "exit_codes": {r: codes.get(r) for r in survivors},
        "exit_after_s": {r: (None if ended[r] is None else round(ended[r] + killed_at, 2)) for r in survivors},
        "named_lost_rank": {r: names_rank(verdicts.get(r), victim) for r in survivors},
        "verdicts": {r: verdicts.get(r, "")[:300] for r in survivors},
        "lightning_observer_named": lightning_observer_named(run.output()),
    }


def run_save_campaign(root: Path) -> dict:
    ref_run = launch(root / "uninterrupted", "external", *SAVE_ARGS)
    ref_run.wait_all(600)
    reference = ref_run.losses()
    assert reference and len(reference) == STEPS, "the uninterrupted run failed"
    cases = []
    for i, (point, rank, nth) in enumerate(save_cases()):
        folder = root / f"save_{i:02d}_{point}_r{rank}_n{nth}"
        t0 = time.monotonic()
        killed = launch(folder, "external", *SAVE_ARGS, "--kill", f"{point}:{rank}:{nth}")
        ended = killed.wait_all(300)
        codes = killed.exit_codes()
        last = folder / "ckpt" / "last.ckpt"
        status = checkpoint_problems(last)
        case = {
            "point": point, "rank": rank, "save": nth, "kill_reached": codes.get(rank) == -9, "target": "last.ckpt" if nth % 2 == 0 else f"step={SAVE_EVERY * 2}.ckpt",
            "killed_rank_exit": codes.get(rank),
            "survivors": survivors_report(killed, rank, 0.0, ended),
            "last_complete_after_kill": status.complete,
            "last_step_after_kill": (read_marker(last) or {}).get("global_step"),
            "hidden_leftovers": sorted(p.name for p in (folder / "ckpt").iterdir() if p.name.startswith(".")),
        }
        # A restart: the same checkpoint folder, `ckpt_path="last"` (the strategy loads this run's newest complete checkpoint).
        resumed_run = launch(folder / "resume", "external", *SAVE_ARGS, "--resume", "last", "--ckpt-dir", str(folder / "ckpt"))
        resumed_run.wait_all(600)
        resumed = resumed_run.losses()
        case["resume_output_tail"] = "" if resumed else resumed_run.output()[-1500:]
        if resumed:
            first = min(resumed)
            case["resumed_from_step"] = first - 1
            case["resumed_steps"] = len(resumed)
            case["bit_identical"] = all(resumed[s] == reference[s] for s in resumed)
            case["max_abs_diff"] = max(abs(resumed[s] - reference[s]) for s in resumed)
        case["seconds"] = round(time.monotonic() - t0, 1)
        cases.append(case)
        print(json.dumps({k: case[k] for k in ("point", "rank", "save", "kill_reached", "last_step_after_kill", "resumed_from_step",
                                               "bit_identical") if k in case}), flush=True)
    return {"reference_losses": reference, "cases": cases}


def run_random_campaign(root: Path, runs: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    results = []
    for layout in ("pp2dp2", "dp2tp2"):
        for launcher in ("lightning", "external"):
            for i in range(runs):
                folder = root / f"random_{layout}_{launcher}_{i:02d}"
                run = launch(folder, launcher, "--layout", layout, "--steps", "100000", "--step-sleep", "0.05",
                             "--watchdog-timeout", str(WATCHDOG_TIMEOUT))
                if not run.wait_started():
                    run.wait_all(5)
                    results.append({"layout": layout, "launcher": launcher, "run": i, "error": "did not start",
                                    "output_tail": run.output()[-1500:]})
                    continue
                delay, victim = rng.uniform(0.5, 8.0), rng.randrange(4)
                time.sleep(delay)
                run.kill_rank(victim)
                ended = run.wait_all(WATCHDOG_TIMEOUT + 60)
                entry = {"layout": layout, "launcher": launcher, "run": i, "victim": victim, "kill_after_start_s": round(delay, 2),
                         **survivors_report(run, victim, 0.0, ended)}
                results.append(entry)
                print(json.dumps({k: entry[k] for k in ("layout", "launcher", "run", "victim", "exit_codes", "exit_after_s",
                                                        "named_lost_rank")}), flush=True)
    return results


def summarize(save: dict, random_runs: list[dict]) -> str:
    lines = ["# Kill campaign (issue 14)", "", f"watchdog_timeout = {WATCHDOG_TIMEOUT:g} s; CPU, gloo, 4 processes.", ""]
    if save:
        cases = save["cases"]
        ok = [c for c in cases if c.get("bit_identical")]
        lines += [
            "## Kills during a save (pp=2 x dp=2, separately started ranks)", "",
            f"* cases: {len(cases)} ({len({c['point'] for c in cases})} kill points x rank 0 / rank 3 x step checkpoint /"
            f" `last.ckpt`); the kill happened at its point in {sum(c['kill_reached'] for c in cases)}",
            f"* `last.ckpt` complete after the kill: {sum(c['last_complete_after_kill'] for c in cases)}/{len(cases)}",
            f"* `fit(ckpt_path=\"last\")` resumed and logged the uninterrupted losses bit for bit: {len(ok)}/{len(cases)}",
            f"* resumed from step: {sorted({c.get('resumed_from_step') for c in cases}, key=str)}",
            f"* survivors that exited non-zero: {sum(1 for c in cases for v in c['survivors']['exit_codes'].values() if v)}"
            f"/{sum(len(c['survivors']['exit_codes']) for c in cases)}; named the lost rank:"
            f" {sum(1 for c in cases for v in c['survivors']['named_lost_rank'].values() if v)}",
            "", "| point | rank | save | last.ckpt step after kill | resumed from | bit-identical | survivor exit codes |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in cases:
            lines.append(f"| {c['point']} | {c['rank']} | {c['target']} | {c['last_step_after_kill']} |"
                         f" {c.get('resumed_from_step')} | {c.get('bit_identical')} | {c['survivors']['exit_codes']} |")
        lines.append("")
    if random_runs:
        lines += ["## One rank SIGKILLed at a random time", "",
                  "| layout | launcher | runs | survivors non-zero | named the lost rank | within timeout + 10 s | median / max exit (s) |",
                  "|---|---|---|---|---|---|---|"]
        for layout in ("pp2dp2", "dp2tp2"):
            for launcher in ("lightning", "external"):
                runs = [r for r in random_runs if r["layout"] == layout and r["launcher"] == launcher and "victim" in r]
                codes = [c for r in runs for c in r["exit_codes"].values()]
                named = [v for r in runs for v in r["named_lost_rank"].values()]
                times = [t for r in runs for t in r["exit_after_s"].values() if t is not None]
                hung = sum(1 for r in runs for t in r["exit_after_s"].values() if t is None)
                observer = [r for r in runs if r["victim"] in r.get("lightning_observer_named", [])
                            and not all(r["named_lost_rank"].values())]
                within = sum(1 for t in times if t <= WATCHDOG_TIMEOUT + 10)
                lines.append(
                    f"| {layout} | {launcher} | {len(runs)} | {sum(1 for c in codes if c)}/{len(codes)} |"
                    f" {sum(named)}/{len(named)}"
                    + (f" (+{len(observer)} runs: Lightning's launcher killed all first, naming it)" if observer else "")
                    + f" | {within}/{len(codes)} (hung: {hung}) |"
                    f" {round(statistics.median(times), 2) if times else '-'} / {max(times) if times else '-'} |"
                )
        lines.append("")
    return "\n".join(lines)


def resummarize(json_path: Path, root: Path) -> None:
    """Re-derive the survivors' fields from the saved outputs (e.g. after improving the report)."""
    data = json.loads(json_path.read_text())
    for entry in data["random"]:
        folder = root / f"random_{entry['layout']}_{entry['launcher']}_{entry['run']:02d}"
        if "victim" in entry and folder.is_dir():
            output = "".join(f.read_text(errors="replace") for f in sorted(folder.glob("stdout*.txt")))
            entry["lightning_observer_named"] = lightning_observer_named(output)
    json_path.write_text(json.dumps(data, indent=1))
    json_path.with_suffix(".md").write_text(summarize(data["save"], data["random"]))
    print(summarize(data["save"], data["random"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--random-runs", type=int, default=10, help="per layout and launcher")
    parser.add_argument("--only", choices=("save", "random"), default=None)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--resummarize", type=Path, default=None,
                        help="rebuild the report from an earlier run's JSON and its --out folder")
    args = parser.parse_args()
    root = Path(args.out)
    if args.resummarize is not None:
        resummarize(args.resummarize, root)
        return
    started = time.time()
    save = run_save_campaign(root) if args.only != "random" else {}
    random_runs = run_random_campaign(root, args.random_runs, args.seed) if args.only != "save" else []
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.only}" if args.only else ""
    (RESULTS / f"kill_campaign{suffix}.json").write_text(json.dumps(
        {"watchdog_timeout_s": WATCHDOG_TIMEOUT, "wall_s": round(time.time() - started), "save": save, "random": random_runs},
        indent=1))
    (RESULTS / f"kill_campaign{suffix}.md").write_text(summarize(save, random_runs))
    print(summarize(save, random_runs))


if __name__ == "__main__":
    main()
