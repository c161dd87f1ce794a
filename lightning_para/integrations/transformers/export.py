"""Checkpoints of transformers models: what ``ParaStrategy`` records, and :func:`export`.

Every layout keeps the model's own parameter names (pipeline stages keep layer names, tensor and
expert parallelism keep global-shaped DTensors that DCP stores as full tensors), so the
``state_dict`` of a checkpoint holds ``<prefix><save_pretrained name>`` for the transformers model
at ``<prefix>`` in the LightningModule. ``ParaStrategy`` also records each transformers model's
class and config in the checkpoint (:func:`transformers_models`, under the key
:data:`CHECKPOINT_KEY`, registered here with :func:`~lightning_para.checkpoint.model_info.register_model_info`
on import), so :func:`export` needs nothing but the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from lightning_para.checkpoint.atomic import verify_checkpoint
from lightning_para.checkpoint.format import (
    MASTER_KEY,
    METADATA_FILENAME,
    is_sharded_checkpoint,
)
from lightning_para.checkpoint.model_info import register_model_info
from lightning_para.checkpoint.safetensors_writer import (
    DEFAULT_SHARD_BYTES,
    tensor_bytes,
    write_sharded_safetensors,
)

CHECKPOINT_KEY = "transformers_models"


def _is_pretrained(module: nn.Module) -> bool:
    # Duck-typed (transformers need not be importable): a PreTrainedModel has a config with a model type.
    config = getattr(module, "config", None)
    return (
        callable(getattr(module, "save_pretrained", None))
        and isinstance(getattr(config, "model_type", None), str)
        and callable(getattr(config, "to_dict", None))
    )


def transformers_models(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{prefix: {"architecture": class name, "config": config dict}}`` for each outermost transformers
    model in ``module`` (``prefix`` ends with ``"."``, or is ``""`` for the module itself)."""
    found: dict[str, dict[str, Any]] = {}
    for name, sub in module.named_modules():
        if not _is_pretrained(sub) or any(name.startswith(p) for p in found if p) or "" in found:
            continue
        found[f"{name}." if name else ""] = {"architecture": type(sub).__name__, "config": sub.config.to_dict()}
    return found


register_model_info(CHECKPOINT_KEY, transformers_models)


class _Source:
    """What export reads: the record of the transformers models, each model tensor's shape and dtype, and
    ``fetch(names)`` for some of them. A sharded directory is read tensor by tensor (DCP, no process group):
    no process ever holds the whole model; a file or dict is already in memory."""

    def __init__(self, checkpoint: Union[str, Path, dict[str, Any]]) -> None:
        self.path: Optional[Path] = None
        if isinstance(checkpoint, dict):
            self.loaded: Optional[dict[str, Any]] = checkpoint
        else:
            path = Path(checkpoint)
            if is_sharded_checkpoint(path):
                verify_checkpoint(path)  # raises, naming a missing or truncated file
                self.path, self.loaded = path, None
                self.meta = torch.load(path / METADATA_FILENAME, weights_only=False)
                self._storage = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            elif path.is_file():
                self.loaded = torch.load(path, map_location="cpu", weights_only=False)
            else:
                raise ValueError(f"`{path}` is neither a checkpoint file nor a sharded lightning-para checkpoint directory.")

    @property
    def models(self) -> dict[str, Any]:
        return (self.loaded if self.loaded is not None else self.meta).get(CHECKPOINT_KEY) or {}

    def _master_key(self, fqn: str) -> Optional[str]:
        """The fp32 master of ``fqn`` in a sharded directory's optimizer state (bf16-true runs keep one)."""
        suffix = f".state.{fqn}.{MASTER_KEY}"
        return next((k for k in self._storage if k.startswith("optimizer_") and k.endswith(suffix)), None)

    def shapes(self, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name without prefix: (shape, dtype)}`` of the model's tensors (masters' dtype where kept)."""
        if self.loaded is not None:
            return {k[len(prefix):]: (tuple(v.shape), v.dtype) for k, v in self.loaded["state_dict"].items()
                    if k.startswith(prefix) and isinstance(v, torch.Tensor)}
        out = {}
        for key, md in self._storage.items():
            if key.startswith(f"state_dict.{prefix}") and hasattr(md, "size"):
                fqn = key[len("state_dict."):]
                master = self._master_key(fqn)
                dtype = self._storage[master].properties.dtype if master else md.properties.dtype
                out[fqn[len(prefix):]] = (tuple(md.size), dtype)
        return out

    def fetch(self, prefix: str, names: list[str]) -> dict[str, torch.Tensor]:
        if self.loaded is not None:
            return {n: self.loaded["state_dict"][prefix + n] for n in names}
        import torch.distributed.checkpoint as dcp

        assert self.path is not None
        keys = {}
        for n in names:
            master = self._master_key(prefix + n)
            keys[n] = master or f"state_dict.{prefix}{n}"
        state = {keys[n]: torch.empty(tuple(self._storage[keys[n]].size), dtype=self._storage[keys[n]].properties.dtype)
                 for n in names}
        dcp.load(state, storage_reader=FileSystemReader(str(self.path)), no_dist=True)
        shapes = self.shapes(prefix)
        return {n: state[keys[n]].reshape(shapes[n][0]) for n in names}


def export(
    checkpoint: Union[str, Path, dict[str, Any]],
    out_dir: Union[str, Path],
    *,
    prefix: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
) -> Path:
    """Write the transformers model of a Lightning checkpoint as a folder that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` (or its own class) opens.

    The weights are written as sharded safetensors with the standard ``model.safetensors.index.json``
    (one ``model.safetensors`` when they fit in one shard), ``workers`` shard files at a time; from a
    sharded checkpoint directory each shard's tensors are read on their own, so the whole model is never in
    memory. ``HFCausalLM(pretrained=out_dir, sharded_load=True)`` reads it back sharded.

    Args:
        checkpoint: a sharded checkpoint directory of any layout, a single-file checkpoint, or a
            loaded checkpoint dict, saved by ``ParaStrategy`` (which records the model's config).
        out_dir: the folder to write (``config.json`` and safetensors weights).
        prefix: where the model sits in the LightningModule (e.g. ``"model."``); needed only when
            the checkpoint holds several transformers models.
        dtype: cast floating-point weights (default: as trained; fp32 masters when the run kept them).
        max_shard_size: bytes per shard file at most (transformers' default, 5 GiB).
        workers: shard files written at the same time (threads).
    """
    # optional: transformers is needed only to write its folder format
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    source = _Source(checkpoint)
    models = source.models
    if not models:
        raise ValueError(
            "This checkpoint records no transformers model (it was not saved by ParaStrategy from a LightningModule"
            " holding one). Save it with `ParaStrategy`, or load the weights into your model yourself and call"
            " `model.save_pretrained(out_dir)`."
        )
    if prefix is None:
        if len(models) > 1:
            raise ValueError(f"The checkpoint holds several transformers models; choose one with `prefix=` in {sorted(models)}.")
        prefix = next(iter(models))
    if prefix not in models:
        raise ValueError(f"`prefix={prefix!r}` is not a transformers model of this checkpoint; choose one of {sorted(models)}.")
    entry = models[prefix]
    config = CONFIG_MAPPING[entry["config"]["model_type"]].from_dict(dict(entry["config"]))
    model_class = getattr(transformers, entry["architecture"], None)
    if model_class is None:
        raise ValueError(f"transformers {transformers.__version__} has no class `{entry['architecture']}`; upgrade it.")
    with torch.device("meta"):
        model = model_class(config)
    expected = model.state_dict()
    stored = source.shapes(prefix)
    tied = {k for k in expected if k not in stored and _tied_key(model, k)}
    missing = sorted(set(expected) - set(stored) - tied)
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint's `{prefix}*` weights do not match `{entry['architecture']}`: missing"
            f" {missing[:8]}, unexpected {unexpected[:8]}."
        )
    # save_pretrained's rule: a tied weight is written once, under its first name.
    written = [k for k in expected if k in stored and not (_tied_key(model, k) and getattr(config, "tie_word_embeddings", False))]

    def out_dtype(name: str) -> torch.dtype:
        kept = stored[name][1]
        return dtype if dtype is not None and kept.is_floating_point else kept

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: t.to(out_dtype(n)) for n, t in source.fetch(prefix, names).items()}

    out = Path(out_dir)
    write_sharded_safetensors(out, [(n, tensor_bytes(stored[n][0], out_dtype(n))) for n in written], fetch,
                              max_shard_bytes=max_shard_size, workers=workers)
    config.save_pretrained(out)
    return out


def _tied_key(model: nn.Module, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied


__all__ = ["CHECKPOINT_KEY", "export", "transformers_models"]
