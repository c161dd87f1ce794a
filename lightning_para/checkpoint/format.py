"""The on-disk format of sharded checkpoints: a DCP directory plus Lightning's metadata.

A checkpoint is a directory with DCP shards for ``state_dict`` (the model) and ``optimizer_<i>``,
and ``meta.pt`` (everything else Lightning saves: loops, epoch, LR schedulers, callbacks,
hyperparameters, loss-scaler state). Writing is collective; see :mod:`.optimizer` for how the
optimizer state is named so that any layout can load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # private: see docs/architecture.md

from lightning_para.parallel.tensor.checkpoint import StridedBoxes, for_dcp

METADATA_FILENAME = "meta.pt"
MASTER_KEY = "_master"


def save_sharded(path: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Write a sharded checkpoint directory (collective: call on every rank)."""
    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(for_dcp(tensors), checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(metadata, path / METADATA_FILENAME)


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """A directory with DCP's ``.metadata`` in it."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def load_sharded_into(path: Union[str, Path], template: dict[str, Any]) -> dict[str, Any]:
    """Load the keys of ``template`` that the checkpoint has, in place; returns the flat loaded dict.

    Keys the checkpoint lacks (an fp32 master when the checkpoint came from a fp32 run) stay
    untouched and are reported under ``"__missing__"``.
    """
    reader = FileSystemReader(str(path))
    available = set(reader.read_metadata().state_dict_metadata)
    flat, _ = flatten_state_dict(template)
    wanted = {k: v for k, v in flat.items() if k in available}
    view = for_dcp(wanted)  # strided views share storage: they load in place
    dcp.load(view, checkpoint_id=str(path))
    wanted.update({k: v for k, v in view.items() if not isinstance(v, StridedBoxes)})  # non-tensor values
    wanted["__missing__"] = sorted(k for k in flat if k not in available)
    return wanted


__all__ = ["MASTER_KEY", "METADATA_FILENAME", "is_sharded_checkpoint", "load_sharded_into", "save_sharded"]
