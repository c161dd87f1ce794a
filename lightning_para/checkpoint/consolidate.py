"""Consolidation: a sharded checkpoint directory into one ordinary Lightning checkpoint file."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # private: see docs/architecture.md
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # private: see docs/architecture.md

from lightning_para.checkpoint.format import MASTER_KEY, METADATA_FILENAME, is_sharded_checkpoint, save_sharded


def consolidate_checkpoint(path: Union[str, Path], output: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint.

    No process group is needed. The result has full tensors in ``state_dict`` (fp32 master
    weights when the run kept them), optimizer states in PyTorch's own format (parameters
    numbered in param-group order), and all of Lightning's metadata, so
    ``MyModule.load_from_checkpoint(output)`` and a plain ``Trainer(ckpt_path=output)`` work.
    Written to ``output`` when given.
    """
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


__all__ = ["consolidate_checkpoint", "write_consolidated"]
