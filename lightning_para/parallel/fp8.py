"""Float8 training through torchao: ``ParaStrategy(fp8="tensorwise" | "rowwise")`` (issue 25, part 2).

:func:`apply_float8` swaps the chosen ``nn.Linear`` modules for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``):
their matmuls run on float8 casts of input, weight and gradient (dynamic scales, per tensor or
per row), the weights stay in their own dtype. ``parallelize()`` converts before anything else
changes the model (the tensor-parallel plan is kept by module identity, so the new modules must
exist before it is resolved).

Skipped, and named in :class:`Float8Info`: the output head (``head``/``lm_head``/``output``
modules and the module tied to the input embedding: its logits set the loss scale, torchtitan
skips it too) and every linear whose input or output width is not a multiple of 16 (float8
matmul kernels need it).

torchao is an optional dependency (``pip install lightning-para[fp8]``), imported only here and
only when ``fp8`` is set. ``emulate=None`` emulates the float8 matmul (casts, then a matmul in
the original dtype) unless a CUDA device with compute capability >= 8.9 (Ada, Hopper) is
present; on this project's CPU, torch's own ``torch._scaled_mm`` runs as well.

Not done yet (issue 25, named as half): torchao's float8 tensor-parallel styles under ``tp`` and
the float8 all-gather of FSDP2 under ZeRO-3; ``fp8`` with ``tp > 1`` raises a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import nn

FP8_RECIPES = ("tensorwise", "rowwise")
# Module names treated as the output head (the loss-setting projection stays in high precision).
HEAD_NAMES = ("head", "lm_head", "output")


@dataclass
class Float8Info:
    """What :func:`apply_float8` converted and what it skipped (name -> reason)."""

    recipe: str
    emulate: bool
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def float8_available() -> bool:
    """Whether this device has float8 tensor cores (CUDA compute capability >= 8.9)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _skip_reason(name: str, module: nn.Linear) -> Optional[str]:
    parts = name.split(".")
    if any(p in HEAD_NAMES for p in parts):
        return "the output head stays in high precision"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features} -> {module.out_features}: float8 matmuls need widths that are multiples of 16"
    return None


def float8_config(recipe: str, *, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``"tensorwise"`` or ``"rowwise"``)."""
    from torchao.float8 import Float8LinearConfig  # optional: pip install lightning-para[fp8]

    return replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def apply_float8(module: nn.Module, *, recipe: str, emulate: Optional[bool] = None) -> Float8Info:
    """Convert ``module``'s linears (all but the head and widths not multiple of 16) to float8 training, in place."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"`fp8={recipe!r}` is unknown. Choose one of {', '.join(map(repr, FP8_RECIPES))} or None.")
    try:
        from torchao.float8 import convert_to_float8_training  # optional: pip install lightning-para[fp8]
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("`fp8` needs torchao: `pip install lightning-para[fp8]` (torchao>=0.10).") from err
    emulate = (not float8_available()) if emulate is None else emulate
    info = Float8Info(recipe=recipe, emulate=emulate)
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and type(child) is nn.Linear:
            reason = _skip_reason(name, child)
            if reason is None:
                info.converted.append(name)
            else:
                info.skipped[name] = reason
    chosen = set(info.converted)
    convert_to_float8_training(
        module, module_filter_fn=lambda m, fqn: fqn in chosen, config=float8_config(recipe, emulate=emulate)
    )
    return info


__all__ = ["FP8_RECIPES", "Float8Info", "apply_float8", "float8_available", "float8_config"]
