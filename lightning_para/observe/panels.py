"""The profiler's panels: TensorBoard scalars and tables made from every rank's gathered records (pure
functions; :class:`~lightning_para.observe.profiler.ParaProfiler` gathers and writes them)."""

from __future__ import annotations

import statistics
from typing import Optional

from lightning_para.instrument.compare import IDLE_KINDS, PredictionCheck
from lightning_para.moe import MoEStats
from lightning_para.parallel.data import MemoryBreakdown

MIB = 2**20


def comm_metrics(per_rank: list[dict[str, dict[str, float]]], step_seconds: float) -> dict[str, float]:
    """``comm/{dim}/{kind}_MB`` and ``_ms`` averaged over ranks, totals per mesh dimension, and the traced step."""
    metrics: dict[str, float] = {}
    totals: dict[str, list[float]] = {}
    for key in sorted({k for r in per_rank for k in r}):
        entries = [r.get(key, {}) for r in per_rank]
        mb = sum(e.get("bytes", 0.0) for e in entries) / len(entries) / 1e6
        metrics[f"comm/{key}_MB"] = mb
        dim = key.split("/")[0]
        totals.setdefault(dim, [0.0, 0.0])[0] += mb
        if any("seconds" in e for e in entries):
            ms = 1e3 * sum(e.get("seconds", 0.0) for e in entries) / len(entries)
            metrics[f"comm/{key}_ms"] = ms
            totals[dim][1] += ms
    for dim, (mb, ms) in totals.items():
        metrics[f"comm/{dim}/total_MB"] = mb
        if ms:
            metrics[f"comm/{dim}/total_ms"] = ms
    metrics["comm/traced_step_ms"] = 1e3 * step_seconds
    return metrics


def memory_panel(per_rank: list[tuple[MemoryBreakdown, Optional[int]]]) -> tuple[dict[str, float], str]:
    """Each rank's memory against the ZeRO formula: ``memory/rank{r}/...`` scalars and a markdown table."""
    metrics = {}
    rows = ["| rank | params MiB | grads MiB | optimizer MiB | total MiB | ZeRO formula MiB | measured / formula |",
            "|---|---|---|---|---|---|---|"]
    for rank, (b, rank_device_max) in enumerate(per_rank):
        expected = b.expected.total
        for key in ("params", "grads", "optimizer", "total"):
            metrics[f"memory/rank{rank}/{key}_MiB"] = getattr(b, key) / MIB
            metrics[f"memory/rank{rank}/expected_{key}_MiB"] = getattr(b.expected, key) / MIB
        if expected:
            metrics[f"memory/rank{rank}/measured_over_expected"] = b.total / expected
        if rank_device_max is not None:
            metrics[f"memory/rank{rank}/device_max_allocated_MiB"] = rank_device_max / MIB
        ratio = f"{b.total / expected:.3f}" if expected else "-"
        rows.append(f"| {rank} | {b.params / MIB:.2f} | {b.grads / MIB:.2f} | {b.optimizer / MIB:.2f}"
                    f" | {b.total / MIB:.2f} | {expected / MIB:.2f} | {ratio} |")
    first = per_rank[0][0]
    header = f"ZeRO-{first.zero} over dp={first.dp} (edp={first.edp}): {first.formula}\n\n"
    if first.dp_replicate > 1 or first.cp > 1:  # N = dp_shard x cp shards the state
        header = (f"ZeRO-{first.zero} sharded over N={first.dp} ranks (dp_shard x cp, cp={first.cp}),"
                  f" replicated over dp_replicate={first.dp_replicate}: {first.formula}\n\n")
    return metrics, header + "\n".join(rows)


def prediction_metrics(check: PredictionCheck) -> dict[str, float]:
    """``plan/...``: the planner's prediction against what was measured, per rank and row, and the worst errors."""
    metrics: dict[str, float] = {}
    for row in check.rows:
        key = f"plan/rank{row.rank}/{row.kind}_{row.name}" if row.kind in ("memory", "comm") else f"plan/rank{row.rank}/{row.kind}"
        metrics[key + "_predicted"] = row.predicted
        metrics[key + "_measured"] = row.measured
        idle = row.kind in IDLE_KINDS
        metrics[key + ("_diff" if idle else "_ratio")] = row.error if idle else row.ratio
    for kind, value in check.worst().items():
        metrics[f"plan/worst_{kind}_error"] = value
    return metrics


def moe_metrics(per_rank: list[dict[str, MoEStats]], global_loads: Optional[dict[str, list[float]]] = None) -> dict[str, float]:
    """Routing statistics of every MoE layer averaged over ranks, and each layer's global load imbalance;
    ``global_loads``: the assignments per expert of other blocks (a selection bias's count), already summed over
    ranks."""
    merged: dict[str, list[MoEStats]] = {}
    for r in per_rank:
        for name, stats in r.items():
            merged.setdefault(name, []).append(stats)
    metrics: dict[str, float] = {}
    imbalance, loads = [], dict(global_loads or {})
    for name, entries in sorted(merged.items()):
        for key in ("balance_loss", "z_loss", "dropped_fraction", "load_imbalance"):
            metrics[f"moe/{name}/{key}"] = sum(getattr(e, key) for e in entries) / len(entries)
        loads[name] = [sum(c) for c in zip(*(e.tokens_per_expert for e in entries))]
    for name, counts in sorted(loads.items()):
        mean = sum(counts) / max(len(counts), 1)
        # Global balance: max/mean of the tokens each expert got from all ranks together.
        metrics[f"moe/{name}/global_load_imbalance"] = max(counts) / mean if mean else 0.0
        imbalance.append(metrics[f"moe/{name}/global_load_imbalance"])
    if imbalance:
        metrics["moe/mean_global_load_imbalance"] = sum(imbalance) / len(imbalance)
    return metrics


def straggler_metrics(own_seconds: list[float], stragglers: list[int]) -> dict[str, float]:
    """The straggler detector's comparison: ``straggler/rank{r}/own_ms`` (a rank's median work between two gradient
    synchronisations), ``.../vs_median`` (over ranks) and ``straggler/named`` (how many ranks are named now)."""
    known = [s for s in own_seconds if s > 0]
    median = statistics.median(known) if known else 0.0
    metrics = {"straggler/named": float(len(stragglers))}
    for rank, seconds in enumerate(own_seconds):
        if seconds > 0:
            metrics[f"straggler/rank{rank}/own_ms"] = 1e3 * seconds
            metrics[f"straggler/rank{rank}/vs_median"] = seconds / median
    return metrics


__all__ = ["comm_metrics", "memory_panel", "moe_metrics", "prediction_metrics", "straggler_metrics"]
