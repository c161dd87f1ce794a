"""``lightning-para parity``: does a layout train your config like one device?

::

    lightning-para parity --config recipes/gpt-cpu-demo.yaml --layout "tp=2,pp=2" --steps 20
    lightning-para parity --config my.yaml --layout "dp=2,tp=2,sp=true" --reference "dp=4" --steps 10

Prints per-step loss and gradient-norm differences against the precision's tolerances and a
verdict; on a mismatch, the first step and the parameters whose gradients differ most. Exit
status: 0 match, 1 mismatch, 2 bad arguments.

From Python, :func:`compare` (``from lightning_para.cli.parity import compare``). It lives with
the command, not in :mod:`lightning_para.parity` (the recorder and the report), because it runs
configs through :func:`lightning_para.cli.fit.run_cli`, and library code never imports ``cli/``.

Where the runs happen:

* called in a plain process (a script, ``lightning-para parity``): a run on several devices is a
  child process, ``python -m lightning_para.cli.parity_worker``, which Lightning's launcher fans out
  to its ranks; a one-device run happens in this process (its process group is closed again);
* called on every rank of a process group (``torchrun``, a test pool): both runs happen in it,
  so both must use all of its ranks (``reference="dp=4"`` rather than one device).

Both runs use the config's seed and data order (``seed_everything``, a seeded sampler), the same
global batch per step and the same number of steps; each records per-step losses and gradient
norms (:class:`~lightning_para.parity.ParityRecorder`) and
:func:`~lightning_para.parity.report.compare_records` compares them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from lightning_para.cli.fit import ConfigurationError, close_process_group, run_cli
from lightning_para.parity.record import ParityRecorder, RunRecord, world_size
from lightning_para.parity.report import ParityReport, compare_records
from lightning_para.parity.run import Layout, describe, strategy_arguments, world_of
from lightning_para.run_plan import strategy_overrides

PROG = "lightning-para parity"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Compare a layout's losses and gradients with one device.")
    parser.add_argument("--config", "-c", required=True, help="a LightningCLI config (or a shipped config's name)")
    parser.add_argument("--layout", required=True, help='the layout to check, e.g. "tp=2,pp=2" or "dp=4,ep=2,zero=1"')
    parser.add_argument("--reference", help="a reference layout instead of one device, e.g. \"dp=4\"")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default 20)")
    parser.add_argument("extra", nargs="*", help="more LightningCLI arguments for both runs, after --")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = compare(args.config, args.layout, steps=args.steps, reference=args.reference, extra_args=args.extra)
    except (ValueError, ConfigurationError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(report.text(), flush=True)
    return 0 if report.verdict == "match" else 1


def record_run(
    config: str,
    strategy_arguments: dict[str, Any],
    *,
    steps: int,
    devices: int,
    label: str,
    extra_args: Sequence[str] = (),
) -> RunRecord:
    """Train ``config`` under ParaStrategy with ``strategy_arguments`` for ``steps`` steps on ``devices``
    processes and record it. Call it on every rank of the current process group (torchrun, a test
    pool), or in a single process for one device. Validation, checkpoints, loggers and the profiler
    are off; the config's seed and data order are kept, so two layouts see the same global batches."""
    args = [
        "fit", "--config", config, "--trainer.devices", str(devices), "--trainer.num_nodes", "1",
        *strategy_overrides(strategy_arguments), "--trainer.max_steps", str(steps),
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_checkpointing", "false", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--profiling.comm_every_n_steps", "0", "--profiling.timeline_every_n_steps", "0",
        "--profiling.memory_every_n_steps", "0", "--profiling.check_predictions", "false",
        "--trainer.callbacks+=lightning_para.parity.record.ParityRecorder", *extra_args,
    ]
    cli = run_cli(args)
    recorder = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ParityRecorder))
    norms = [math.sqrt(sum(v * v for v in step.values())) for step in recorder.param_grad_norms]
    precision = getattr(cli.trainer.strategy.precision_plugin, "precision", str(cli.trainer.precision))
    return RunRecord(label, world_size(), str(precision), recorder.losses(), norms, recorder.param_grad_norms)




def run_layout(
    config: str, arguments: Mapping[str, Any], *, steps: int, extra_args: Sequence[str] = ()
) -> RunRecord:
    """Record ``config`` under ``arguments`` wherever it can run (see the module docstring)."""
    world = world_of(arguments)
    label = describe(arguments)
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world:
            raise ValueError(
                f"Inside a process group of {dist.get_world_size()} ranks every run uses all of them, but {label} needs"
                f" {world}. Give a reference layout of {dist.get_world_size()} ranks (e.g. reference='dp="
                f"{dist.get_world_size()}'), or call compare() outside a process group to compare with one device."
            )
        return record_run(config, dict(arguments), steps=steps, devices=world, label=label, extra_args=extra_args)
    if world == 1:
        try:
            return record_run(config, dict(arguments), steps=steps, devices=1, label=label, extra_args=extra_args)
        finally:
            close_process_group()
    with tempfile.TemporaryDirectory(prefix="lightning-para-parity-") as root:
        out = Path(root) / "record.json"
        command = [
            sys.executable, "-m", "lightning_para.cli.parity_worker", "--config", config, "--strategy",
            json.dumps(dict(arguments)), "--steps", str(steps), "--devices", str(world), "--label", label,
            "--out", str(out), "--", *extra_args,
        ]
        done = subprocess.run(command, check=False)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"The {label} run failed (exit status {done.returncode}); see its output above.")
        return RunRecord.from_dict(json.loads(out.read_text()))


def compare(
    config: str,
    layout: Layout,
    *,
    steps: int = 20,
    reference: Layout = None,
    extra_args: Sequence[str] = (),
) -> ParityReport:
    """Does ``layout`` train ``config`` like one device (or like ``reference``)?

    Args:
        config: a LightningCLI YAML (or a shipped config's short name), as for ``lightning-para fit``.
        layout: ``"tp=2,pp=2"`` (keys: every ParaStrategy layout argument, ``dp tp pp ep cp
            cp_method dp_replicate dp_shard zero zero3_units sp schedule microbatches ...``; see
            :func:`~lightning_para.run_plan.parse_layout`) or a dict of ParaStrategy arguments;
            degrees not given are 1, options not given are the config's.
        steps: optimizer steps of each run.
        reference: ``None`` for one device, or a layout as ``layout``.
        extra_args: more LightningCLI arguments for both runs (e.g. ``["--data.init_args.max_bytes", "100000"]``).

    Returns a :class:`~lightning_para.parity.report.ParityReport`: ``.verdict`` (``"match"`` /
    ``"mismatch"``), ``.text()``, the first mismatching step and the parameters whose gradients
    differ most. Raises ``ValueError`` for a bad layout.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps={steps!r}` must be a positive integer.")
    run_arguments, reference_arguments = strategy_arguments(layout), strategy_arguments(reference)
    run = run_layout(config, run_arguments, steps=steps, extra_args=extra_args)
    expected = run_layout(config, reference_arguments, steps=steps, extra_args=extra_args)
    return compare_records(run, expected)


__all__ = ["compare", "main", "record_run", "run_layout"]
