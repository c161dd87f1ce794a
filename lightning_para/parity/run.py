"""The layouts a parity check compares: ParaStrategy arguments of ``"tp=2,pp=2"``, the processes
they need, a label for reports. :func:`lightning_para.cli.parity.compare` runs them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Union

from lightning_para.run_plan import parse_layout
from lightning_para.spec.dims import DEGREES, Degrees

# One device: every degree 1 and every option that changes the numerics' layout off.
ONE_DEVICE: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "zero": 0, "sequence_parallel": False}

Layout = Union[str, Mapping[str, Any], None]


def strategy_arguments(layout: Layout) -> dict[str, Any]:
    """ParaStrategy arguments of ``"tp=2,pp=2"`` / a dict / ``None`` (one device).

    Keys: every ParaStrategy layout argument (:func:`~lightning_para.run_plan.parse_layout`, the
    fields of the planner's ``Layout``). Degrees not given are 1 (the layout is the whole layout,
    not a change to the config's; ``dp`` is ``dp_replicate x dp_shard`` when only those are given);
    options not given (``zero``, ``schedule``, ...) stay the config's.
    """
    if layout is None:
        return dict(ONE_DEVICE)
    arguments = parse_layout(layout) if isinstance(layout, str) else dict(layout)
    dp = (arguments.get("dp_replicate") or 1) * (arguments.get("dp_shard") or 1)  # hybrid degrees alone give dp
    return {"dp": dp, "tp": 1, "pp": 1, "ep": 1, "cp": 1, **arguments}


def world_of(arguments: Mapping[str, Any]) -> int:
    """Processes a layout needs: ``dp * cp * tp * pp`` (``ep`` lives inside ``dp``)."""
    return Degrees(**{name: int(arguments.get(name) or 1) for name in DEGREES}).world_size


def describe(arguments: Mapping[str, Any]) -> str:
    """``"tp=2,pp=2"``: the degrees above 1 and the options set, for reports."""
    if dict(arguments) == ONE_DEVICE:
        return "one device"
    parts = [f"{k}={v}" for k, v in arguments.items() if not (k in DEGREES and v == 1)]
    return ",".join(parts) or "one device"


__all__ = ["ONE_DEVICE", "describe", "strategy_arguments", "world_of"]
