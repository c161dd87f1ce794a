"""Optimizer state by parameter name, as global DTensors, whatever the layout produced it.

Every tensor of a saved optimizer state is a global, parameter-shaped DTensor:

* ZeRO-0: the optimizer's own tensors (DTensors under TP, plain replicated tensors otherwise);
* ZeRO-1/2: this rank's row shard, described as ``Shard(0)`` over the data-parallel mesh
  (``_StridedShard`` when TP also splits rows, the layout FSDP2 uses);
* ZeRO-3: FSDP2's sharded DTensors.

So a checkpoint written by one layout loads into another (dp=2 ZeRO-1 into dp=4 ZeRO-3, say):
DCP reads whichever byte ranges each new shard needs. ``bf16-true`` runs also save the fp32
master weights (``_master``), which consolidation turns into the model weights.

Why not ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: ZeRO-1/2 step
row shards of the parameters that torch does not know (``ParamSlot.master``), so torch cannot
name them; describing every layout here gives one format that all layouts read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_para.checkpoint.format import MASTER_KEY, load_sharded_into
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data.layout import ParamSlot, all_gather_rows, contiguous_stride
from lightning_para.parallel.data.interface import DataParallel


@dataclass
class OptimParam:
    """How one tensor the optimizer steps maps to a named, global model parameter."""

    fqn: str
    to_global: Callable[[Tensor], Any]
    slot: Optional[ParamSlot] = None

    @property
    def gathered(self) -> bool:
        """Saved gathered over dp (see :func:`slot_to_global`): loading copies this rank's rows back."""
        slot = self.slot
        return slot is not None and slot.sharded and not slot.describable

    def copy_back(self, loaded: Any, target: Tensor) -> None:
        assert self.slot is not None
        target.data.copy_(self.slot.local_rows(loaded.to_local()).view(target.shape))

    @property
    def separate_master(self) -> bool:
        return self.slot is not None and self.slot.separate_master


def gather_rows(slot: ParamSlot, local: Tensor) -> Tensor:
    """All-gather the dp row shards (``torch.chunk`` layout) of ``slot`` into its whole local tensor."""
    out = torch.zeros(slot.world, slot.chunk_rows * slot.row_numel, dtype=local.dtype, device=local.device)
    out[slot.rank, : local.numel()].copy_(local.reshape(-1))
    for work in all_gather_rows(out, slot.rank, slot.group):
        work.wait()
    return out.view(-1)[: slot.numel].view(slot.local.shape)  # padding only follows the last non-empty shard


def slot_to_global(slot: ParamSlot, local: Tensor, dims: ParallelDims) -> Any:
    """Describe a tensor shaped like ``slot``'s shard (or its whole local parameter) globally."""
    param = slot.param
    is_dtensor = isinstance(param, DTensor)
    global_shape = tuple(param.shape) or (1,)
    if not slot.sharded:
        if is_dtensor:
            return DTensor.from_local(
                local.view(slot.local.shape), param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride(),
            )
        return local
    if is_dtensor and not slot.describable:
        # A dp chunk of a strided TP shard (a fused q|k|v projection) mixes rows of the
        # blocks; no placement describes it. Gather the dp rows and describe the tp shard,
        # replicated over dp (`OptimParam.copy_back` takes this rank's rows after loading).
        mesh = dims.get_mesh(slot.mesh.mesh_dim_names[0], *param.device_mesh.mesh_dim_names)
        return DTensor.from_local(
            gather_rows(slot, local), mesh, (Replicate(), *param.placements), run_check=False,
            shape=global_shape, stride=contiguous_stride(global_shape),
        )
    return slot.shard_as_dtensor(local, dims.get_mesh)


def optimizer_params(
    module: nn.Module, data_parallel: DataParallel, dims: ParallelDims
) -> dict[int, OptimParam]:
    """Map ``id(tensor the optimizer steps)`` to its name and global view (the shards data parallelism's
    optimizers step instead of parameters: :meth:`DataParallel.optimizer_slots`)."""
    views = {id(p): OptimParam(name, lambda t: t) for name, p in module.named_parameters()}
    for slot in data_parallel.optimizer_slots():
        views[id(slot.master)] = OptimParam(slot.name, lambda t, s=slot: slot_to_global(s, t, dims), slot)
    return views


def optimizer_state_dict(optimizer: torch.optim.Optimizer, views: Mapping[int, OptimParam]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, with global (DTensor) tensors."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for q in group["params"]:
            view = views.get(id(q))
            if view is None:
                raise RuntimeError("An optimizer parameter is not a parameter of the model; cannot name it in a checkpoint.")
            names.append(view.fqn)
            entry: dict[str, Any] = {}
            for key, value in optimizer.state.get(q, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape == q.shape:
                    entry[key] = view.to_global(value)
                elif isinstance(value, Tensor) and value.dim() > 0:
                    # Not parameter-shaped (e.g. factored statistics): saved per rank, same layout only.
                    entry[f"{key}@rank{rank}"] = value
                else:
                    entry[key] = value
            if view.separate_master:
                entry[MASTER_KEY] = view.to_global(q.detach())
            state[view.fqn] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer, data_parallel: DataParallel) -> None:
    """Create an optimizer's state tensors without changing any weight (for checkpoint loading).

    Runs one step with zero gradients and ``lr=0`` (and no weight decay) on parameters that
    have no state yet, then restores every hyperparameter. ZeRO neither syncs nor gathers for it.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]
    if not params:
        return
    saved = [dict(g) for g in optimizer.param_groups]
    saved_grads = {p: p.grad for p in params}
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0 if not isinstance(g["lr"], Tensor) else torch.zeros_like(g["lr"])
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        with data_parallel.step_without_communication():
            optimizer.step()
    finally:
        for g, old in zip(optimizer.param_groups, saved):
            for k, v in old.items():
                if k != "params":
                    g[k] = v
        for p in params:
            p.grad = saved_grads[p]


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    views: Mapping[int, OptimParam],
    path: Union[str, Path],
    prefix: str,
    data_parallel: DataParallel,
) -> None:
    """Restore one optimizer from a sharded checkpoint into the current layout."""
    init_optimizer_state(optimizer, data_parallel)
    template = {prefix: optimizer_state_dict(optimizer, views)}
    flat = load_sharded_into(path, template)
    missing = set(flat.pop("__missing__"))
    # Tensors were loaded in place; plain values (hyperparameters, ints) come back in `flat`.
    for gi, group in enumerate(optimizer.param_groups):
        gkey = f"{prefix}.param_groups.{gi}."
        for key in list(group):
            if key != "params" and gkey + key in flat:
                group[key] = flat[gkey + key]
        for q in group["params"]:
            view = views[id(q)]
            skey = f"{prefix}.state.{view.fqn}."
            for key, value in list(optimizer.state.get(q, {}).items()):
                if not isinstance(value, Tensor) and skey + key in flat:
                    optimizer.state[q][key] = flat[skey + key]
                elif view.gathered and skey + key in flat and value.shape == q.shape:
                    view.copy_back(flat[skey + key], value)
            if view.gathered and view.separate_master and skey + MASTER_KEY in flat:
                view.copy_back(flat[skey + MASTER_KEY], q)
            if view.separate_master and skey + MASTER_KEY in missing:
                # The checkpoint has no fp32 master (it came from an fp32 run): take the loaded weights.
                view.slot.load_master(view.slot.local)
    data_parallel.gather_params()


__all__ = ["gather_rows", "init_optimizer_state", "load_optimizer_state", "optimizer_params", "optimizer_state_dict", "slot_to_global"]
