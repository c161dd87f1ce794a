"""LitGPT checkpoint folders (``lit_model.pth`` + ``model_config.yaml``) in and out of any layout.

* :func:`load_checkpoint`: a ``GPT`` built from the folder's config with the folder's weights. Build
  it in the LightningModule (``self.model = load_checkpoint(folder)``); the strategy then shards it
  into whatever layout it runs (every rank reads the file once, memory-mapped, before sharding).
* :func:`export`: a trained model back to a LitGPT folder that ``litgpt`` (``GPT(Config.from_file(...))``
  + ``load_state_dict``, ``litgpt generate``/``chat``/``finetune``) opens. From a **live** model of any
  layout (collective: every rank calls it; the whole model is gathered to rank 0, which writes) or
  from a **checkpoint** ``ParaStrategy`` saved (a sharded directory or one file; no process group).

What differs between a layout's parameters and LitGPT's names is undone on export: ``LLaMAMoE`` experts
under ep are stacked (:mod:`.experts`) and unstacked into ``experts.{i}.fc_1.weight``, ... A grouped-query
``qkv`` under tp, stored in tp's rank-major row order
(:class:`~lightning_para.parallel.tensor.columns.FusedBlocksColwise`), is in LitGPT's ``[q | k | v]`` order in
every whole-tensor form: one-file saves, consolidated checkpoints, exports; and one-file LitGPT or one-device
weights (``fabric.load_raw("lit_model.pth", model)``, a one-device checkpoint) load into any tp. Each checkpoint
records the model's config (:func:`litgpt_models`, key :data:`CHECKPOINT_KEY`) so that export needs nothing else.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_para.checkpoint.consolidate import consolidate_checkpoint
from lightning_para.checkpoint.format import is_sharded_checkpoint
from lightning_para.checkpoint.model_info import register_model_info
from lightning_para.integrations.litgpt.experts import STACKED
from lightning_para.integrations.litgpt.tensor import is_litgpt_module
from lightning_para.parallel.tensor.columns import rank_major_rows, reorder_named

CHECKPOINT_KEY = "litgpt_models"
WEIGHTS, CONFIG = "lit_model.pth", "model_config.yaml"


def load_checkpoint(folder: Union[str, Path], **config_overrides: Any) -> nn.Module:
    """``litgpt.model.GPT`` from a LitGPT checkpoint folder (``model_config.yaml`` + ``lit_model.pth``)."""
    # optional: litgpt builds the model
    from litgpt import Config
    from litgpt.model import GPT

    folder = Path(folder)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise ValueError(f"`{folder}` is not a LitGPT checkpoint folder: it has no `{name}`.")
    model = GPT(Config.from_file(folder / CONFIG, **config_overrides))
    state = torch.load(folder / WEIGHTS, map_location="cpu", mmap=True, weights_only=True)
    model.load_state_dict(state.get("model", state))  # litgpt's training checkpoints nest it under "model"
    return model


def litgpt_models(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{prefix: {"config": ...}}`` for each outermost LitGPT ``GPT`` in ``module`` (``prefix`` ends with ``"."``,
    or is ``""``): what :func:`export` needs to write a folder from a checkpoint."""
    found: dict[str, dict[str, Any]] = {}
    for name, sub in module.named_modules():
        if is_litgpt_module(sub, "GPT") and not any(name.startswith(p) for p in found if p):
            found[f"{name}." if name else ""] = {"config": asdict(sub.config)}
    return found


def to_litgpt_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``GPT``'s whole state dict in the model's row order -> LitGPT's names (experts unstacked)."""
    out = dict(state)
    for key in [k for k in out if k.endswith(".experts.fc_1")]:  # stacked LLaMAMoE experts (ep)
        fqn = key[: -len(".fc_1")]
        for part in STACKED:
            for kind, name in (("weight", part), ("bias", f"{part}_bias")):
                stack = out.pop(f"{fqn}.{name}", None)
                if stack is not None:
                    for i, tensor in enumerate(stack.unbind(0)):
                        out[f"{fqn}.{i}.{part}.{kind}"] = tensor.clone()
    return out


def _write(folder: Union[str, Path], state: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    import yaml  # a dependency of litgpt (its own config files)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / WEIGHTS)
    with open(folder / CONFIG, "w", encoding="utf-8") as f:
        yaml.dump(config, f)
    return folder


def _whole_state(gpt: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers of ``gpt`` as whole tensors (collective within each DTensor's mesh)."""
    out = {}
    for name, value in gpt.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = value.detach().cpu().clone()
    return out


def export(
    source: Union[nn.Module, str, Path, dict[str, Any]], folder: Union[str, Path], *, prefix: Optional[str] = None
) -> Optional[Path]:
    """Write a LitGPT checkpoint folder (``lit_model.pth`` + ``model_config.yaml``) from ``source``.

    Args:
        source: a live LightningModule (or ``GPT``) of any layout -- collective: call it on every rank;
            rank 0 writes and gets the path, the others ``None`` -- or a checkpoint ``ParaStrategy`` saved
            (sharded directory, one file, or the loaded dict).
        folder: where to write.
        prefix: where the ``GPT`` sits in the LightningModule (e.g. ``"model."``); needed only with several.
    """
    if isinstance(source, nn.Module):
        models = litgpt_models(source)
        prefix = _choose(models, prefix)
        gpt = source.get_submodule(prefix[:-1]) if prefix else source
        # Each rank converts what it holds (a pipeline stage: its own layers and their layout).
        state = to_litgpt_state(reorder_named(_whole_state(gpt), rank_major_rows(gpt), to_model=True))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Pipeline stages hold different layers: gather every rank's share on rank 0.
            gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore[assignment]
            dist.gather_object(state, gathered, dst=0)
            if dist.get_rank() != 0:
                return None
            state = {k: v for part in gathered for k, v in part.items()}
        return _write(folder, state, models[prefix]["config"])
    ckpt = _load(source)
    models = ckpt.get(CHECKPOINT_KEY) or {}
    if not models:
        raise ValueError(
            "This checkpoint records no LitGPT model (it was not saved by ParaStrategy from a LightningModule holding"
            " a litgpt.model.GPT). Export the live model instead: export(lightning_module, folder) on every rank."
        )
    prefix = _choose(models, prefix)
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    return _write(folder, to_litgpt_state(state), models[prefix]["config"])


def _choose(models: dict[str, Any], prefix: Optional[str]) -> str:
    if not models:
        raise ValueError("No litgpt.model.GPT found to export.")
    if prefix is None:
        if len(models) > 1:
            raise ValueError(f"Several LitGPT models; choose one with `prefix=` in {sorted(models)}.")
        return next(iter(models))
    if prefix not in models:
        raise ValueError(f"`prefix={prefix!r}` is not a LitGPT model here; choose one of {sorted(models)}.")
    return prefix


def _load(checkpoint: Union[str, Path, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(checkpoint, dict):
        return checkpoint
    path = Path(checkpoint)
    if is_sharded_checkpoint(path):
        return consolidate_checkpoint(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    raise ValueError(f"`{path}` is neither a checkpoint file nor a sharded lightning-para checkpoint directory.")


register_model_info(CHECKPOINT_KEY, litgpt_models)

__all__ = ["CHECKPOINT_KEY", "export", "litgpt_models", "load_checkpoint", "to_litgpt_state"]
