"""Write a model as sharded safetensors with the standard index, shard files in parallel.

The layout ``from_pretrained`` and :mod:`.pretrained` read: ``model-0000i-of-0000N.safetensors`` of at most
``max_shard_bytes`` each (tensors in the given order, greedily), and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``); one shard is written as
``model.safetensors`` without an index, as ``save_pretrained`` does. Each worker fetches only its shard's
tensors (``fetch(names)``), so memory is ``workers`` shards at a time, never the whole model. Every file is
written to a hidden sibling and renamed into place; the index comes last, so a folder with an index is whole.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from lightning_para.checkpoint.pretrained import INDEX_FILE, SINGLE_FILE

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut greedily into groups of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    if max_shard_bytes < 1:
        raise ValueError(f"`max_shard_bytes={max_shard_bytes}` must be positive.")
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []


def _write_file(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file  # optional: safetensors comes with transformers

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_sharded_safetensors(
    out_dir: Path,
    sizes: Sequence[tuple[str, int]],
    fetch: Callable[[list[str]], dict[str, Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
) -> list[Path]:
    """Write the tensors named in ``sizes`` (``(name, bytes)`` in file order) as shards of ``out_dir``;
    ``fetch(names)`` returns those tensors (called once per shard, from ``workers`` threads)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(sizes, max_shard_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        digits = max(5, len(str(len(shards))))
        names = [f"model-{i + 1:0{digits}d}-of-{len(shards):0{digits}d}.safetensors" for i in range(len(shards))]
    for stale in (out_dir / INDEX_FILE, *out_dir.glob("model*.safetensors")):  # an older export's files would mix in
        stale.unlink(missing_ok=True)

    def write(index: int) -> None:
        _write_file(out_dir / names[index], fetch(shards[index]))

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(shards)))) as pool:
        list(pool.map(write, range(len(shards))))  # list(): re-raises a worker's error here
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(n for _, n in sizes)},
            "weight_map": {name: names[i] for i, group in enumerate(shards) for name in group},
        }
        tmp = out_dir / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out_dir / INDEX_FILE)
    return [out_dir / n for n in names]


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


__all__ = ["DEFAULT_SHARD_BYTES", "plan_shards", "tensor_bytes", "write_sharded_safetensors"]
