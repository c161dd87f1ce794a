"""``ParaPrecision.scaler``: the ``torch.amp.GradScaler`` interface over rank-agreed loss scaling.

Lightning's mixed-precision plugin exposes ``precision_plugin.scaler`` (a ``GradScaler`` under
``16-mixed``, ``None`` otherwise), and user code reads it: ``scaler.get_scale()`` for logging,
``scaler.state_dict()``, or, in manual optimization, the ``scale``/``unscale_``/``step``/``update``
sequence. ``GradScaler`` itself checks each device's gradients for inf/NaN on its own; with
sharded gradients that lets ranks disagree on skipping a step, and the replicas diverge. So
:class:`ParaGradScaler` implements the same public methods on top of
:class:`~lightning_para.ParaPrecision`'s scaling, whose inf check is all-reduced over the world:
the two are one state (the scale the plugin multiplies losses by *is* ``get_scale()``).
It is duck-typed (``isinstance(scaler, torch.amp.GradScaler)`` is False).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer


class LossScaling(Protocol):
    """What :class:`ParaGradScaler` needs from the precision plugin (``ParaPrecision`` provides it)."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    skipped_steps: int

    def finalize_gradients(self) -> None: ...

    def unscale_and_check(self, optimizer: Optimizer) -> bool: ...

    def update_scale(self, found_inf: bool) -> None: ...

    def growth_tracker(self) -> int: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ParaGradScaler:
    """``torch.amp.GradScaler``'s public methods, backed by ``ParaPrecision`` (see the module docstring)."""

    def __init__(self, precision: LossScaling) -> None:
        self._precision = precision
        # id(optimizer) -> found inf/NaN, for optimizers unscaled since the last `update()`.
        self._found_inf: dict[int, bool] = {}

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self._precision.scale

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or a collection of tensors) by the current scale."""
        return apply_to_collection(outputs, Tensor, lambda t: t * self._precision.scale)

    def unscale_(self, optimizer: Optimizer) -> None:
        """Finish gradient communication, divide the optimizer's gradients by the scale and agree
        with every rank on whether any of them is inf/NaN."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        self._precision.finalize_gradients()
        self._found_inf[id(optimizer)] = self._precision.unscale_and_check(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """``optimizer.step(...)`` unless some rank found inf/NaN (then every rank skips it)."""
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self._precision.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """Grow or back off the scale (or set ``new_scale``), as ``GradScaler.update`` does."""
        if new_scale is not None:
            self._precision.scale = float(new_scale)
        elif self._found_inf:
            self._precision.update_scale(found_inf=any(self._found_inf.values()))
        self._found_inf.clear()

    def get_growth_factor(self) -> float:
        return self._precision.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._precision.growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._precision.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._precision.backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._precision.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._precision.growth_interval = int(new_interval)

    def state_dict(self) -> dict[str, Any]:
        """``GradScaler.state_dict()``'s keys."""
        p = self._precision
        return {
            "scale": p.scale, "growth_factor": p.growth_factor, "backoff_factor": p.backoff_factor,
            "growth_interval": p.growth_interval, "_growth_tracker": p.growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts ``GradScaler.state_dict()``'s format (and ``ParaPrecision.state_dict()``'s)."""
        p = self._precision
        for key in ("growth_factor", "backoff_factor"):
            if key in state_dict:
                setattr(p, key, float(state_dict[key]))
        if "growth_interval" in state_dict:
            p.growth_interval = int(state_dict["growth_interval"])
        p.load_state_dict({
            "scale": state_dict["scale"],
            "growth_tracker": state_dict.get("_growth_tracker", state_dict.get("growth_tracker", 0)),
            "skipped_steps": state_dict.get("skipped_steps", p.skipped_steps),
        })


__all__ = ["LossScaling", "ParaGradScaler"]
