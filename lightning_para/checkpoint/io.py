"""Reading and writing Lightning checkpoints for a parallelized model, in place.

:func:`save_checkpoint` writes Lightning's checkpoint dict as a sharded DCP directory (or one
consolidated file); :func:`load_checkpoint_in_place` loads either kind, and a plain
single-device Lightning checkpoint, into whatever layout the model has now.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_para._dtensor import is_strided, local_tensor
from lightning_para.checkpoint.consolidate import trainer_format
from lightning_para.checkpoint.format import METADATA_FILENAME, is_sharded_checkpoint, load_sharded_into, save_sharded
from lightning_para.checkpoint.optimizer import OptimParam, init_optimizer_state, load_optimizer_state
from lightning_para.parallel.data.zero import ZeroDataParallel
from lightning_para.parallel.pipeline.runner import PipelineRunner


def save_checkpoint(path: Path, checkpoint: dict[str, Any], *, sharded: bool = True) -> None:
    """Write Lightning's ``checkpoint`` dict: model and optimizer states through DCP, the rest into
    ``meta.pt`` (collective). ``sharded=False``: the dict already holds the full state on rank 0
    (:mod:`.full_state`), which writes it as one ordinary file; the other ranks write nothing."""
    if not sharded:
        if not dist.is_initialized() or dist.get_rank() == 0:
            if path.is_dir():
                shutil.rmtree(path)  # a sharded checkpoint of the same name
            TorchCheckpointIO().save_checkpoint(checkpoint, path)  # creates the folder, writes atomically
        return
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    save_sharded(path, tensors, checkpoint)


@torch.no_grad()
def load_full_checkpoint_into(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
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
                slot.load_master(_local_of_full(slot.param, state[slot.name]))
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
                        local_tensor(current).copy_(local.reshape(local_tensor(current).shape))
                    elif isinstance(value, Tensor) and isinstance(current, Tensor):
                        current.copy_(value)
                    else:
                        optimizer.state[q][key] = value
    if zero is not None:
        zero.gather_params()


def _local_of_full(param: Tensor, full: Tensor) -> Tensor:
    """This rank's piece of a full tensor, laid out like ``param`` (plain, TP or FSDP DTensor)."""
    if isinstance(param, DTensor):
        full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
        if param.device_mesh.ndim > 1 and is_strided(param):
            raise NotImplementedError(
                "Loading a single-file checkpoint into ZeRO-3 with tensor parallelism is not supported;"
                " load the sharded checkpoint directory instead."
            )
        # Every rank holds the full tensor already: split locally, no communication.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full.to(param.dtype)


def _copy_full_into(target: Tensor, full: Tensor) -> None:
    local_tensor(target).copy_(_local_of_full(target, full).view(local_tensor(target).shape))


def load_checkpoint_in_place(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
    zero: Optional[ZeroDataParallel] = None,
    pipeline: Optional[PipelineRunner] = None,
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
            zero.reset_masters_from_params()
        for i, optimizer in enumerate(optimizers):
            load_optimizer_state(optimizer, views, path, f"optimizer_{i}", zero)
        meta_file = path / METADATA_FILENAME
        return torch.load(meta_file, weights_only=False) if meta_file.is_file() else {}
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if "optimizer_states" not in checkpoint and "optimizer_0" in checkpoint:
        # Written by Lightning's `python -m lightning.fabric.utilities.consolidate_checkpoint` from a sharded directory.
        checkpoint = trainer_format(checkpoint)
    if pipeline is not None:
        pipeline.check_full_checkpoint(checkpoint, bool(optimizers))
    load_full_checkpoint_into(checkpoint, module, optimizers, views, zero, strict=strict)
    return checkpoint


__all__ = ["load_checkpoint_in_place", "load_full_checkpoint_into", "save_checkpoint"]
