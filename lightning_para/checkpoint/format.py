"""The on-disk format of sharded checkpoints: a DCP directory plus Lightning's metadata.

A checkpoint is a directory with DCP shards for ``state_dict`` (the model) and ``optimizer_<i>``,
and ``meta.pt`` (everything else Lightning saves: loops, epoch, LR schedulers, callbacks,
hyperparameters, loss-scaler state). Writing is collective; see :mod:`.optimizer` for how the
optimizer state is named so that any layout can load it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # private: see docs/architecture.md

from lightning_para.checkpoint.checksums import ChecksummingWriter
from lightning_para.parallel.tensor.checkpoint import StridedBoxes, for_dcp

METADATA_FILENAME = "meta.pt"
MASTER_KEY = "_master"
# In ``meta.pt``: {parameter name: (blocks, tp)} of the parameters whose shards hold their rows in tp's rank-major
# order (a grouped-query fused q|k|v, ``parallel/tensor/columns.py``); consolidation and other layouts reorder them.
ROW_ORDER_KEY = "tensor_parallel_rows"


def save_sharded(path: Union[str, Path], tensors: dict[str, Any], metadata: dict[str, Any]) -> dict[str, str]:
    """Write a sharded checkpoint directory (collective: call on every rank); return the CRC-32 of
    each shard file this rank wrote (:mod:`.checksums`).

    ``path`` should be a fresh directory: :mod:`.atomic` writes into a hidden sibling and swaps it
    into place, so nothing here is written over a checkpoint that someone may read. DCP fsyncs
    its shard files; ``meta.pt`` is fsynced here.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writer = ChecksummingWriter(path)
    dcp.save(for_dcp(tensors), storage_writer=writer, checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_metadata(path, metadata_bytes(metadata))
    return writer.checksums


def metadata_bytes(metadata: dict[str, Any]) -> bytes:
    """``meta.pt``'s content (an asynchronous save serialises it when it is staged)."""
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()


def write_metadata(path: Path, data: bytes) -> None:
    """Rank 0: ``meta.pt`` into the checkpoint directory ``path``, fsynced."""
    with open(Path(path) / METADATA_FILENAME, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """A directory with DCP's ``.metadata`` in it."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def checkpoint_keys(path: Union[str, Path]) -> set[str]:
    """The flat keys (``"state_dict.blocks.0.weight"``, ...) a sharded checkpoint holds (reads ``.metadata`` only)."""
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def flat_keys(template: dict[str, Any]) -> set[str]:
    """The flat keys DCP gives ``template`` (the names :func:`checkpoint_keys` compares with)."""
    return set(flatten_state_dict(template)[0])


def load_sharded_into(path: Union[str, Path], template: dict[str, Any]) -> dict[str, Any]:
    """Load the keys of ``template`` that the checkpoint has, in place; returns the flat loaded dict.

    Keys the checkpoint lacks (an fp32 master when the checkpoint came from a fp32 run) stay
    untouched and are reported under ``"__missing__"``.
    """
    available = checkpoint_keys(path)
    flat, _ = flatten_state_dict(template)
    wanted = {k: v for k, v in flat.items() if k in available}
    view = for_dcp(wanted)  # strided views share storage: they load in place
    dcp.load(view, checkpoint_id=str(path))
    wanted.update({k: v for k, v in view.items() if not isinstance(v, StridedBoxes)})  # non-tensor values
    wanted["__missing__"] = sorted(k for k in flat if k not in available)
    return wanted


__all__ = [
    "MASTER_KEY", "METADATA_FILENAME", "ROW_ORDER_KEY", "checkpoint_keys", "flat_keys", "is_sharded_checkpoint", "load_sharded_into",
    "metadata_bytes", "save_sharded", "write_metadata",
]
