"""``compare(config, layout)``: run a config under a layout and under one device (or a reference layout), then compare.

Where the runs happen:

* called in a plain process (a script, ``lightning-para parity``): a run on several devices is a
  child process, ``python -m lightning_para.parity.worker``, which Lightning's launcher fans out
  to its ranks; a one-device run happens in this process (its process group is closed again);
* called on every rank of a process group (``torchrun``, a test pool): both runs happen in it,
  so both must use all of its ranks (``reference="dp=4"`` rather than one device).

Both runs use the config's seed and data order (``seed_everything``, a seeded sampler), the same
global batch per step and the same number of steps; each records per-step losses and gradient
norms (:mod:`.record`) and :func:`~lightning_para.parity.report.compare_records` compares them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch.distributed as dist

from lightning_para.lightning_cli import close_process_group
from lightning_para.parity.record import RunRecord, record_run
from lightning_para.parity.report import ParityReport, compare_records
from lightning_para.plan.run import parse_layout

# One device: every degree 1 and every option that changes the numerics' layout off.
ONE_DEVICE: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "zero": 0, "sequence_parallel": False}

Layout = Union[str, Mapping[str, Any], None]


def strategy_arguments(layout: Layout) -> dict[str, Any]:
    """ParaStrategy arguments of ``"tp=2,pp=2"`` / a dict / ``None`` (one device).

    Keys: every ParaStrategy layout argument (:func:`~lightning_para.plan.run.parse_layout`, the
    fields of the planner's ``Layout``). Degrees not given are 1 (the layout is the whole layout,
    not a change to the config's); options not given (``zero``, ``schedule``, ...) stay the config's.
    """
    if layout is None:
        return dict(ONE_DEVICE)
    arguments = parse_layout(layout) if isinstance(layout, str) else dict(layout)
    dp = (arguments.get("dp_replicate") or 1) * (arguments.get("dp_shard") or 1)  # hybrid degrees alone give dp
    return {"dp": dp, "tp": 1, "pp": 1, "ep": 1, "cp": 1, **arguments}


def world_of(arguments: Mapping[str, Any]) -> int:
    """Processes a layout needs: ``dp * cp * tp * pp`` (``ep`` lives inside ``dp``; ``dp`` is
    ``dp_replicate * dp_shard`` when only those are given)."""
    dp = arguments.get("dp", 1)
    if "dp_replicate" in arguments and "dp_shard" in arguments and "dp" not in arguments:
        dp = int(arguments["dp_replicate"] or 1) * int(arguments["dp_shard"] or 1)
    return int(dp) * math.prod(int(arguments.get(k, 1)) for k in ("cp", "tp", "pp"))


def describe(arguments: Mapping[str, Any]) -> str:
    """``"tp=2,pp=2"``: the degrees above 1 and the options set, for reports."""
    if dict(arguments) == ONE_DEVICE:
        return "one device"
    parts = [f"{k}={v}" for k, v in arguments.items() if not (k in ("dp", "tp", "pp", "ep", "cp") and v == 1)]
    return ",".join(parts) or "one device"


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
            sys.executable, "-m", "lightning_para.parity.worker", "--config", config, "--strategy",
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
            :func:`~lightning_para.plan.run.parse_layout`) or a dict of ParaStrategy arguments;
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


__all__ = ["ONE_DEVICE", "compare", "describe", "run_layout", "strategy_arguments", "world_of"]
