"""Pretrained weights loaded sharded: each rank reads only its own slices of a safetensors folder.

The pattern of torchtitan: build the model on the meta device, parallelize it (ZeRO-3, tp, pp, ep, cp:
parameters become DTensors of the global shape, or a pipeline rank keeps only its stages), give the
parameters empty local storage, then let DCP read the slices: ``HuggingFaceStorageReader`` opens each
safetensors file and reads ``get_slice(name)[rows, cols]`` for the box of the global tensor this rank
holds, straight into the local shard. So a rank's host memory while loading is its shard plus one slice
in flight, never a whole model.

A module opts in with a ``pretrained_weights()`` method returning :class:`PretrainedWeights` (the recipes'
``HFCausalLM(pretrained=..., sharded_load=True)`` does; the transformers name mapping lives in
:mod:`lightning_para.integrations.transformers.weights`). ``ParaStrategy`` then parallelizes before
materializing and calls :func:`load_pretrained_into`.

Bad folders fail before anything is read, on every rank alike: no weights, a missing or truncated
shard, names or shapes that do not match the model (listed).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_para.checkpoint.stacked import Stacked, load_stacked
from lightning_para.parallel.tensor.checkpoint import for_dcp

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Wrappers that parallelize() may insert into a parameter's path; the weights' names never have them.
_WRAPPER_NAMES = ("._checkpoint_wrapped_module", "_checkpoint_wrapped_module.", "._orig_mod", "_orig_mod.")
_LISTED = 8  # names shown per kind of mismatch


@dataclass(frozen=True)
class PretrainedWeights:
    """A safetensors folder to load into a module after it was parallelized.

    Args:
        folder: holds ``model.safetensors`` or ``model.safetensors.index.json`` and the shards it lists.
        prefix: where the weights' names start inside the module (``"model."`` when the pretrained model is
            the LightningModule's ``self.model``).
        rename: the module's name (without ``prefix``) of a name in the files, when they differ (a
            library's renamed layers); ``None`` keeps names as they are.
        stacked: for a module name (after ``rename``), the per-index pieces the files store it as
            (:class:`~lightning_para.checkpoint.stacked.Stacked`: stacked experts), or ``None``.
    """

    folder: Path
    prefix: str = ""
    rename: Optional[Callable[[str], str]] = field(default=None, compare=False)
    stacked: Optional[Callable[[str], Optional[Stacked]]] = field(default=None, compare=False)


@dataclass(frozen=True)
class StoredTensor:
    file: str
    shape: tuple[int, ...]
    dtype: str


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's header, checked against the file's size (a truncated shard fails here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"The weights file `{path}` is truncated ({size} bytes): re-download or re-export it.")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise ValueError(f"The weights file `{path}` is truncated: its header needs {8 + length} bytes, the file has {size}.")
        header = json.loads(f.read(length))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        raise ValueError(
            f"The weights file `{path}` is truncated or corrupt: its header describes {8 + length + end} bytes, the file"
            f" has {size}. Re-download or re-export it."
        )
    return header


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors folder: its file, global shape and dtype (headers only, no data read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"The pretrained folder `{folder}` does not exist; pass a local folder written by `save_pretrained`.")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map = {}
        files = [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise ValueError(
            f"The pretrained folder `{folder}` holds no safetensors weights (`{SINGLE_FILE}` or `{INDEX_FILE}`)"
            + (f"; it has {others}: convert them with `model.save_pretrained(folder)` (safetensors)." if others else ".")
        )
    out: dict[str, StoredTensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"`{index}` lists the shard `{name}`, which is missing from `{folder}`. Re-download or re-export it.")
        for key, info in _header(path).items():
            if key != "__metadata__":
                out[key] = StoredTensor(name, tuple(info["shape"]), info["dtype"])
    listed_elsewhere = sorted(k for k, f in weight_map.items() if out.get(k) is None or out[k].file != f)
    if listed_elsewhere:
        raise ValueError(f"`{index}` lists tensors that its shards do not hold: {listed_elsewhere[:_LISTED]}.")
    return out


def _clean(name: str) -> str:
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


def _targets(module: nn.Module, weights: PretrainedWeights) -> tuple[dict[str, Tensor], set[str]]:
    """``{file name: this rank's tensor}`` for the module's state under ``prefix``, and the names of tied
    entries (the same tensor under a second name, which the files may hold once)."""
    rename = weights.rename or (lambda n: n)
    targets: dict[str, Tensor] = {}
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        name = _clean(name)
        if not name.startswith(weights.prefix):
            continue
        key = rename(name[len(weights.prefix):])
        if id(tensor) in seen:
            tied.add(key)
        seen.setdefault(id(tensor), key)
        targets[key] = tensor
    return targets, tied


def _everywhere(value: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def check_weights(
    folder: Path, stored: Mapping[str, StoredTensor], targets: Mapping[str, Tensor], tied: set[str],
    stacked: Optional[Mapping[str, Stacked]] = None,
) -> None:
    """Names and global shapes of the files against the module on every rank (a pipeline rank holds only
    its stages); the same ``ValueError`` on every rank, listing what differs. ``stacked`` module tensors are
    compared with the shape their pieces make."""
    mine = {k: tuple(t.shape) for k, t in targets.items()}
    wanted: dict[str, tuple[int, ...]] = {}
    tied_all: set[str] = set()
    stacks: dict[str, Stacked] = {}
    for shapes, tied_rank, stacks_rank in _everywhere((mine, sorted(tied), dict(stacked or {}))):
        wanted.update(shapes)
        tied_all.update(tied_rank)
        stacks.update(stacks_rank)
    pieces = {n for st in stacks.values() for n in st.names()}
    missing = sorted(k for k in wanted if k not in stored and k not in tied_all and k not in stacks)
    missing += sorted(n for n in pieces if n not in stored)
    unexpected = sorted(k for k in stored if k not in wanted and k not in pieces)
    shapes = sorted(f"{k}: {list(stored[k].shape)} in the files, {list(s)} in the model"
                    for k, s in wanted.items() if k not in stacks and k in stored and stored[k].shape != s)
    if not missing:
        shapes += sorted(f"{k}: {list(st.global_shape(stored))} from its pieces, {list(wanted[k])} in the model"
                         for k, st in stacks.items() if st.global_shape(stored) != wanted[k])
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the files ({len(missing)}): {missing[:_LISTED]}")
        if unexpected:
            parts.append(f"not in the model ({len(unexpected)}): {unexpected[:_LISTED]}")
        if shapes:
            parts.append(f"shapes differ ({len(shapes)}): {shapes[:_LISTED]}")
        raise ValueError(
            f"The weights in `{folder}` do not match the model built from its config: " + "; ".join(parts)
            + ". Check that `config.json` belongs to these weights (same sizes and number of layers)."
        )


def load_pretrained_into(module: nn.Module, weights: PretrainedWeights) -> list[str]:
    """Read each rank's slices of ``weights`` into ``module`` in place (collective when distributed).

    ``module``'s parameters may be DTensors of any layout (DCP reads the box each rank holds) or plain
    tensors (read whole). Returns the names loaded. Raises ``ValueError`` (every rank) for a folder without
    weights, a missing or truncated shard, or names/shapes that do not match.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    folder = Path(weights.folder)
    stored = stored_tensors(folder)
    targets, tied = _targets(module, weights)
    stacks = {k: st for k in targets if weights.stacked is not None and (st := weights.stacked(k)) is not None}
    check_weights(folder, stored, targets, tied, stacks)
    state = {k: t.detach() if isinstance(t, nn.Parameter) else t for k, t in targets.items() if k in stored}
    load(for_dcp(state), storage_reader=HuggingFaceStorageReader(str(folder)))
    for key, stack in stacks.items():
        load_stacked(targets[key].detach(), stack, folder, {n: stored[n].file for n in stack.names()})
    return sorted([*state, *stacks])


def real_buffers(module: nn.Module) -> dict[str, Tensor]:
    """Copies of the buffers that were built for real (RoPE tables, ...): :func:`materialize_for_loading`
    puts them back, since the weights files do not hold non-persistent buffers."""
    return {_clean(n): b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}


def materialize_for_loading(module: nn.Module, device: torch.device, buffers: Mapping[str, Tensor]) -> None:
    """Give meta parameters and buffers empty storage on ``device`` (their local shard only, for DTensors)
    and restore ``buffers``; the weights are read next. A meta buffer that is neither kept nor persistent
    (so never in the files) is a ``ValueError`` naming it."""
    persistent = {_clean(k) for k in module.state_dict(keep_vars=True)}
    lost = sorted(n for n, b in ((_clean(n), b) for n, b in module.named_buffers()) if b.is_meta and n not in buffers
                  and n not in persistent)
    if lost:
        raise ValueError(
            f"Buffers {lost[:_LISTED]} were built on the meta device and are not in the weights files, so they cannot be"
            " loaded. Build the model's buffers on a real device (only its parameters on meta)."
        )
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # Swapped in place: a parameter stays the same object, so tied weights (an embedding and its head)
        # stay tied; without it `to_empty` makes one new parameter per module (FSDP2 swaps by itself).
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            module.to_empty(device=device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
    owners = {_clean(n): (m, n.rsplit(".", 1)[-1]) for n, m in _buffer_owners(module)}
    for name, value in buffers.items():
        if name in owners:  # a pipeline rank no longer holds the other stages' buffers
            owner, attr = owners[name]
            setattr(owner, attr, value.to(device))  # an existing buffer's name: stays a buffer, same persistence


def _buffer_owners(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{prefix}.{name}" if prefix else name, sub) for prefix, sub in module.named_modules()
            for name, _ in sub.named_buffers(recurse=False)]


def pending_weights(module: nn.Module) -> Optional[PretrainedWeights]:
    """The weights a module asks to have loaded after parallelizing (its ``pretrained_weights()``), if any."""
    method = getattr(module, "pretrained_weights", None)
    weights = method() if callable(method) else None
    if weights is not None and not isinstance(weights, PretrainedWeights):
        raise ValueError(f"`{type(module).__name__}.pretrained_weights()` must return a PretrainedWeights or None, not {weights!r}.")
    return weights


__all__ = [
    "PretrainedWeights", "StoredTensor", "check_weights", "load_pretrained_into", "materialize_for_loading",
    "pending_weights", "real_buffers", "stored_tensors",
]
