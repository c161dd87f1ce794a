"""``ParaPrecision``: mixed precision that agrees across shards.

Modes:

============  ==============================  =======================================
mode          parameters / compute            optimizer steps
============  ==============================  =======================================
32-true       fp32 / fp32                     the fp32 parameters
bf16-mixed    fp32 / bf16 autocast            the fp32 parameters
bf16-true     bf16 / bf16                     fp32 master weights, sharded with ZeRO
16-true       fp16 / fp16                     fp32 master weights, sharded with ZeRO
16-mixed      fp32 / fp16 autocast            fp32 parameters, dynamic loss scaling
============  ==============================  =======================================

Under ``*-true``, ``trainer.init_module()`` creates the weights in bf16/fp16 (as Lightning's
plugins do) and the fp32 masters are upcast copies of them; a model built outside
``init_module()`` is fp32 first and its masters keep the exact fp32 initialisation.
Under ZeRO-3 the masters *are* FSDP2's shards, so the module's parameters read fp32 between
steps (FSDP2 gathers them in half precision for compute). ``master_weights=False`` is
Lightning's own true half precision instead: no fp32 masters, the weights and the optimizer
state in half precision under every ZeRO stage (the parameters then read bf16/fp16 under
ZeRO-3 too, as with Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy``).
``.scaler`` is the ``GradScaler``-compatible view of the loss scaling under ``16-mixed``
(:class:`~lightning_para.scaler.ParaGradScaler`) and ``None`` otherwise, as in Lightning.

``bf16-true`` is the ZeRO paper's 16 bytes/parameter layout: 2 (bf16 weights) + 2 (bf16
grads) + 4 (fp32 master) + 8 (Adam moments), where the optimizer's 12 bytes are divided by
dp from ZeRO-1 on, the grads from ZeRO-2 on, everything at ZeRO-3.

Two things plain Lightning precision plugins get wrong once state is sharded, done here:

* **Loss scaling agrees on all ranks.** Each rank checks only its own gradient shards for
  inf/NaN, so the decision is all-reduced (MAX) over the world before anyone steps:
  every rank skips, or every rank steps, and all scales stay equal.
* **Clipping uses the true global norm** over dp, tp, pp and ep shards
  (:mod:`lightning_para.parallel.grad_norm`).

Choose the mode either with ``Trainer(precision="bf16-true")`` (ParaStrategy converts
Lightning's plugin into this one) or with ``ParaStrategy(precision=...)``, which takes
precedence. On CPU, Lightning turns ``Trainer(precision="16-mixed")`` into ``bf16-mixed``;
use ``ParaStrategy(precision="16-mixed")`` for fp16 there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from functools import partial
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import LBFGS, Optimizer

from lightning_para._dtensor import local_tensor
from lightning_para.spec.options import PRECISIONS
from lightning_para.parallel.data.grad_norm import clip_grads_by_global_norm, clip_grads_by_value
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.scaler import ParaGradScaler

_HALF_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16, "16-true": torch.float16}


class ParaPrecision(Precision):
    """Precision plugin for :class:`~lightning_para.ParaStrategy`.

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
        self,
        precision: str = "32-true",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        master_weights: bool = True,
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
        """Called by ParaStrategy once the model is parallelized, with its data parallelism:
        :meth:`~DataParallel.flush` completes pending gradient communication (ZeRO's buckets) after
        backward, before gradients are unscaled, checked or clipped; its ``grad_replication`` says on
        how many ranks a parameter's gradient is identical, for the global norm of gradient clipping.
        ``check_step`` is called on every rank once the gradients are final, before callbacks, clipping
        and the optimizer step, with the optimizer and whether to check its gradients (not under fp16
        loss scaling, where an inf gradient only skips the step): the strategy's non-finite and signal
        agreement (:mod:`lightning_para.reliability.step_guard`). ``step_gate`` runs each optimizer step (the
        spike guard's :meth:`~lightning_para.reliability.spike_guard.SpikeGuard.run_step`)."""
        if step_gate is not None and self.uses_loss_scaling:
            raise ValueError("`spike_guard` does not combine with `precision='16-mixed'` (whose loss scaler skips steps"
                             " itself): use 'bf16-mixed' or 32-true with it, or pass `spike_guard=None`.")
        self._finalize_gradients = data_parallel.flush
        self._step_gate = step_gate
        self._grad_replication = data_parallel.grad_replication
        self._check_step = check_step

    def finalize_gradients(self) -> None:
        """Finish pending gradient communication (ZeRO's buckets) before gradients are read."""
        self._finalize_gradients()

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

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """``trainer.init_module()`` creates floating-point tensors in the parameter dtype (as Lightning's
        half-precision plugins do); the fp32 masters are then upcast from those weights."""
        return _DtypeContextManager(self.param_dtype) if self.param_dtype is not None else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @property
    def uses_loss_scaling(self) -> bool:
        return self.precision == "16-mixed"

    # ---------------------------------------------------------------- module and data
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast to ``param_dtype``. ParaStrategy does not call this: :func:`~lightning_para.parallelize`
        casts at the right point of its order (before any gradient hook, after ZeRO took fp32 masters; never
        FSDP2's fp32 shards)."""
        return module.to(dtype=self.param_dtype) if self.param_dtype is not None else module

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

    # ---------------------------------------------------------------- backward and step
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.uses_loss_scaling:
            tensor = tensor * self.scale
        return super().pre_backward(tensor, module)

    def _wrap_closure(self, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        self._finalize_gradients()
        if self._check_step is not None:
            self._check_step(optimizer, True)
        self._after_closure(model, optimizer)
        return closure_result

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if not self.uses_loss_scaling and self._step_gate is None:
            return optimizer.step(closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)
        if isinstance(optimizer, LBFGS):
            what = "`precision='16-mixed'`" if self.uses_loss_scaling else "`spike_guard`"
            raise ValueError(f"{what} cannot drive LBFGS (it re-evaluates the closure); use 32-true without it.")
        closure_result = closure()
        self._finalize_gradients()
        if self._check_step is not None:
            self._check_step(optimizer, not self.uses_loss_scaling)
        skip = closure_result is None and getattr(model, "automatic_optimization", True)
        if skip:
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

    def gated_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """``step()`` (the optimizer step) through the spike guard, which may skip it or clip the gradients first."""
        clip_norm, self._clip_norm = self._clip_norm, None
        if self._step_gate is None:
            return step()
        return self._step_gate(optimizer, self.main_params(optimizer), clip_norm, step)

    @torch.no_grad()
    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        """Divide the optimizer's gradients by the scale; True if any rank found inf/NaN (all-reduced MAX)."""
        inv_scale = 1.0 / self.scale
        local_inf = torch.zeros((), dtype=torch.float32)
        for p in self.main_params(optimizer):
            if p.grad is None:
                continue
            g = local_tensor(p.grad)
            g.mul_(inv_scale)
            if g.numel() and not torch.isfinite(g).all():
                local_inf.fill_(1.0)
        if dist.is_initialized():
            # Every rank holds different shards: all must agree to skip, or the replicas diverge.
            device = _default_group_device()
            flag = local_inf.to(device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local_inf = flag.cpu()
        return bool(local_inf.item() > 0)

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


def _default_group_device() -> torch.device:
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
