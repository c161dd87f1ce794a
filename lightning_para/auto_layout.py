"""``ParaStrategy(layout="auto")``: the planner picks the layout at setup.

What it asks the planner (:func:`search`):

* the model: :func:`~lightning_para.describe.describe_module` of the LightningModule as it is at setup
  (built in ``__init__``, whole, possibly on the meta device), with its ``configure_pipeline()``;
* the run: sequence length and batch from the datamodule (``seq_len``/``seq_length``/
  ``max_seq_length``/``block_size``; ``global_batch_size``, else ``batch_size`` per data-parallel
  rank; or the model's ``hparams``), else from the first training batch (its first tensor of two
  or more dimensions, ``input_ids`` first in a mapping, read as ``(batch per rank, sequence)``),
  the trainer's ``accumulate_grad_batches``, the precision plugin's precision, Adam (the
  optimizer is created after the layout);
* the machine: the world size, processes per node, and each process's memory (the device's, or
  on CPU the RAM divided among the node's processes, or ``layout_memory_gb``).

Which layouts it may choose: every degree and option the user left at its default; a value
the user set (``tp=2``, ``cp=2``, ``dp_replicate=2``, ``dp_shard=2``, ``dp=2``, ``zero=1``,
``schedule="zbv"``, ``sequence_parallel=True``, ...) is kept, and so is every option the search
does not vary (``cp_method``, ``cp_load_balance``, ``zero3_units``, ``loss_parallel``, ...:
``plan.layout.FIXED_OPTIONS``). ``cp`` and ``dp_replicate`` are searched only when given (then
kept): context parallelism changes what the model's attention must support, and hybrid sharding
is a choice about the network the planner's nominal CPU figures cannot make.
Tensor parallelism is considered only for a model with a tensor-parallel plan, pipeline
parallelism only for one with ``configure_pipeline()``, expert parallelism only for MoE
models; sequence parallelism stays as the user set it (it changes what the model's code sees);
recomputation is none or full.

Every rank must build the same mesh, so rank 0 decides and broadcasts the layout (or the
reason no layout fits) before any other collective; every rank then applies it or raises the
same ``ValueError``. The choice and the runner-up are logged with their predictions.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_para.config import ParallelConfig
from lightning_para.spec.options import OPTIONS, ZERO_ACCUMULATION, ZERO_STAGES
from lightning_para.spec.schedules import PLANNED_SCHEDULES
from lightning_para.parallel.tensor.plan import resolve_plan
from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import Estimate
from lightning_para.describe import describe_module
from lightning_para.plan.layout import FIXED_OPTIONS, Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.result import PlanResult
from lightning_para.calibrate.machine import local_cluster
from lightning_para.plan.search import SearchSpace, search

SEQ_ATTRIBUTES = ("seq_len", "seq_length", "max_seq_length", "sequence_length", "block_size")
GB = 1e9


@dataclass(frozen=True)
class LayoutChoice:
    """What ``layout="auto"`` chose, as every rank knows it (rank 0 searched; the rest received it)."""

    layout: Layout
    summary: str  # the choice's prediction, one line
    runner_up: Optional[str]  # the runner-up's prediction, one line (None: nothing else fits)
    report: str  # the full log message


def _attribute(objects: list[Any], names: tuple[str, ...]) -> Optional[int]:
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if value is None and isinstance(getattr(obj, "hparams", None), dict):
                value = obj.hparams.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def batch_shape(batch: Any) -> Optional[tuple[int, int]]:
    """``(sequences, sequence length)`` of a training batch: its first tensor of two or more
    dimensions (``input_ids`` first in a mapping), or ``None`` when it has none."""
    if isinstance(batch, torch.Tensor):
        return (int(batch.shape[0]), int(batch.shape[1])) if batch.dim() >= 2 else None
    if isinstance(batch, Mapping):
        items = ([batch["input_ids"]] if "input_ids" in batch else []) + list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for item in items:
        shape = batch_shape(item)
        if shape is not None:
            return shape
    return None


def _train_loader(trainer: Any, module: nn.Module, datamodule: Any) -> Any:
    """The run's training loader as its owner gives it (the datamodule's, the model's, or the one
    passed to ``fit``), or ``None``."""
    if datamodule is not None and is_overridden("train_dataloader", datamodule, pl.LightningDataModule):
        return datamodule.train_dataloader()
    if isinstance(module, pl.LightningModule) and is_overridden("train_dataloader", module, pl.LightningModule):
        return module.train_dataloader()
    # Lightning keeps the loaders given to `fit(train_dataloaders=...)` here until its data setup.
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)  # private: see docs/architecture.md
    loader = getattr(source, "instance", None)
    if isinstance(loader, (pl.LightningModule, pl.LightningDataModule)):
        return None
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    return loader


def first_batch_shape(trainer: Any, module: nn.Module, datamodule: Any) -> tuple[Optional[tuple[int, int]], str]:
    """``((batch per rank, sequence length), "")`` from the run's first training batch, or
    ``(None, why not)``. Builds the loader and reads one batch; nothing else of the run happens."""
    try:
        # Only rank 0 plans: iterating a loader draws from the global RNG (its base seed), which
        # would leave rank 0's generator ahead of the others'. Restore it.
        with torch.random.fork_rng(devices=[]):
            loader = _train_loader(trainer, module, datamodule)
            if loader is None:
                return None, "there is no training loader to read a batch from"
            batch = next(iter(loader), None)
    except Exception as err:  # the loader may need `setup()`, which Lightning runs after the layout
        return None, f"reading the first training batch failed ({type(err).__name__}: {err})"
    if batch is None:
        return None, "the training loader is empty"
    shape = batch_shape(batch)
    return shape, "" if shape else "the first training batch holds no tensor of two or more dimensions"


def run_training_of(
    module: nn.Module, datamodule: Any, precision: str, accumulation: int = 1, trainer: Any = None
) -> Training:
    """The planner's :class:`Training` for a fit of ``module`` on ``datamodule`` (see the module docstring).

    Raises ``ValueError`` naming the attributes it looked for when the sequence length or the
    batch can be found neither there nor in the first training batch.
    """
    sources = [s for s in (datamodule, module, getattr(module, "config", None)) if s is not None]
    seq_len = _attribute(sources, SEQ_ATTRIBUTES)
    global_batch = _attribute(sources, ("global_batch_size",))
    per_rank = None if global_batch else _attribute(sources, ("batch_size",))
    why = ""
    if seq_len is None or (global_batch is None and per_rank is None):
        shape, why = first_batch_shape(trainer, module, datamodule)
        if shape is not None:  # the batch the loader yields is what each data-parallel rank loads
            per_rank, seq_len, global_batch = shape[0], shape[1], None
    if seq_len is None or (global_batch is None and per_rank is None):
        missing = "the sequence length" if seq_len is None else "the batch size"
        raise ValueError(
            f"`layout='auto'` could not find {missing} of the run: {why}. Give the datamodule (or the model's hparams)"
            f" a `seq_len` and a `global_batch_size` (or a per-device `batch_size`) attribute, as"
            f" lightning_para.recipes.TextDataModule has, or choose the layout yourself (dp/tp/pp/ep/zero)."
        )
    if global_batch is not None:
        return Training(seq_len=seq_len, global_batch=global_batch * accumulation, micro_batch=None,
                        accumulation=accumulation, precision=precision)
    return Training(seq_len=seq_len, batch_per_rank=per_rank, accumulation=accumulation, precision=precision)


def search_space(config: ParallelConfig, module: nn.Module, model: ModelDesc, world_size: int) -> SearchSpace:
    """The layouts ``layout="auto"`` may choose from: the user's non-default values are kept."""
    tp_ok = _has_tensor_parallel_plan(module, config)
    pp_ok = callable(getattr(module, "configure_pipeline", None)) and _pipeline_ok(module)
    if config.dp_replicate is not None:
        dp_replicate: tuple[int, ...] = (config.dp_replicate,)
    elif config.dp_shard is not None:  # dp_replicate = dp / dp_shard for whichever dp: `choose` keeps dp_shard
        dp_replicate = tuple(d for d in range(1, world_size + 1) if world_size % d == 0)
    else:
        dp_replicate = (1,)
    def kept(name: str) -> bool:  # a value the user set: not the declared default (lightning_para.spec.options)
        return getattr(config, name) != OPTIONS[name].default

    return SearchSpace(
        tp=(config.tp,) if kept("tp") or not tp_ok else None,
        pp=(config.pp,) if kept("pp") or not pp_ok else None,
        ep=(config.ep,) if kept("ep") or not model.is_moe else None,
        cp=(config.cp,),
        dp_replicate=dp_replicate,
        zero=(config.zero,) if kept("zero") else ZERO_STAGES,
        schedules=(config.schedule,) if kept("schedule") else PLANNED_SCHEDULES,
        virtual_stages=(config.virtual_stages,) if kept("virtual_stages") else (1, 2, 4),
        microbatches=(config.microbatches,),
        recompute=(config.activation_checkpointing,) if kept("activation_checkpointing") else (None, "full"),
        sequence_parallel=(config.sequence_parallel,),
        zero_accumulation=(config.zero_accumulation,) if kept("zero_accumulation") else ZERO_ACCUMULATION,
        options=Layout(**{name: getattr(config, name) for name in FIXED_OPTIONS}),
    )


def _has_tensor_parallel_plan(module: nn.Module, config: ParallelConfig) -> bool:
    try:
        plan, _ = resolve_plan(module, config.tp_plan)
    except ValueError:
        return False
    return bool(plan)


def _pipeline_ok(module: nn.Module) -> bool:
    try:
        module.configure_pipeline()
    except ValueError:  # e.g. tied weights: the model says it cannot be pipelined
        return False
    return True


def choose(
    model: ModelDesc, cluster: Cluster, training: Training, space: SearchSpace, dp: Optional[int] = None,
    dp_shard: Optional[int] = None,
) -> tuple[Estimate, Optional[Estimate], PlanResult]:
    """``(best, runner-up, search result)`` among the layouts of ``space`` (and ``dp``, ``dp_shard``
    when pinned).

    Raises ``ValueError`` listing the nearest misses when none fits.
    """
    result = search(model, cluster, training, space)
    if dp is not None:
        result.fits = [e for e in result.fits if e.layout.dp == dp]
    if dp_shard is not None:
        result.fits = [e for e in result.fits if e.layout.dp_shard == dp_shard]
    if not result.fits:
        misses = "; ".join(f"{r.layout.label()}: {r.reason}" for r in result.rejected[:4]) or "no layout to try"
        raise ValueError(
            f"`layout='auto'`: no layout of {cluster.world_size} processes fits {model.name} in"
            f" {cluster.usable_memory / GB:.1f} GB each ({training.batch_label()}, seq {training.seq_len}). Nearest:"
            f" {misses}. Lower the batch or sequence length, use more devices, or set `layout_memory_gb`."
        )
    return result.fits[0], (result.fits[1] if len(result.fits) > 1 else None), result


def _report(best: Estimate, runner_up: Optional[Estimate], result: PlanResult, device: str) -> str:
    gb = 1e9
    comm = " ".join(f"{d}={b / 1e6:.3g} MB" for d, b in best.comm_bytes().items()) or "none"
    lines = [
        f"ParaStrategy(layout='auto') chose {best.layout.label()} for {best.model.name} on"
        f" {best.cluster.world_size} processes ({device}, {best.cluster.usable_memory / gb:.1f} GB each;"
        f" {len(result.fits)} layouts fit, {len(result.rejected)} rejected).",
        f"  predicted: {best.summary()}; comm per step: {comm}",
        f"  runner-up: {runner_up.summary() if runner_up else 'none (no other layout fits)'}",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class RunSetting:
    """What ``layout="auto"`` reads of the run besides the config, the model and the data: built once by
    :func:`auto_configure` and passed down whole."""

    world_size: int
    processes_per_node: int
    device: torch.device
    precision: str
    accumulation: int = 1
    trainer: Any = None


def plan_layout(config: ParallelConfig, module: nn.Module, datamodule: Any, run: RunSetting) -> LayoutChoice:
    """Search the best layout for this run (no communication; see :func:`auto_configure`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parameter-count warning would print on every rank
        model = describe_module(module)
    training = run_training_of(module, datamodule, run.precision, run.accumulation, run.trainer)
    memory = config.layout_memory_gb * GB if config.layout_memory_gb is not None else None
    cluster = local_cluster(run.world_size, run.processes_per_node, run.device, memory_bytes=memory)
    dp = config.dp if isinstance(config.dp, int) else None
    space = search_space(config, module, model, run.world_size)
    best, runner_up, result = choose(model, cluster, training, space, dp, config.dp_shard)
    return LayoutChoice(
        layout=best.layout, summary=best.summary(), runner_up=runner_up.summary() if runner_up else None,
        report=_report(best, runner_up, result, run.device.type),
    )


def auto_configure(
    config: ParallelConfig,
    module: nn.Module,
    datamodule: Any,
    *,
    world_size: int,
    processes_per_node: int,
    device: torch.device,
    precision: str,
    accumulation: int = 1,
    trainer: Any = None,
) -> tuple[ParallelConfig, LayoutChoice]:
    """Rank 0 plans (:func:`plan_layout`) and broadcasts; every rank returns the chosen config, or
    raises rank 0's ``ValueError``. Call it on every rank, before any other collective."""
    payload: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            run = RunSetting(world_size, processes_per_node, device, precision, accumulation, trainer)
            payload[0] = plan_layout(config, module, datamodule, run)
        except ValueError as err:
            payload[0] = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    choice = payload[0]
    if isinstance(choice, str):
        raise ValueError(choice)
    return config.with_layout(choice.layout), choice


__all__ = [
    "LayoutChoice", "RunSetting", "auto_configure", "batch_shape", "choose", "first_batch_shape", "plan_layout", "run_training_of",
    "search_space",
]
