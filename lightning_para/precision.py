"""``ParaPrecision``: the precision core (:mod:`lightning_para.core.precision`) as the Trainer's precision plugin.

The modes, fp32 masters, rank-agreed loss scaling and global-norm clipping are
:class:`~lightning_para.core.precision.PrecisionCore`'s; this class adds only what Lightning's ``Precision``
protocol needs (the closure around the optimizer step, the Trainer's hooks around backward).

Choose the mode either with ``Trainer(precision="bf16-true")`` (ParaStrategy converts Lightning's plugin into
this one) or with ``ParaStrategy(precision=...)``, which takes precedence. On CPU, Lightning turns
``Trainer(precision="16-mixed")`` into ``bf16-mixed``; use ``ParaStrategy(precision="16-mixed")`` for fp16 there.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import LBFGS

from lightning_para.core.precision import PrecisionCore
from lightning_para.spec.options import PRECISIONS


class ParaPrecision(PrecisionCore, Precision):
    """Precision plugin for :class:`~lightning_para.ParaStrategy` (arguments: :class:`~lightning_para.core.precision.PrecisionCore`'s)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast to ``param_dtype``. ParaStrategy does not call this: :func:`~lightning_para.parallelize`
        casts at the right point of its order (before any gradient hook, after ZeRO took fp32 masters; never
        FSDP2's fp32 shards)."""
        return module.to(dtype=self.param_dtype) if self.param_dtype is not None else module

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return super().pre_backward(tensor * self.scale if self.uses_loss_scaling else tensor, module)

    def _wrap_closure(self, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        self.before_optimizer_step(optimizer, True)
        self._after_closure(model, optimizer)
        return closure_result

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if not self.uses_loss_scaling and self._step_gate is None:
            return optimizer.step(closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)
        if isinstance(optimizer, LBFGS):
            what = "`precision='16-mixed'`" if self.uses_loss_scaling else "`spike_guard`"
            raise ValueError(f"{what} cannot drive LBFGS (it re-evaluates the closure); use 32-true without it.")
        closure_result = closure()
        self.before_optimizer_step(optimizer, not self.uses_loss_scaling)
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return closure_result
        found_inf = self.uses_loss_scaling and self.unscale_and_check(optimizer)
        self._after_closure(model, optimizer)
        if found_inf:
            self.skipped_steps += 1
            self.update_scale(found_inf=True)
            return closure_result
        if not self.uses_loss_scaling:
            return self.gated_step(optimizer, lambda: optimizer.step(**kwargs))
        output = optimizer.step(**kwargs)
        self.update_scale(found_inf=False)
        return output


def as_para_precision(plugin: Optional[Precision]) -> Optional[ParaPrecision]:
    """Convert the plugin Lightning built from ``Trainer(precision=...)`` into a ParaPrecision."""
    if plugin is None or isinstance(plugin, ParaPrecision):
        return plugin
    mode = getattr(plugin, "precision", "32-true")
    if mode not in PRECISIONS:
        raise ValueError(
            f"ParaStrategy does not support `precision={mode!r}`. Choose one of {', '.join(repr(p) for p in PRECISIONS)}."
        )
    return ParaPrecision(mode)


__all__ = ["ParaPrecision", "as_para_precision"]
