"""``FabricParaPrecision``: the precision core (:mod:`lightning_para.core.precision`) in Fabric's precision protocol.

The modes, the fp32 masters, the rank-agreed loss scaling and the global-norm clipping are
:class:`~lightning_para.core.precision.PrecisionCore`'s; only the call signatures differ between Lightning's two
front ends. Fabric calls ``backward(tensor, module)`` and ``optimizer_step(optimizer)`` (no closure, no Trainer
hooks) and ``unscale_gradients(optimizer)`` before clipping.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins import Precision as FabricPrecision
from torch import Tensor
from torch.optim import Optimizer

from lightning_para.core.precision import PrecisionCore
from lightning_para.spec.options import PRECISIONS


class FabricParaPrecision(PrecisionCore, FabricPrecision):
    """ParaPrecision for Fabric's ``ParaStrategy`` (arguments: :class:`~lightning_para.core.precision.PrecisionCore`'s).
    ``fabric.setup`` casts nothing: :func:`~lightning_para.parallelize` casts at the right point of its order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unscaled: Optional[bool] = None  # 16-mixed: found inf when this step's gradients were unscaled

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        (tensor * self.scale if self.uses_loss_scaling else tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Complete pending gradient communication, then (16-mixed) divide by the loss scale once per step."""
        self.finalize_gradients()
        if self.uses_loss_scaling and self._unscaled is None:
            self._unscaled = self.unscale_and_check(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The step guard's agreement, then the step; under 16-mixed every rank skips a step with inf gradients."""
        self.before_optimizer_step(optimizer, not self.uses_loss_scaling)
        if not self.uses_loss_scaling:
            return self.gated_step(optimizer, lambda: optimizer.step(**kwargs))
        self.unscale_gradients(optimizer)
        found_inf, self._unscaled = bool(self._unscaled), None
        self.update_scale(found_inf=found_inf)
        if found_inf:
            self.skipped_steps += 1
            return None
        return optimizer.step(**kwargs)


def as_fabric_para_precision(plugin: Optional[FabricPrecision]) -> Optional[FabricParaPrecision]:
    """Convert the plugin Fabric built from ``Fabric(precision=...)`` (or a Trainer-side ParaPrecision) into one."""
    if plugin is None or isinstance(plugin, FabricParaPrecision):
        return plugin
    if isinstance(plugin, PrecisionCore):
        return FabricParaPrecision(plugin.precision, master_weights=plugin.master_weights)
    mode = getattr(plugin, "precision", "32-true")
    if mode not in PRECISIONS:
        raise ValueError(
            f"ParaStrategy does not support `Fabric(precision={mode!r})`. Choose one of {', '.join(repr(p) for p in PRECISIONS)}."
        )
    return FabricParaPrecision(mode)


__all__ = ["FabricParaPrecision", "as_fabric_para_precision"]
