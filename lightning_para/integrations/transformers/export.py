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

from lightning_para.checkpoint.consolidate import consolidate_checkpoint
from lightning_para.checkpoint.format import is_sharded_checkpoint
from lightning_para.checkpoint.model_info import register_model_info

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


def _load(checkpoint: Union[str, Path, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(checkpoint, dict):
        return checkpoint
    path = Path(checkpoint)
    if is_sharded_checkpoint(path):
        return consolidate_checkpoint(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    raise ValueError(f"`{path}` is neither a checkpoint file nor a sharded lightning-para checkpoint directory.")


def export(
    checkpoint: Union[str, Path, dict[str, Any]],
    out_dir: Union[str, Path],
    *,
    prefix: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write the transformers model of a Lightning checkpoint as a folder that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` (or its own class) opens.

    Args:
        checkpoint: a sharded checkpoint directory of any layout, a single-file checkpoint, or a
            loaded checkpoint dict, saved by ``ParaStrategy`` (which records the model's config).
        out_dir: the folder to write (``config.json`` and safetensors weights).
        prefix: where the model sits in the LightningModule (e.g. ``"model."``); needed only when
            the checkpoint holds several transformers models.
        dtype: cast floating-point weights (default: as trained; fp32 masters when the run kept them).
    """
    # optional: transformers is needed only to write its folder format
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    ckpt = _load(checkpoint)
    models = ckpt.get(CHECKPOINT_KEY) or {}
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
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = model_class(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {k for k in missing if _tied_key(model, k)}
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"The checkpoint's `{prefix}*` weights do not match `{entry['architecture']}`: missing"
            f" {sorted(set(missing) - tied)[:8]}, unexpected {sorted(unexpected)[:8]}."
        )
    if tied:
        model.tie_weights()
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def _tied_key(model: nn.Module, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied


__all__ = ["CHECKPOINT_KEY", "export", "transformers_models"]
