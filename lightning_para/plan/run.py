"""From a ParaStrategy run to the planner's inputs, and back: layout, batch, hardware.

The planner (:func:`~lightning_para.plan.estimate`) prices a :class:`Layout` of a
:class:`ModelDesc` on a :class:`Cluster` for a :class:`Training`. A Lightning run states the same
things differently: a :class:`~lightning_para.config.ParallelConfig`, a batch per data-parallel
rank as the DataLoader yields it, a precision plugin, an optimizer, and the machine it runs on.
This module translates between the two, so that

* ``ParaStrategy(layout="auto")`` can turn the planner's choice into a config
  (:meth:`ParallelConfig.with_layout`, through :meth:`Layout.strategy_kwargs`: the one mapping);
* the profiler and ``lightning-para plan --validate`` can ask the planner about *this* run
  (:func:`layout_from_config`, :func:`run_training`, :func:`local_cluster`) and compare.

Hardware figures for the local machine: a GPU's memory from the device, its peak from
Lightning's FLOPs table (``get_available_flops``) and its links from :data:`GPU_SPECS` when
its name is known; on CPU, the machine's RAM divided among the processes on it and nominal
figures for a gloo process (:data:`CPU_PROCESS`), which only the step-time estimate uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, Optional

import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data import layout as data_layout
from lightning_para.plan.calibrate import cached_calibration
from lightning_para.plan.cluster import GPU_SPECS, Cluster, Training
from lightning_para.plan.cost import Estimate, estimate
from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
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
        # CPU processes talk over gloo: ZeRO-1/2 all-reduce their buckets (see `data_layout`).
        figures["reduce_scatter_is_all_reduce"] = data_layout.GLOO_REDUCE_SCATTER_AS_ALL_REDUCE
    else:
        name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
        known = next((spec for key, spec in GPU_SPECS.items() if key.split("-")[0] in name), None)
        figures = {k: v for k, v in (known or UNKNOWN_GPU_LINKS).items() if k != "memory_bytes"}
        figures.pop("peak_flops", None)
        figures["peak_flops"] = detect_peak_flops(device) or (known or {}).get("peak_flops", 1e14)
    if peak_flops is not None:
        figures["peak_flops"] = peak_flops
    return Cluster(nodes=world_size // per_node, gpus_per_node=per_node, memory_bytes=memory, **figures)


def layout_from_config(config: ParallelConfig, dims: ParallelDims) -> Layout:
    """The planner's :class:`Layout` of a resolved ParaStrategy configuration (:meth:`Layout.from_config`)."""
    return Layout.from_config(config, dims)


def config_from_layout(config: ParallelConfig, layout: Layout) -> ParallelConfig:
    """``config`` with the planner's degrees and options (:meth:`ParallelConfig.with_layout`)."""
    return config.with_layout(layout)


# Short names accepted by `--layout` beside every Layout field (= every ParaStrategy layout argument).
LAYOUT_ALIASES = {"sp": "sequence_parallel", "m": "microbatches", "v": "virtual_stages",
                  "recompute": "activation_checkpointing", "bucket_mb": "bucket_size_mb"}


def _field_kind(annotation: Any) -> type:
    text = str(annotation)
    for kind, name in ((bool, "bool"), (float, "float"), (tuple, "tuple"), (int, "int")):
        if name in text:
            return kind
    return str


# `--layout "tp=2,pp=2,zero=1"` keys -> (ParaStrategy argument, value type): Layout's fields, which are
# ParaStrategy's argument names (tests/unit/test_layout_vocabulary.py), and the short aliases.
LAYOUT_KEYS: dict[str, tuple[str, type]] = {
    **{f.name: (f.name, _field_kind(f.type)) for f in fields(Layout)},
    **{alias: (name, _field_kind(next(f.type for f in fields(Layout) if f.name == name)))
       for alias, name in LAYOUT_ALIASES.items()},
}
_OPTIONAL = {f.name for f in fields(Layout) if "Optional" in str(f.type)}


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=2,pp=2,zero=1"`` -> ParaStrategy arguments (``ValueError`` naming a bad entry).

    Keys: every :class:`Layout` field, which are ParaStrategy's layout arguments (``dp tp pp ep cp
    cp_method cp_load_balance dp_replicate dp_shard zero zero3_units sequence_parallel ... ``), and
    the aliases ``sp m v recompute bucket_mb``. Booleans take ``1``/``0``/``true``/``false``; lists
    (``pipeline_split``) are written with ``:`` (``pipeline_split=0:3``); ``none`` is ``None`` where
    the argument may be ``None``. The values are checked as a :class:`Layout` checks them.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in LAYOUT_KEYS or not value:
            raise ValueError(
                f"`--layout` entry {item!r} is not KEY=VALUE with a key among {', '.join(LAYOUT_KEYS)}"
                f" (e.g. --layout \"tp=2,pp=2\")."
            )
        name, kind = LAYOUT_KEYS[key]
        if name in _OPTIONAL and value.lower() in ("none", "null"):
            out[name] = None
        elif kind is bool:
            if value.lower() not in ("1", "0", "true", "false"):
                raise ValueError(f"`--layout` entry {item!r}: {key} takes true or false.")
            out[name] = value.lower() in ("1", "true")
        elif kind is int:
            if not value.isdigit() or int(value) < (0 if name == "zero" else 1):
                raise ValueError(f"`--layout` entry {item!r}: {key} takes a positive integer.")
            out[name] = int(value)
        elif kind is float:
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"`--layout` entry {item!r}: {key} takes a number.") from None
        elif kind is tuple:
            parts = value.split(":")
            if not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"`--layout` entry {item!r}: {key} takes integers separated by ':' (e.g. 0:3).")
            out[name] = [int(p) for p in parts]
        else:
            out[name] = None if value.lower() in ("none", "null") and name in _OPTIONAL else value
        _check_value(item, name, out[name])
    return out


def _check_value(item: str, name: str, value: Any) -> None:
    """A value as :class:`Layout` checks it (degrees and choices; relations come later, from ParaStrategy)."""
    if name in ("dp", "dp_replicate", "dp_shard", "tp", "pp", "ep", "cp", "virtual_stages", "microbatches", "zero"):
        return  # checked above; their relations are ParaStrategy's to check with the world size
    if name == "sequence_parallel" and value:
        return  # Layout needs tp > 1 beside it; ParaStrategy checks the pair
    try:
        # One relation checked here on its own: "reduce_each_microbatch" needs zero=2 beside it.
        Layout(**{name: value, **({"zero": 2} if value == "reduce_each_microbatch" else {})})
    except ValueError as err:
        raise ValueError(f"`--layout` entry {item!r}: {err}") from None


def layout_arguments(layout: Layout) -> dict[str, Any]:
    """ParaStrategy arguments of a planner :class:`Layout` (:meth:`Layout.strategy_kwargs`)."""
    return layout.strategy_kwargs()


def strategy_overrides(arguments: dict[str, Any]) -> list[str]:
    """``--trainer.strategy.KEY VALUE`` command-line overrides for LightningCLI."""
    out = []
    for key, value in arguments.items():
        if value is None:
            text = "null"
        elif isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (list, tuple)):
            text = json.dumps(list(value))
        else:
            text = str(value)
        out += [f"--trainer.strategy.{key}", text]
    return out


def optimizer_kind(optimizer: Any) -> Optional[str]:
    """The planner's optimizer name for a torch optimizer: ``"adam"`` (Adam family: two fp32
    moments), ``"sgd"`` (SGD with momentum), or ``None`` for anything it does not model."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
    if name in ("Adam", "AdamW") and not group.get("amsgrad", False):
        return "adam"
    if name == "SGD" and group.get("momentum", 0):
        return "sgd"
    return None


def run_training(
    seq_len: int,
    batch_per_rank: int,
    dp: int,
    *,
    accumulation: int = 1,
    precision: str = "32-true",
    optimizer: str = "adam",
) -> Training:
    """The :class:`Training` of a run whose data-parallel ranks each load ``batch_per_rank``
    sequences of ``seq_len`` tokens per batch, ``accumulation`` batches per optimizer step."""
    return Training(
        seq_len=seq_len, global_batch=batch_per_rank * dp * accumulation, micro_batch=None,
        accumulation=accumulation, precision=precision, optimizer=optimizer,
    )


def predict_run(
    model: ModelDesc, config: ParallelConfig, dims: ParallelDims, training: Training, cluster: Cluster
) -> Estimate:
    """The planner's prediction for a ParaStrategy run (raises ``ValueError`` if it cannot price it)."""
    return estimate(model, cluster, training, layout_from_config(config, dims))


__all__ = [
    "CPU_PROCESS", "LAYOUT_ALIASES", "LAYOUT_KEYS", "config_from_layout", "detect_peak_flops", "device_memory_bytes", "layout_arguments",
    "layout_from_config", "local_cluster", "optimizer_kind", "parse_layout", "predict_run", "run_training",
    "strategy_overrides",
]
