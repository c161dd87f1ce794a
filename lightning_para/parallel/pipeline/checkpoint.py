"""A pipeline rank's side of checkpoints: it holds only its stages' parameters and optimizer state.

A sharded checkpoint's optimizer param groups must name the whole model's parameters, so consolidation numbers
all of them (:func:`merge_param_group_names`); a single-file checkpoint is loaded by keeping this rank's stages'
weights, and its optimizer state is refused (:func:`keep_own_stages`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn


def merge_param_group_names(
    groups: list[dict[str, Any]], layer_names: list[str], *, pp: int, group: dist.ProcessGroup
) -> list[dict[str, Any]]:
    """Optimizer param groups with the parameter names of *every* stage, in layer order (collective over ``pp``)."""
    gathered: list[Any] = [None] * pp
    dist.all_gather_object(gathered, [list(g["params"]) for g in groups], group=group)
    by_length = sorted(enumerate(layer_names), key=lambda item: -len(item[1]))

    def layer_index(name: str) -> int:
        return next((i for i, layer in by_length if name == layer or name.startswith(layer + ".")), -1)

    merged = []
    for gi, param_group in enumerate(groups):
        names: list[str] = []
        for per_rank in gathered:
            names.extend(n for n in per_rank[gi] if n not in names)
        merged.append({**param_group, "params": sorted(names, key=layer_index)})  # stable: keeps in-layer order
    return merged


def keep_own_stages(
    checkpoint: dict[str, Any], has_optimizers: bool, stage_modules: list[nn.Module], layer_names: list[str]
) -> None:
    """Keep a single-file checkpoint's weights of this rank's stages (in place); refuse its optimizer state."""
    if has_optimizers and checkpoint.get("optimizer_states"):
        raise ValueError(
            "Resuming a pipeline-parallel run needs a sharded checkpoint directory (the default"
            " `save_distributed_checkpoint=True`): a single-file checkpoint numbers optimizer state over the"
            " whole model, and no pipeline rank holds the whole model to map those numbers to parameters."
        )
    held = {name for m in stage_modules for name, _ in m.named_parameters()}
    others = set(layer_names) - {n for m in stage_modules for n in m.layer_names}
    state = checkpoint["state_dict"]
    for key in list(state):
        if key not in held and any(key.startswith(layer + ".") for layer in others):
            del state[key]


__all__ = ["keep_own_stages", "merge_param_group_names"]
