"""One machine's calibration: the record (:class:`Calibration`), its cache and :func:`calibrate`, which measures
(:mod:`lightning_para.calibrate.measure`) unless the cache has this machine.

The result is cached in ``~/.cache/lightning-para/calibration.json`` (``$LIGHTNING_PARA_CACHE`` to move it),
keyed by host, CPU model, torch version and thread count; :func:`cached_calibration` only reads it, so
``local_cluster`` never measures inside a training run. Run ``lightning-para calibrate`` once per machine (or
``calibrate()``).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_para.calibrate.measure import measure_dtensor_op_costs, measure_gloo, measure_rank_gemms
from lightning_para.plan.gemm import Gemm, GemmMeasurement, GemmModel, fit_gemm_model
from lightning_para.threads import available_cores


def cache_path() -> Path:
    """``$LIGHTNING_PARA_CACHE/calibration.json`` (default ``~/.cache/lightning-para``)."""
    root = os.environ.get("LIGHTNING_PARA_CACHE", os.path.join("~", ".cache", "lightning-para"))
    return Path(root).expanduser() / "calibration.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> str:
    """What a calibration holds for: host, CPU model, torch version, intra-op threads per rank."""
    return f"{socket.gethostname()}|{_cpu_model()}|torch {torch.__version__}|threads {threads}"


@dataclass(frozen=True)
class Calibration:
    """Measured figures of one rank on this machine (see the module docstring)."""

    matmul_flops: float  # FLOP/s of one rank's fp32 matmuls under its thread budget
    bandwidth: float  # bytes/s, beta of the alpha-beta model (gloo, 2 processes)
    latency: float  # seconds per message hop, alpha
    threads: int
    key: str
    measured_at: float  # time.time()
    load: float  # 1-minute load average when measured
    op_seconds: Optional[float] = None  # seconds per eager aten operator (None: a cache from before it was measured)
    dtensor_op_seconds: Optional[float] = None  # seconds per operator through DTensor's dispatch (None: not measured)
    step_overhead_seconds: Optional[float] = None  # the training loop's fixed seconds per step (None: not measured)
    elementwise_bandwidth: Optional[float] = None  # bytes/s the non-matmul operators move (None: not measured)
    processes: int = 1  # processes measured at once (cores // threads: the machine as loaded as in a run)
    # [[tokens, fraction of matmul_flops a real model's matmuls reach at that microbatch], ...] (None: 1)
    matmul_efficiency: Optional[list[list[float]]] = None
    dtensor_optimizer_op_seconds: Optional[float] = None  # per DTensor operator of the optimizer step (None: not apart)
    # [[m, n, k, seconds], ...]: this machine's fp32 GEMMs (`measure_gemm_curve`; None: not measured)
    gemm_curve: Optional[list[list[float]]] = None
    # {tokens: [[m, n, k, count], ...]}: the matmuls of the model `matmul_efficiency` was measured on
    matmul_shapes: Optional[dict[str, list[list[int]]]] = None

    def cluster_figures(self) -> dict[str, float]:
        """:class:`~lightning_para.plan.cluster.Cluster` fields: ``peak_flops`` is the square matmuls' rate and
        ``efficiency_by_tokens`` the fraction of it a real model's matmuls reached per microbatch size
        (``efficiency`` 1 when not measured)."""
        figures: dict[str, Any] = {
            "peak_flops": self.matmul_flops, "efficiency": 1.0, "intra_node_bw": self.bandwidth,
            "inter_node_bw": self.bandwidth, "intra_node_latency": self.latency, "inter_node_latency": self.latency,
        }
        if self.op_seconds is not None:
            figures["op_seconds"] = self.op_seconds
        if self.dtensor_op_seconds is not None:
            figures["dtensor_op_seconds"] = self.dtensor_op_seconds
        if self.dtensor_optimizer_op_seconds is not None:
            figures["dtensor_optimizer_op_seconds"] = self.dtensor_optimizer_op_seconds
        if self.step_overhead_seconds is not None:
            figures["step_overhead_seconds"] = self.step_overhead_seconds
        if self.elementwise_bandwidth is not None:
            figures["elementwise_bandwidth"] = self.elementwise_bandwidth
        if self.matmul_efficiency:
            figures["efficiency_by_tokens"] = tuple((float(t), float(e)) for t, e in self.matmul_efficiency)
            figures["efficiency"] = min(e for _, e in figures["efficiency_by_tokens"])
        if self.gemm_curve:
            # The planner prices each model's GEMMs on this machine's curve; what a real model's matmuls reached is
            # kept as their fraction of the curve at that model's own GEMMs (attention, small products, caches).
            gemm = self.gemm_model()
            figures["gemm"] = gemm
            shapes = self.matmul_shapes or {}
            if self.matmul_efficiency and all(str(float(t)) in shapes for t, _ in self.matmul_efficiency):
                figures["efficiency_by_tokens"] = tuple(
                    (float(t), min(1.0, float(e) / gemm.efficiency_of(
                        [Gemm(*shape) for shape in shapes[str(float(t))]], training=False)))
                    for t, e in self.matmul_efficiency)
        return figures

    def gemm_model(self) -> GemmModel:
        """This machine's GEMM curve, fitted to ``gemm_curve`` against ``matmul_flops`` (fp32 operands)."""
        measured = [GemmMeasurement(int(m), int(n), int(k), s, "calibration") for m, n, k, s in self.gemm_curve or ()]
        return fit_gemm_model(measured, self.matmul_flops, bandwidth=self.elementwise_bandwidth or 0.0, element_bytes=4)


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_calibration(threads: Optional[int] = None, path: Optional[Path] = None) -> Optional[Calibration]:
    """The cached calibration of this machine for ``threads`` (default: this process's), or ``None``."""
    threads = threads or torch.get_num_threads()
    entry = _load(path or cache_path()).get(machine_key(threads))
    return Calibration(**entry) if entry else None


def calibrate(threads: Optional[int] = None, *, path: Optional[Path] = None, refresh: bool = False,
              measure_comm: bool = True, measure_dtensor: bool = True,
              dtensor_workload: Optional[Callable[[], tuple[Callable[[], None], Callable[[], None]]]] = None,
              step_overhead: Optional[Callable[[int], float]] = None,
              compute_workload: Optional[Callable[[int, int], Callable[[], None]]] = None) -> Calibration:
    """Measure this machine (see the module docstring) unless cached, cache it and return it.

    ``measure_comm=False`` / ``measure_dtensor=False`` skip the two measurements that start processes
    of their own (gloo's sweep: nominal figures instead; DTensor's dispatch: not calibrated).
    ``dtensor_workload``: the tensor-parallel ``(forward and backward, optimizer step)`` DTensor's dispatch is timed
    on (see :func:`measure_dtensor_op_costs`; ``lightning-para calibrate`` passes the GPT recipe's).
    ``step_overhead(threads)``: measures the training loop's fixed seconds per step (the planner sits below
    the strategy, so ``lightning-para calibrate`` passes a Lightning run's); not measured without it.
    ``compute_workload(batch, seq_len)``: a plain model's training step whose matmuls set ``matmul_efficiency`` at
    :data:`EFFICIENCY_BATCHES` (:func:`measure_matmul_efficiency`; ``lightning-para calibrate`` passes the GPT
    recipe's); 1 without it."""
    threads = threads or torch.get_num_threads()
    path = path or cache_path()
    if not refresh:
        found = cached_calibration(threads, path)
        if found is not None:
            return found
    processes = max(1, available_cores() // threads)  # the ranks of a run that fills this machine
    flops, op_seconds, bandwidth_elementwise, curve, gemm_curve, shapes = measure_rank_gemms(
        threads, processes, workload=compute_workload)
    dtensor_op_seconds, dtensor_optimizer_op_seconds = (
        measure_dtensor_op_costs(threads, workload=dtensor_workload, processes=processes)
        if measure_dtensor else (None, None))
    step_overhead_seconds = step_overhead(threads) if step_overhead is not None else None
    bandwidth, latency = measure_gloo() if measure_comm else (2e9, 5e-5)
    result = Calibration(
        matmul_flops=flops, bandwidth=bandwidth, latency=latency, threads=threads, key=machine_key(threads),
        measured_at=time.time(), load=os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
        op_seconds=op_seconds, dtensor_op_seconds=dtensor_op_seconds, step_overhead_seconds=step_overhead_seconds,
        elementwise_bandwidth=bandwidth_elementwise, processes=processes,
        matmul_efficiency=[list(point) for point in curve] if curve else None,
        dtensor_optimizer_op_seconds=dtensor_optimizer_op_seconds, gemm_curve=gemm_curve,
        matmul_shapes={str(t): [list(shape) for shape in found] for t, found in shapes.items()} or None,
    )
    data = _load(path)
    data[result.key] = asdict(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
    return result


__all__ = ["Calibration", "cache_path", "cached_calibration", "calibrate", "machine_key"]
