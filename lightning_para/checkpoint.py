"""Sharded checkpoints (``torch.distributed.checkpoint``), consolidation, resharding.

Format: a directory with DCP shards for ``state_dict`` (the model) and ``optimizer_<i>``, and
``meta.pt`` (everything else Lightning saves: loops, epoch, LR schedulers, callbacks,
hyperparameters, loss-scaler state). Optimizer state is keyed by parameter *name* and every
tensor is a global, parameter-shaped DTensor, whatever produced it:

* ZeRO-0: the optimizer's own tensors (DTensors under TP, plain replicated tensors otherwise);
* ZeRO-1/2: this rank's row shard, described as ``Shard(0)`` over the data-parallel mesh
  (``_StridedShard`` when TP also splits rows, the layout FSDP2 uses);
* ZeRO-3: FSDP2's sharded DTensors.

So a checkpoint written by one layout loads into another (dp=2 ZeRO-1 into dp=4 ZeRO-3, say):
DCP reads whichever byte ranges each new shard needs. ``bf16-true`` runs also save the fp32
master weights (``_master``), which consolidation turns into the model weights.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data_parallel import ParamSlot, ZeroDataParallel, init_optimizer_state
from lightning_para.parallel.tp_checkpoint import StridedBoxes, for_dcp, gather_rows

METADATA_FILENAME = "meta.pt"
MASTER_KEY = "_master"


@dataclass
class _OptimParam:
    """How one tensor the optimizer steps maps to a named, global model parameter."""

    fqn: str
    to_global: Callable[[Tensor], Any]
    slot: Optional[ParamSlot] = None

    @property
    def gathered(self) -> bool:
        """Saved gathered over dp (see :func:`slot_to_global`): loading copies this rank's rows back."""
        slot = self.slot
        return slot is not None and slot.sharded and any(
            isinstance(p, _StridedShard) for p in getattr(slot.param, "placements", ())
        )

    def copy_back(self, loaded: Any, target: Tensor) -> None:
        assert self.slot is not None
        target.data.copy_(self.slot.local_rows(loaded.to_local()).view(target.shape))

    @property
    def separate_master(self) -> bool:
        slot = self.slot
        if slot is None or slot.master is None:
            return False
        return slot.master.untyped_storage().data_ptr() != slot.local.untyped_storage().data_ptr()


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


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
    if is_dtensor:
        base = param.device_mesh
        mesh = dims.get_mesh(slot.mesh.mesh_dim_names[0], *base.mesh_dim_names)
        if any(isinstance(p, _StridedShard) for p in param.placements):
            # A dp chunk of a strided TP shard (a fused q|k|v projection) mixes rows of the
            # blocks; no placement describes it. Gather the dp rows and describe the tp shard,
            # replicated over dp (`_OptimParam.copy_back` takes this rank's rows after loading).
            return DTensor.from_local(
                gather_rows(slot, local), mesh, (Replicate(), *param.placements), run_check=False,
                shape=global_shape, stride=_contiguous_stride(global_shape),
            )
        rows_split = math.prod(base.size(i) for i, p in enumerate(param.placements) if p.is_shard(0))
        dp_placement = _StridedShard(0, split_factor=rows_split) if rows_split > 1 else Shard(0)
        placements = (dp_placement, *param.placements)
    else:
        mesh, placements = slot.mesh, (Shard(0),)
    return DTensor.from_local(
        local.view(slot.shard_shape), mesh, placements, run_check=False,
        shape=global_shape, stride=_contiguous_stride(global_shape),
    )


def optimizer_params(module: nn.Module, zero: Optional[ZeroDataParallel], dims: ParallelDims) -> dict[int, _OptimParam]:
    """Map ``id(tensor the optimizer steps)`` to its name and global view."""
    views = {id(p): _OptimParam(name, lambda t: t) for name, p in module.named_parameters()}
    if zero is not None:
        for slot in zero.slots:
            if slot.master is not None:
                views[id(slot.master)] = _OptimParam(slot.name, lambda t, s=slot: slot_to_global(s, t, dims), slot)
    return views


def optimizer_state_dict(optimizer: torch.optim.Optimizer, views: Mapping[int, _OptimParam]) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------- save / load
def save_sharded(path: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Write a sharded checkpoint directory (collective: call on every rank)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(for_dcp(tensors), checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(metadata, path / METADATA_FILENAME)


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def load_sharded_into(path: Union[str, Path], template: dict[str, Any]) -> dict[str, Any]:
    """Load the keys of ``template`` that the checkpoint has, in place; returns the flat loaded dict.

    Keys the checkpoint lacks (an fp32 master when the checkpoint came from a fp32 run) stay
    untouched and are reported under ``"__missing__"``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    reader = FileSystemReader(str(path))
    available = set(reader.read_metadata().state_dict_metadata)
    flat, _ = flatten_state_dict(template)
    wanted = {k: v for k, v in flat.items() if k in available}
    view = for_dcp(wanted)  # strided views share storage: they load in place
    dcp.load(view, checkpoint_id=str(path))
    wanted.update({k: v for k, v in view.items() if not isinstance(v, StridedBoxes)})  # non-tensor values
    wanted["__missing__"] = sorted(k for k in flat if k not in available)
    return wanted


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    views: Mapping[int, _OptimParam],
    path: Union[str, Path],
    prefix: str,
    zero: Optional[ZeroDataParallel],
) -> None:
    """Restore one optimizer from a sharded checkpoint into the current layout."""
    init_optimizer_state(optimizer, zero)
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
                view.slot.master.data.copy_(view.slot.local_rows(view.slot.local) if view.slot.sharded else view.slot.local.view(view.slot.master.shape))
    if zero is not None:
        zero.gather_params()


# ----------------------------------------------------------------------------- consolidation
def consolidate_checkpoint(path: Union[str, Path], output: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint.

    No process group is needed. The result has full tensors in ``state_dict`` (fp32 master
    weights when the run kept them), optimizer states in PyTorch's own format (parameters
    numbered in param-group order), and all of Lightning's metadata, so
    ``MyModule.load_from_checkpoint(output)`` and a plain ``Trainer(ckpt_path=output)`` work.
    Written to ``output`` when given.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded lightning-para checkpoint (no `.metadata` file in it).")
    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    checkpoint: dict[str, Any] = {}
    meta_file = path / METADATA_FILENAME
    if meta_file.is_file():
        checkpoint.update(torch.load(meta_file, weights_only=False))
    model_state = dict(loaded.get("state_dict", {}))
    optimizer_states = []
    index = 0
    while f"optimizer_{index}" in loaded:
        osd = loaded[f"optimizer_{index}"]
        state, groups, numbered = {}, [], 0
        for group in osd["param_groups"]:
            ids = []
            for fqn in group["params"]:
                entry = dict(osd["state"].get(fqn, {}))
                master = entry.pop(MASTER_KEY, None)
                if master is not None and fqn in model_state:
                    model_state[fqn] = master.reshape(model_state[fqn].shape)
                shape = model_state[fqn].shape if fqn in model_state else None
                entry = {
                    k: (v.reshape(shape) if isinstance(v, Tensor) and shape is not None and v.numel() == math.prod(shape) and v.dim() > 0 else v)
                    for k, v in entry.items()
                    if "@rank" not in k
                }
                if entry:
                    state[numbered] = entry
                ids.append(numbered)
                numbered += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        optimizer_states.append({"state": state, "param_groups": groups})
        index += 1
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = optimizer_states
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint


def write_consolidated(path: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Save sharded to a temporary directory, then rank 0 consolidates it into the file ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".sharded-tmp")
    save_sharded(tmp, tensors, metadata)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        if path.is_dir():
            shutil.rmtree(path)
        consolidate_checkpoint(tmp, path)
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------- full (single-file) loading
@torch.no_grad()
def load_full_checkpoint_into(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, _OptimParam],
    zero: Optional[ZeroDataParallel],
    strict: bool = True,
) -> None:
    """Load an ordinary (consolidated or single-device) Lightning checkpoint into the sharded model."""
    state = checkpoint["state_dict"]
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}.")
    for key, target in own.items():
        if key in state:
            _copy_full_into(target, state[key])
    if zero is not None:
        for slot in zero.slots:
            if slot.master is not None and slot.name in state:
                full = _local_of_full(slot.param, state[slot.name]).to(slot.master.dtype)
                slot.master.data.copy_(slot.local_rows(full) if slot.sharded else full.view(slot.master.shape))
    for optimizer, osd in zip(optimizers, checkpoint.get("optimizer_states", [])):
        init_optimizer_state(optimizer, zero)
        for group, saved_group in zip(optimizer.param_groups, osd["param_groups"]):
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
            for q, pid in zip(group["params"], saved_group["params"]):
                saved = osd["state"].get(pid, {})
                view = views[id(q)]
                for key, value in saved.items():
                    current = optimizer.state[q].get(key)
                    if isinstance(value, Tensor) and isinstance(current, Tensor) and current.dim() > 0:
                        local = _local_of_full(view.slot.param if view.slot else q, value)
                        if view.slot is not None and view.slot.sharded:
                            local = view.slot.local_rows(local)
                        _local(current).copy_(local.reshape(_local(current).shape))
                    elif isinstance(value, Tensor) and isinstance(current, Tensor):
                        current.copy_(value)
                    else:
                        optimizer.state[q][key] = value
    if zero is not None:
        zero.gather_params()


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_of_full(param: Tensor, full: Tensor) -> Tensor:
    """This rank's piece of a full tensor, laid out like ``param`` (plain, TP or FSDP DTensor)."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
        if param.device_mesh.ndim > 1 and any(isinstance(p, _StridedShard) for p in param.placements):
            raise NotImplementedError(
                "Loading a single-file checkpoint into ZeRO-3 with tensor parallelism is not supported;"
                " load the sharded checkpoint directory instead."
            )
        # Every rank holds the full tensor already: split locally, no communication.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full.to(param.dtype)


def _copy_full_into(target: Tensor, full: Tensor) -> None:
    _local(target).copy_(_local_of_full(target, full).view(_local(target).shape))


def load_checkpoint_in_place(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Any,
    zero: Optional[ZeroDataParallel] = None,
    pipeline: Any = None,
) -> dict[str, Any]:
    """What ``ParaStrategy.load_checkpoint`` does: load ``path`` into ``module`` and ``optimizers``
    in place and return the non-tensor part of the checkpoint.

    ``path`` is a sharded DCP folder (any layout: DCP reshards on load) or a single full file
    (``save_distributed_checkpoint=False``, or a plain Lightning checkpoint). ``views`` are
    :func:`optimizer_params`. With no optimizers (validate/predict), ZeRO masters follow the
    loaded weights.
    """
    strict = getattr(module, "strict_loading", True)
    if is_sharded_checkpoint(path):
        flat = load_sharded_into(path, {"state_dict": module.state_dict()})
        missing = flat["__missing__"]
        if missing and strict:
            raise RuntimeError(f"The checkpoint {path} lacks model entries: {missing[:10]}.")
        if zero is not None and not optimizers:
            for slot in zero.slots:
                if slot.master is not None:
                    src = slot.local_rows(slot.local) if slot.sharded else slot.local.view(slot.master.shape)
                    slot.master.data.copy_(src)
        for i, optimizer in enumerate(optimizers):
            load_optimizer_state(optimizer, views, path, f"optimizer_{i}", zero)
        meta_file = path / METADATA_FILENAME
        return torch.load(meta_file, weights_only=False) if meta_file.is_file() else {}
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if pipeline is not None:
        pipeline.check_full_checkpoint(checkpoint, bool(optimizers))
    load_full_checkpoint_into(checkpoint, module, optimizers, views, zero, strict=strict)
    return checkpoint
