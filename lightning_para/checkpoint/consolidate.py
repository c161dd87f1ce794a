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

from lightning_para.checkpoint.atomic import commit, fsync_file, new_token, partial_path, verify_checkpoint
from lightning_para.checkpoint.format import MASTER_KEY, METADATA_FILENAME, is_sharded_checkpoint, save_sharded


def consolidate_checkpoint(path: Union[str, Path], output: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint.

    No process group is needed. The result has full tensors in ``state_dict`` (fp32 master
    weights when the run kept them), optimizer states in PyTorch's own format (parameters
    numbered in param-group order), and all of Lightning's metadata, so
    ``MyModule.load_from_checkpoint(output)`` and a plain ``Trainer(ckpt_path=output)`` work.
    Written to ``output`` when given (atomically: a hidden sibling renamed into place).
    Refuses an incomplete checkpoint (no completion marker, a missing or truncated file).
    """
    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is one file, not a sharded lightning-para checkpoint directory: load it with torch.load.")
    verify_checkpoint(path)  # raises, naming what is missing and the newest complete checkpoint beside it
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded lightning-para checkpoint (no `.metadata` file in it).")
    checkpoint = _consolidate(path)
    if output is not None:
        write_file_atomically(Path(output), checkpoint)
    return checkpoint


def write_file_atomically(path: Path, obj: Any) -> None:
    """``torch.save`` into a hidden sibling, fsync, then swap it into ``path`` (one process)."""
    partial = partial_path(path, new_token())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, partial)
    fsync_file(partial)
    commit(partial, path)


def _consolidate(path: Path) -> dict[str, Any]:
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
    return checkpoint


def write_consolidated(partial: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Collective: save sharded into a hidden directory beside ``partial``, then rank 0 consolidates
    it into the file ``partial`` and fsyncs it. The caller swaps ``partial`` into place."""
    partial = Path(partial)
    tmp = partial.with_name(partial.name + ".sharded")
    save_sharded(tmp, tensors, metadata)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(_consolidate(tmp), partial)
        fsync_file(partial)
        shutil.rmtree(tmp)


__all__ = ["consolidate_checkpoint", "write_consolidated", "write_file_atomically"]
