"""This machine as the planner's :class:`~lightning_para.plan.cluster.Cluster`: its memory, peak and links.

Hardware figures for the local machine: a GPU's memory from the device, its peak from Lightning's FLOPs
table (``get_available_flops``) and its links from :data:`~lightning_para.plan.cluster.GPU_SPECS` when its
name is known; on CPU, the machine's RAM divided among the processes on it and nominal figures for a gloo
process (:data:`CPU_PROCESS`), replaced by this machine's calibration when one is cached
(:func:`~lightning_para.calibrate.cache.cached_calibration`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lightning_para.calibrate.cache import cached_calibration
from lightning_para.parallel.data import layout as data_layout
from lightning_para.plan.cluster import AT_SCALE_EFFICIENCY, GPU_SPECS, Cluster
from lightning_para.plan.gemm import gpu_gemm_model
from lightning_para.threads import available_cores, thread_budget, user_chose_threads

# One CPU process talking gloo over the loopback device: rough figures (dense fp32 matmul FLOP/s of
# one core, memcpy-bound socket bandwidth, per-message latency). Only step-time estimates use them.
# op_seconds: ~10 us per eager aten operator, forward and backward (measured by `calibrate` on the
# development VM, AMD EPYC, 1 thread); dtensor_op_seconds: ~150 us per operator through DTensor's
# dispatch (`measure_dtensor_op_seconds`, same VM); elementwise_bandwidth: ~10 GB/s moved by the non-matmul
# operators on activation-sized tensors (`measure_elementwise_bandwidth`, same VM); a calibration replaces all of these.
CPU_PROCESS = {"peak_flops": 5e10, "intra_node_bw": 2e9, "inter_node_bw": 1e9,
               "intra_node_latency": 5e-5, "inter_node_latency": 2e-4, "op_seconds": 1e-5,
               "dtensor_op_seconds": 1.5e-4, "dtensor_optimizer_op_seconds": 0.0, "step_overhead_seconds": 0.0,
               "elementwise_bandwidth": 1e10}
# A GPU not in GPU_SPECS: PCIe-class links.
UNKNOWN_GPU_LINKS = {"intra_node_bw": 5e10, "inter_node_bw": 1.25e10}


def detect_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """The device's peak FLOP/s for ``dtype`` from Lightning's table (``get_available_flops``), or
    ``None`` for CPUs and devices it does not know."""
    if device.type == "cpu":
        return None
    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None


def device_memory_bytes(device: torch.device, processes_per_node: int = 1) -> float:
    """Memory one process may use: the accelerator's total memory, or on CPU the machine's
    physical RAM divided among the ``processes_per_node`` processes sharing it."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(ram) / max(1, processes_per_node)


def local_cluster(
    world_size: int,
    processes_per_node: int,
    device: torch.device,
    *,
    memory_bytes: Optional[float] = None,
    peak_flops: Optional[float] = None,
) -> Cluster:
    """A :class:`Cluster` describing ``world_size`` processes of this kind of machine, ``processes_per_node``
    per node (memory and peak of ``device`` unless given)."""
    per_node = max(1, min(processes_per_node, world_size))
    if world_size % per_node:
        per_node = 1
    memory = memory_bytes if memory_bytes is not None else device_memory_bytes(device, per_node)
    gpu: Optional[str] = None
    if device.type == "cpu":
        figures: dict[str, Any] = dict(CPU_PROCESS)
        # A rank's intra-op threads: this process's inside a run (the launcher gave it its budget);
        # outside one (the `plan` CLI), the budget `apply_thread_budget` will give each rank.
        inside = torch.distributed.is_available() and torch.distributed.is_initialized()
        threads = torch.get_num_threads() if inside or user_chose_threads() else thread_budget(per_node)
        # This machine's measured figures, when `calibrate()` has cached them for this thread budget.
        calibration = cached_calibration(threads)
        if calibration is not None:
            figures.update(calibration.cluster_figures())
        # More rank threads than cores (the README demo: 4 one-thread ranks on 2 cores): the cores
        # are time-shared, so each rank computes at cores / threads of its calibrated (alone) rate.
        share = min(1.0, available_cores() / (per_node * threads))
        figures["peak_flops"] *= share
        figures["elementwise_bandwidth"] *= share
        figures["op_seconds"] /= share
        figures["dtensor_op_seconds"] /= share
        figures["dtensor_optimizer_op_seconds"] /= share  # 0 (not timed apart): dtensor_op_seconds is used
        figures["step_overhead_seconds"] /= share
        # CPU processes talk over gloo: ZeRO-1/2 reduce-scatter by send and receive (see `data_layout`).
        figures["reduce_scatter_by_send_recv"] = data_layout.GLOO_SHORTCUTS
    else:
        name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
        gpu = next((key for key in GPU_SPECS if key.split("-")[0] in name), None)
        known = GPU_SPECS.get(gpu) if gpu else None
        figures = {k: v for k, v in (known or UNKNOWN_GPU_LINKS).items() if k != "memory_bytes"}
        figures.pop("peak_flops", None)
        figures["peak_flops"] = detect_peak_flops(device) or (known or {}).get("peak_flops", 1e14)
    if peak_flops is not None:
        figures["peak_flops"] = peak_flops
    if device.type != "cpu" and gpu is not None:  # its GEMM curve and at-scale factor, as `Cluster.of(gpu)` (plan/gemm.py)
        figures["gemm"] = gpu_gemm_model(gpu, figures["peak_flops"], figures.get("elementwise_bandwidth", 0.0))
        figures["at_scale_efficiency"] = AT_SCALE_EFFICIENCY[gpu]
    return Cluster(nodes=world_size // per_node, gpus_per_node=per_node, memory_bytes=memory, **figures)


__all__ = ["CPU_PROCESS", "UNKNOWN_GPU_LINKS", "detect_peak_flops", "device_memory_bytes", "local_cluster"]
