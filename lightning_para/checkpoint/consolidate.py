"""Consolidation: a sharded checkpoint directory into one ordinary Lightning checkpoint file."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # private: see docs/architecture.md
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # private: see docs/architecture.md

from lightning_para.checkpoint.atomic import fsync_file, new_token, partial_path, verify_checkpoint
from lightning_para.checkpoint.swap import commit, remove_partial
from lightning_para.checkpoint.format import MASTER_KEY, METADATA_FILENAME, ROW_ORDER_KEY, is_sharded_checkpoint
from lightning_para.parallel.tensor.columns import RowOrder, reorder_named, reorder_rows


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
    try:
        torch.save(obj, partial)
        fsync_file(partial)
    except BaseException:
        remove_partial(partial)  # a full disk gets its space back; `path` is untouched
        raise
    commit(partial, path)


def _consolidate(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    meta_file = path / METADATA_FILENAME
    if meta_file.is_file():
        loaded.update(torch.load(meta_file, weights_only=False))
    return trainer_format(loaded)


def trainer_format(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """A sharded directory's content, loaded whole, in the format of Lightning's Trainer checkpoints.

    ``loaded`` has the model under ``state_dict`` and each optimizer, keyed by parameter name,
    under ``optimizer_<i>``, plus Lightning's metadata: what a sharded directory holds, and what
    Lightning's own ``python -m lightning.fabric.utilities.consolidate_checkpoint DIR`` writes.
    The result has ``optimizer_states`` numbered as PyTorch numbers them, with fp32 master
    weights (``bf16-true``) as the model weights, and every tensor in the model's own row order (the
    parameters recorded under :data:`~.format.ROW_ORDER_KEY` are put back in it).
    """
    skip = ("state_dict", ROW_ORDER_KEY)
    checkpoint = {k: v for k, v in loaded.items() if k not in skip and not _is_optimizer_key(k)}
    model_state = dict(loaded.get("state_dict", {}))
    rows = loaded.get(ROW_ORDER_KEY) or {}
    shapes = {fqn: t.shape for fqn, t in model_state.items() if isinstance(t, Tensor)}
    optimizer_states = []
    index = 0
    while f"optimizer_{index}" in loaded:
        masters: dict[str, Tensor] = {}
        optimizer_states.append(number_optimizer_state(loaded[f"optimizer_{index}"], shapes, masters, rows))
        model_state.update({fqn: m.reshape(shapes[fqn]) for fqn, m in masters.items() if fqn in shapes})
        index += 1
    checkpoint["state_dict"] = reorder_named(model_state, rows, to_model=True)
    checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def _is_optimizer_key(key: str) -> bool:
    return key.startswith("optimizer_") and key[len("optimizer_"):].isdigit()


def number_optimizer_state(
    osd: Mapping[str, Any], shapes: Mapping[str, torch.Size], masters: Optional[dict[str, Tensor]] = None,
    rows: Optional[Mapping[str, RowOrder]] = None,
) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (full tensors) in PyTorch's own format.

    Parameters are numbered in param-group order; parameter-sized tensors take their
    parameter's shape from ``shapes`` (and the model's row order, for those in ``rows``); per-rank (``@rank``)
    entries are dropped; fp32 master weights (``_master``) go to ``masters`` by name (dropped when ``masters`` is ``None``).
    """
    state, groups, numbered = {}, [], 0
    for group in osd["param_groups"]:
        ids = []
        for fqn in group["params"]:
            entry = dict(osd["state"].get(fqn, {}))
            master = entry.pop(MASTER_KEY, None)
            if master is not None and masters is not None:
                masters[fqn] = master
            shape = shapes.get(fqn)
            entry = {
                k: (v.reshape(shape) if isinstance(v, Tensor) and shape is not None and v.numel() == math.prod(shape) and v.dim() > 0 else v)
                for k, v in entry.items()
                if "@rank" not in k
            }
            if rows and fqn in rows:
                entry = reorder_rows(entry, rows[fqn], to_model=True, name=f"the optimizer state of {fqn!r}")
            if entry:
                state[numbered] = entry
            ids.append(numbered)
            numbered += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


__all__ = ["consolidate_checkpoint", "number_optimizer_state", "trainer_format", "write_file_atomically"]
