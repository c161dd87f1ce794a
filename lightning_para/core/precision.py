"""``PrecisionCore``: mixed precision that agrees across shards, whichever front end drives it.

The modes (``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-true``, ``16-mixed``), the fp32 master weights of
``*-true`` (sharded with the ZeRO stage; ``master_weights=False``: Lightning's true half precision) and what plain
precision plugins get wrong once state is sharded: the loss-scaling decision is all-reduced (MAX) over the world
(every rank skips, or every rank steps), and clipping uses the true global norm over dp, tp, pp and ep shards
(``docs/precision.md``). The Trainer's :class:`~lightning_para.ParaPrecision` and Fabric's
:class:`~lightning_para.fabric.FabricParaPrecision` are this core in their framework's plugin protocol; the engine
reads only this class. ``.scaler`` is the ``GradScaler``-compatible view of the loss scaling under ``16-mixed``
(:class:`~lightning_para.scaler.ParaGradScaler`), ``None`` otherwise, as in Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer

from lightning_para.spec.options import PRECISIONS
from lightning_para.parallel.data.grad_norm import clip_grads_by_global_norm, clip_grads_by_value, grad_groups
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.scaler import ParaGradScaler

_HALF_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16, "16-true": torch.float16}


class PrecisionCore:
    """The precision modes, fp32 masters, rank-agreed loss scaling and global-norm clipping (module docstring).

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-true"`` or ``"16-mixed"``.
        init_scale, growth_factor, backoff_factor, growth_interval: dynamic loss scaling for
            ``"16-mixed"`` (same meaning as ``torch.amp.GradScaler``).
        master_weights: under ``"bf16-true"``/``"16-true"``, whether the optimizer steps fp32 masters
            (default: the ZeRO paper's layout, sharded with the stage; under ZeRO-3 FSDP2's fp32 shards,
            so the parameters read fp32 between steps). ``False``: Lightning's true half precision,
            the parameters and optimizer state in the half dtype under every stage (less memory; small
            updates can round away). Ignored by the other modes.
    """

    def __init__(
        self, precision: str = "32-true", *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
        backoff_factor: float = 0.5, growth_interval: int = 2000, master_weights: bool = True,
    ) -> None:
        precision = str(precision)
        if precision not in PRECISIONS:
            raise ValueError(
                f"`precision={precision!r}` is not supported by ParaPrecision. Choose one of"
                f" {', '.join(repr(p) for p in PRECISIONS)}."
            )
        self.precision = precision
        self.master_weights = bool(master_weights)
        self.device_type = "cpu"
        self.scale = float(init_scale) if precision == "16-mixed" else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self.skipped_steps = 0
        # From `connect_layout`: finishes any pending gradient communication before the
        # gradients are read (unscaling, inf check, clipping), and counts gradient replicas.
        self._finalize_gradients: Callable[[], None] = lambda: None
        self._grad_replication: Optional[Callable[[Tensor], int]] = None
        self._check_step: Optional[Callable[[Optimizer, bool], None]] = None
        # The spike guard's decision around each optimizer step, and the global norm clipping computed (it judges it).
        self._step_gate: Optional[Callable[..., Any]] = None
        self._clip_norm: Optional[Tensor] = None
        self._scaler = ParaGradScaler(self) if precision == "16-mixed" else None

    def connect_layout(
        self, data_parallel: DataParallel, check_step: Optional[Callable[[Optimizer, bool], None]] = None,
        step_gate: Optional[Callable[..., Any]] = None,
    ) -> None:
        """Called by the engine once the model is parallelized: :meth:`~DataParallel.flush` completes pending
        gradient communication (ZeRO's buckets) before gradients are unscaled, checked or clipped; its
        ``grad_replication`` says on how many ranks a parameter's gradient is identical (the global norm).
        ``check_step(optimizer, check_gradients)`` runs on every rank once the gradients are final, before
        callbacks, clipping and the optimizer step (gradients unchecked under fp16 loss scaling, where an inf
        gradient only skips the step): the step guard's agreement (:mod:`lightning_para.reliability.step_guard`).
        ``step_gate`` runs each optimizer step (the spike guard's
        :meth:`~lightning_para.reliability.spike_guard.SpikeGuard.run_step`)."""
        if step_gate is not None and self.uses_loss_scaling:
            raise ValueError("`spike_guard` does not combine with `precision='16-mixed'` (whose loss scaler skips steps"
                             " itself): use 'bf16-mixed' or 32-true with it, or pass `spike_guard=None`.")
        self._step_gate = step_gate
        self._finalize_gradients = data_parallel.flush
        self._grad_replication = data_parallel.grad_replication
        self._check_step = check_step

    def finalize_gradients(self) -> None:
        """Finish pending gradient communication (ZeRO's buckets) before gradients are read."""
        self._finalize_gradients()

    def before_optimizer_step(self, optimizer: Optimizer, check_gradients: bool) -> None:
        """The gradients are final: pending communication finished, then the step guard's agreement."""
        self._finalize_gradients()
        if self._check_step is not None:
            self._check_step(optimizer, check_gradients)

    def gated_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """``step()`` (the optimizer step) through the spike guard, which may skip it or clip the gradients first."""
        clip_norm, self._clip_norm = self._clip_norm, None
        if self._step_gate is None:
            return step()
        return self._step_gate(optimizer, self.main_params(optimizer), clip_norm, step)

    @property
    def scaler(self) -> Optional[ParaGradScaler]:
        """A ``torch.amp.GradScaler``-compatible view of the loss scaling (``16-mixed``), else ``None``."""
        return self._scaler

    # ---------------------------------------------------------------- dtypes
    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return _HALF_DTYPES.get(self.precision)

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        """dtype of the model's parameters during compute (``None``: unchanged, fp32)."""
        return _HALF_DTYPES[self.precision] if self.precision.endswith("-true") and self.precision != "32-true" else None

    @property
    def master_dtype(self) -> Optional[torch.dtype]:
        """dtype of the optimizer's copy of the weights when it differs from the model's (``None``: the
        optimizer steps the model's own weights, e.g. ``master_weights=False``)."""
        return torch.float32 if self.param_dtype is not None and self.master_weights else None

    @property
    def uses_loss_scaling(self) -> bool:
        return self.precision == "16-mixed"

    @property
    def loss_scale(self) -> float:
        """What a backward starts from: the fp16 loss scale, else 1."""
        return self.scale if self.uses_loss_scaling else 1.0

    @contextlib.contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        """``init_module()`` creates floating-point tensors in the parameter dtype (as Lightning's
        half-precision plugins do); the fp32 masters are then upcast from those weights."""
        previous = torch.get_default_dtype()
        if self.param_dtype is not None:
            torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    # ---------------------------------------------------------------- forward
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in ("bf16-mixed", "16-mixed"):
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        else:
            yield

    def convert_input(self, data: Any) -> Any:
        dtype = self.param_dtype
        if dtype is not None:
            return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)
        return data

    def convert_output(self, data: Any) -> Any:
        if self.param_dtype is not None:
            return apply_to_collection(data, Tensor, lambda t: t.float() if t.is_floating_point() else t)
        return data

    # ---------------------------------------------------------------- loss scaling
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """The tensors ``optimizer`` steps (ZeRO masters where they stand in for the parameters)."""
        for group in optimizer.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        """Divide the optimizer's gradients by the scale; True if any rank found inf/NaN (all-reduced MAX). One fused
        unscale-and-check per (device, dtype), ``GradScaler``'s kernel, and one host read."""
        found = []
        for grads in grad_groups(self.main_params(optimizer)):
            flag, inv_scale = (torch.full((1,), v, device=grads[0].device) for v in (0.0, 1.0 / self.scale))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale)
            found.append(flag.to(self._flag_device()))
        local_inf = torch.cat(found).amax() if found else torch.zeros((), device=self._flag_device())
        if dist.is_initialized():  # every rank holds different shards: all must agree to skip, or replicas diverge
            dist.all_reduce(local_inf, op=dist.ReduceOp.MAX)
        return bool(local_inf.item() > 0)

    @staticmethod
    def _flag_device() -> torch.device:
        """Where the skip flag is agreed: the process group's device (CPU without one)."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def growth_tracker(self) -> int:
        """Consecutive finite steps since the scale last changed."""
        return self._growth_tracker

    def update_scale(self, found_inf: bool) -> None:
        """Back off after an inf/NaN step; grow after ``growth_interval`` finite ones (``GradScaler.update``)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self._growth_tracker = 0

    # ---------------------------------------------------------------- clipping
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> Tensor:
        """Clip to the true global norm over every shard (dp, tp, pp, ep); returns that norm before clipping."""
        params = list(self.main_params(optimizer))
        kwargs = {} if self._grad_replication is None else {"replication": self._grad_replication}
        self._clip_norm = clip_grads_by_global_norm(params, float(clip_val), norm_type, **kwargs)
        return self._clip_norm  # the spike guard judges this norm (no second one is computed)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grads_by_value(self.main_params(optimizer), float(clip_val))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if not self.uses_loss_scaling:
            return {}
        return {"scale": self.scale, "growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.uses_loss_scaling and state_dict:
            self.scale = float(state_dict["scale"])
            self._growth_tracker = int(state_dict["growth_tracker"])
            self.skipped_steps = int(state_dict.get("skipped_steps", 0))


__all__ = ["PrecisionCore"]
