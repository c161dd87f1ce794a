"""The spike guard: a rolling z-score of the loss and of the global gradient norm; a spiking optimizer step is
skipped (or its gradients clipped) on every rank, at that step (``docs/reliability.md``, "Loss spikes").

The loss is the mean over ranks of each rank's local loss; the norm, the one clipping computed this step (before
clipping) when it ran, else the step guard's pass (the finite check's, weighted by replication). Both come out of
the step guard's one all-reduce per optimizer step (or clipping's), bitwise the same on every rank, so every rank
judges alike without a collective of its own. A value above ``mean + threshold * std`` of its window (after
``warmup`` steps), or not finite, is a spike; it enters the window at its limit, so one spike does not widen the
deviation that judges the next, while a lasting shift still moves the mean.

The step guard reads its agreement a step late; the decision needs it in the step: on an accelerator the stream
already waits for the all-reduce (no host sync), on CPU the host waits for it. ``"skip"``: torch's fused
optimizers take the decision as ``found_inf`` (``GradScaler``'s protocol) and skip on the device, undoing their
step count; any other optimizer costs one host read per step. ``"clip"``: the gradients are scaled on the device
by ``limit / value`` of the statistic that spiked (the smaller if both); a non-finite value is left to the finite
check. Each spike is logged one step late, on every rank, with its step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_para._dtensor import local_tensor

SPIKE_ACTIONS = ("skip", "clip")


@dataclass(frozen=True)
class SpikeEvent:
    """One spiking optimizer step, as every rank logged it (``limit``: ``mean + threshold * std`` then)."""

    step: int
    action: str
    loss: float
    loss_limit: float
    grad_norm: float
    grad_norm_limit: float


class SpikeGuard:
    """Skip (or clip) an optimizer step whose loss or global gradient norm spikes (see the module docstring).

    Args:
        window: optimizer steps in the rolling mean and standard deviation.
        threshold: how many standard deviations above the mean make a spike.
        warmup: optimizer steps observed before any is judged (at most ``window``).
        action: ``"skip"`` the optimizer step or ``"clip"`` the gradients to the limit.
    """

    wants_grad_norm = True  # the step guard's gradient pass (the global norm when clipping computes none)

    def __init__(self, window: int = 100, threshold: float = 6.0, warmup: int = 20, action: str = "skip") -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"`spike_guard` window={window!r} must be an int >= 2 (optimizer steps in the rolling window).")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 2 <= warmup <= window:
            raise ValueError(f"`spike_guard` warmup={warmup!r} must be an int in [2, window={window}].")
        if not isinstance(threshold, (int, float)) or not threshold > 0 or math.isinf(threshold):
            raise ValueError(f"`spike_guard` threshold={threshold!r} must be a positive number of standard deviations.")
        if action not in SPIKE_ACTIONS:
            raise ValueError(f"`spike_guard` action={action!r} is unknown. Choose 'skip' (no optimizer step) or 'clip'.")
        self.window, self.threshold, self.warmup, self.action = window, float(threshold), warmup, action
        self.events: list[SpikeEvent] = []
        self.connect(torch.device("cpu"), None)

    def connect(self, device: torch.device, guard: Any) -> None:
        """Start a fit: an empty window on ``device``; ``guard`` is the step guard whose all-reduce carries the loss."""
        self.device, self._guard = torch.device(device), guard
        self._window = torch.zeros(2, self.window, device=self.device)  # [loss, norm] x steps, a ring
        self._seen = 0  # steps recorded (the same on every rank: host-side, no read)
        self._loss = torch.zeros(2, device=self.device)  # local (sum, count) since the last decision
        self._last: Optional[tuple[int, Tensor, Any]] = None  # the last decision: step, host record, its event

    # ---------------------------------------------------------------- the step guard's rider
    @torch.no_grad()
    def observe_loss(self, loss: Tensor) -> None:
        """Add this rank's local loss (a device scalar; no sync)."""
        value = local_tensor(loss).detach().float().reshape(-1).sum().to(self.device)
        self._loss += torch.stack([value, torch.ones_like(value)])

    def payload(self, step: int, stepping: bool) -> Tensor:
        """What this rank adds to the step guard's all-reduce (SUM): its local loss sum and count."""
        return self._loss

    def agreed(self, step: int, values: list[float]) -> None:
        """The step guard read an agreement (a step late): log the decision taken since, if it was a spike."""
        if self._last is None or self._last[0] > step:
            return
        (at, host, event), self._last = self._last, None
        if event is not None:
            event.synchronize()
        spike, loss, norm, loss_limit, norm_limit = host.tolist()
        if spike:
            self.events.append(SpikeEvent(at, self.action, loss, loss_limit, norm, norm_limit))
            done = "skipped the optimizer step" if self.action == "skip" else "clipped the gradients to the limit"
            sys.stderr.write(
                f"[rank {dist.get_rank() if dist.is_initialized() else 0}] lightning-para spike guard: step {at}: loss"
                f" {loss:.6g} (limit {loss_limit:.6g}), gradient norm {norm:.6g} (limit {norm_limit:.6g}; limits: mean +"
                f" {self.threshold:g} std of the last {self.window} steps): {done} on every rank.\n"
            )

    # ---------------------------------------------------------------- the decision, at the optimizer step
    @torch.no_grad()
    def run_step(self, optimizer: Any, params: Iterable[Tensor], clip_norm: Optional[Tensor], run: Callable[[], Any]) -> Any:
        """Decide on this step and call ``run()`` (the optimizer step) unless it is skipped. ``clip_norm``: the
        global norm gradient clipping computed this step (before clipping), else ``None``."""
        current = self._guard.this_step(self) if self._guard is not None else None
        if current is None:  # no agreement this step (nothing was checked): nothing to judge
            return run()
        step, grad_sq, (loss_sum, count) = current
        norm = clip_norm.float().to(self.device) if clip_norm is not None else grad_sq.sqrt()
        x = torch.stack([loss_sum / count.clamp(min=1), norm])
        over, limit = self._judge(x)
        spike = over.any()
        self._loss.zero_()
        record = torch.cat([spike[None].float(), x, limit])
        if record.device.type == "cpu":
            self._last = (step, record, None)
        else:  # read a step later, behind the step's work: no sync
            event = torch.Event(record.device)
            self._last = (step, record.to("cpu", non_blocking=True), event)
            event.record()
        if self.action == "clip":
            coef = torch.where(over & (x > 0) & (limit > 0), limit / x, torch.ones_like(x)).min().clamp(max=1.0)
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
            return run()
        if getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"):
            optimizer.found_inf = spike.float()  # torch's fused kernels skip on the device and undo their step count
            try:
                return run()
            finally:
                del optimizer.found_inf
        return None if bool(spike) else run()  # the one host read: an optimizer without found_inf

    def _judge(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Which statistics spike, and their limits; records ``x`` (a spike at its limit) in the window."""
        n = min(self._seen, self.window)
        finite = torch.isfinite(x)
        if n < self.warmup:
            limit = torch.full_like(x, math.inf)
            fallback = self._window[:, :n].mean(1) if n else torch.zeros_like(x)
        else:
            recent = self._window[:, :n]
            mean, std = recent.mean(1), recent.std(1, correction=0)
            # A floor on the deviation: a flat series (std 0) would call any rise a spike.
            limit = mean + self.threshold * torch.maximum(std, 1e-3 * mean.abs() + 1e-12)
            fallback = mean
        over = ~(x <= limit)  # NaN and inf are spikes
        self._window[:, self._seen % self.window] = torch.where(finite, torch.minimum(x, limit), fallback)
        self._seen += 1
        return over, limit


def spike_guard_option(value: Union[None, bool, str, Mapping[str, Any], SpikeGuard]) -> Optional[SpikeGuard]:
    """``ParaStrategy(spike_guard=...)``: ``None``/``False`` (off), ``True``, ``"skip"``/``"clip"``, a mapping of
    :class:`SpikeGuard`'s arguments (YAML) or a :class:`SpikeGuard`."""
    return SpikeGuard(action=value) if isinstance(value, str) else option("spike_guard", value, SpikeGuard)


def option(name: str, value: Any, cls: type) -> Any:
    """A reliability option: ``None``/``False`` (off), ``True`` (``cls()``), a mapping of its arguments, or ``cls``'s."""
    if value is None or value is False:
        return None
    if isinstance(value, cls):
        return value
    if value is True or isinstance(value, Mapping):
        try:
            return cls(**(value if isinstance(value, Mapping) else {}))
        except TypeError as error:  # an unknown key
            raise ValueError(f"`{name}`: {error}; pass a dict of {cls.__name__}'s arguments.") from None
    raise ValueError(f"`{name}={value!r}`: pass True, False, a dict of {cls.__name__}'s arguments or a {cls.__name__}.")


__all__ = ["SPIKE_ACTIONS", "SpikeEvent", "SpikeGuard", "option", "spike_guard_option"]
