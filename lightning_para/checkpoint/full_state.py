"""Lightning's full-state contract: ``save_distributed_checkpoint=False``.

Lightning's FSDP and ModelParallel strategies, asked for ``lightning_module_state_dict()`` or
``optimizer_state(opt)`` with ``save_distributed_checkpoint=False``, return the *full* state as
plain CPU tensors on global rank 0 and ``{}`` on every other rank; ``trainer.save_checkpoint``
then writes that one dict from rank 0. This module does the same for every layout:

* each DTensor (TP, EP, FSDP2 shards) and each ZeRO-1/2 shard (described globally by
  :func:`~lightning_para.checkpoint.optimizer.slot_to_global`) is materialized with
  ``full_tensor()``, a collective over its own mesh, in the same order on every rank;
* under pipeline parallelism each stage's first rank (dp and tp coordinate 0) sends its
  stage's part to rank 0 (``gather_object`` over the ``pp`` group that holds rank 0);
* a fused projection stored in tp's rank-major row order
  (:class:`~lightning_para.parallel.tensor.columns.FusedBlocksColwise`) is written in the model's own order, so
  one-device loaders get the model that was trained;
* the optimizer state comes out in PyTorch's own format (parameters numbered in param-group
  order, as :func:`~lightning_para.checkpoint.consolidate.number_optimizer_state` numbers them),
  so ``torch.optim.Optimizer.load_state_dict`` and Lightning's DDP strategy read it.

Model weights are the weights the optimizer steps: under ``bf16-true``/``16-true`` with ZeRO
0-2 those are the fp32 masters (as in a consolidated file), so a full checkpoint resumes
exactly. Costs: the whole model and optimizer state in rank 0's memory, as in Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_para.checkpoint.consolidate import number_optimizer_state
from lightning_para.checkpoint.format import MASTER_KEY
from lightning_para.checkpoint.optimizer import slot_to_global
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.parallel.tensor.columns import rank_major_rows, reorder_named


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _plain(value: Any) -> Any:
    """A full CPU copy of a tensor (collective for a DTensor); other values as they are."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    return value


def _to_rank_zero(part: dict[str, Any], dims: ParallelDims) -> Optional[list[dict[str, Any]]]:
    """Each pipeline stage's ``part`` on global rank 0 (stage order); ``None`` elsewhere."""
    if not dims.pp_enabled:
        return [part] if _rank() == 0 else None
    if dims.local_rank("dp") != 0 or dims.local_rank("tp") != 0:
        return None  # this stage's first rank speaks for it
    gathered: Optional[list[Any]] = [None] * dims.pp if _rank() == 0 else None
    dist.gather_object(part, gathered, dst=0, group=dims.group("pp"))
    return gathered


@torch.no_grad()
def full_model_state(module: nn.Module, data_parallel: DataParallel, dims: ParallelDims) -> dict[str, Any]:
    """``module.state_dict()`` as full plain CPU tensors on global rank 0, ``{}`` elsewhere (collective)."""
    masters = {s.name: s for s in data_parallel.optimizer_slots() if s.separate_master}
    part: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        slot = masters.get(key)
        if slot is not None:  # the optimizer's fp32 weights, not their bf16 copy
            value = _plain(slot_to_global(slot, slot.master.detach(), dims)).reshape(value.shape)
        part[key] = _plain(value)
    part = reorder_named(part, rank_major_rows(module), to_model=True)  # one file holds the model's own rows
    stages = _to_rank_zero(part, dims)
    if stages is None:
        return {}
    return {k: v for stage in stages for k, v in stage.items()}


@torch.no_grad()
def full_optimizer_state(named: Mapping[str, Any], module: nn.Module, dims: ParallelDims) -> dict[str, Any]:
    """An optimizer state by parameter name (:func:`~lightning_para.checkpoint.optimizer_state_dict`, its
    param groups naming the whole model's parameters) in PyTorch's format, full, on global rank 0;
    ``{}`` elsewhere (collective)."""
    state = {
        fqn: {k: _plain(v) for k, v in entry.items() if k != MASTER_KEY and "@rank" not in k}
        for fqn, entry in named["state"].items()
    }
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    stages = _to_rank_zero({"state": state, "shapes": shapes, "rows": rank_major_rows(module)}, dims)
    if stages is None:
        return {}
    merged = {"state": {k: v for stage in stages for k, v in stage["state"].items()}, "param_groups": named["param_groups"]}
    all_shapes = {k: torch.Size(v) for stage in stages for k, v in stage["shapes"].items()}
    return number_optimizer_state(merged, all_shapes, rows={k: v for stage in stages for k, v in stage["rows"].items()})


__all__ = ["full_model_state", "full_optimizer_state"]
