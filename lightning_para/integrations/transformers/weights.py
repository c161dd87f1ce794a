"""A transformers model folder read sharded: the model built without weights, and its names in the files.

:func:`empty_causal_lm` builds ``AutoModelForCausalLM`` from the folder's ``config.json`` with every
parameter on the meta device (no memory, no random init) and its buffers real (RoPE tables are computed at
construction and are not in the weights files), also inside Lightning's ``init_module(empty_init=True)``
meta context, where ``from_pretrained`` refuses to run. :func:`pretrained_weights` says where its weights
are; :func:`lightning_para.checkpoint.pretrained.load_pretrained_into` reads each rank's slices after
``ParaStrategy`` parallelized the model.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_para.checkpoint.pretrained import PretrainedWeights, stored_tensors
from lightning_para.checkpoint.stacked import Stacked


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; tensors and buffers are built on the CPU
    (an inner ``torch.device`` context wins over Lightning's meta one). Layers' own initialisation then runs
    on meta: free. (What ``accelerate.init_empty_weights(include_buffers=False)`` does.)"""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            setattr(module, name, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_config(folder: Union[str, Path]) -> Any:
    """The folder's transformers config (``ValueError`` naming the folder when it has none)."""
    from transformers import AutoConfig  # optional: transformers is needed only here

    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"`pretrained={str(folder)!r}` has no config.json: pass a local folder written by `save_pretrained` (or"
            " `lightning_para.integrations.transformers.export`)."
        )
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def empty_causal_lm(folder: Union[str, Path]) -> nn.Module:
    """The folder's causal LM with parameters on meta and real buffers (see the module docstring)."""
    from transformers import AutoModelForCausalLM  # optional: transformers is needed only here

    config = load_config(folder)
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config)


# transformers 5 stacks Mixtral-style experts in the model (``mlp.experts.gate_up_proj[E, 2I, H]``,
# ``mlp.experts.down_proj[E, H, I]``) and writes checkpoints in the per-expert layout of the Hub
# (``block_sparse_moe.experts.{e}.w1/w3/w2.weight``; conversion_mapping.py, "mixtral"). Model name -> pieces:
_PER_EXPERT_FILES = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.w1\.weight$")
_STACKS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


def pretrained_weights(folder: Union[str, Path], prefix: str) -> PretrainedWeights:
    """Where the weights of the model at ``prefix`` in the LightningModule are. The files' names are the
    model's ``state_dict`` names (what ``save_pretrained`` writes for dense decoder-only models), except for
    Mixtral-style experts, stored one tensor per expert (``block_sparse_moe.experts.{e}.w1``): those are
    mapped onto the model's stacked experts, each rank reading only its experts' pieces. Anything else
    that differs is reported name by name before anything is read."""
    path = Path(folder).expanduser()
    experts: dict[str, int] = {}
    for name in stored_tensors(path):
        match = _PER_EXPERT_FILES.match(name)
        if match:
            experts[match["layer"]] = max(experts.get(match["layer"], 0), int(match["e"]) + 1)
    if not experts:
        return PretrainedWeights(path, prefix)

    def rename(name: str) -> str:  # the router: `<layer>.mlp.gate.weight` is `<layer>.block_sparse_moe.gate.weight`
        layer, sep, rest = name.partition(".mlp.")
        return f"{layer}.block_sparse_moe.{rest}" if sep and layer in experts and not rest.startswith("experts.") else name

    def stacked(name: str) -> Optional[Stacked]:
        layer, sep, rest = name.partition(".mlp.experts.")
        if not sep or layer not in experts or rest not in _STACKS:
            return None
        return Stacked(experts[layer], tuple(f"{layer}.block_sparse_moe.experts.{{}}.{w}.weight" for w in _STACKS[rest]))

    return PretrainedWeights(path, prefix, rename=rename, stacked=stacked)


__all__ = ["empty_causal_lm", "load_config", "pretrained_weights"]
