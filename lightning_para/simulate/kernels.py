"""Meta-device stand-ins for the GPU's fused kernels, so a dry run's saved tensors are a real run's.

On the meta (and CPU) device attention takes its math fallback and RMSNorm decomposes: both keep more for
backward than the CUDA kernels a real run uses. :class:`FusedKernels` (a ``TorchFunctionMode``) runs
stand-ins with the CUDA kernels' saved-tensor profiles. It also answers ``transformers``' own data-dependent
checks on meta tensors that an integration registered an answer for (:func:`register_meta_answer`; transformers'
mask checks: ``integrations/transformers/dry_run.py``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from torch.overrides import TorchFunctionMode

from lightning_para.spec.plugins import load_plugins


class _MetaFlashAttention(torch.autograd.Function):
    """Causal attention with the saved-tensor profile of a GPU flash kernel on grouped-query heads:
    ``q``, the *unrepeated* ``k``/``v``, the output and the fp32 log-sum-exp (flash attention with
    ``enable_gqa`` reads k/v heads in place). Shapes only: the forward and backward run the CPU flash
    kernel's meta implementation on k/v repeated to the query heads, and do not keep the repeat."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, is_causal, scale):  # noqa: ANN001, ANN205
        group = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), dropout_p, is_causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group, dropout_p, is_causal, scale = ctx.args
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), out, lse,
            dropout_p, is_causal, scale=scale,
        )
        b, kv_heads = k.shape[0], k.shape[1]
        dk = dk.view(b, kv_heads, group, *dk.shape[2:]).sum(2)
        dv = dv.view(b, kv_heads, group, *dv.shape[2:]).sum(2)
        return dq, dk, dv, None, None, None


class _MetaFusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps what CUDA's ``aten._fused_rms_norm`` keeps: the 16-bit input and the fp32
    ``rstd`` (on meta/CPU that op decomposes and keeps two fp32 copies of the input instead)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: ANN001, ANN205
        upcast = x.float()
        rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
        out = upcast * rstd
        if weight is not None:
            out = out * weight.float()
        ctx.save_for_backward(x, rstd, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * (weight.float() if weight is not None else 1.0)
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).flatten(0, -2).sum(0).to(weight.dtype) if weight is not None else None
        return dx.to(x.dtype), dw, None


def _rms_norm(x: Tensor, weight: Optional[Tensor], eps: Optional[float]) -> Tensor:
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    if not isinstance(x, DTensor):
        weight = weight.to_local() if isinstance(weight, DTensor) else weight
        return _MetaFusedRMSNorm.apply(x, weight, eps)
    # Sequence-sharded norm: run on the local rows; the weight's gradient is a partial sum over them.
    local_weight = None
    if weight is not None:
        local_weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim) \
            if isinstance(weight, DTensor) else weight
    out = _MetaFusedRMSNorm.apply(x.to_local(), local_weight, eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class FusedKernels(TorchFunctionMode):
    """The fused GPU kernels' saved tensors for attention and RMSNorm, on meta tensors.

    Without it the dry run's activations came out ~3x the planner's: on the meta (and CPU) device two ops take
    composite paths that keep more for backward than the CUDA kernels a real run uses:

    * ``scaled_dot_product_attention`` takes its math fallback, which keeps the ``heads x s x s``
      scores; this mode calls the flash kernel's meta implementation instead, through
      :class:`_MetaFlashAttention` so grouped-query k/v are kept unrepeated, as CUDA's flash
      attention (``enable_gqa``) does.
    * ``rms_norm`` is decomposed: it keeps the fp32 upcast input and the fp32 normalized tensor,
      ``8 sbh`` bytes per norm; on CUDA it runs ``aten._fused_rms_norm``, which keeps the 16-bit
      input and the fp32 ``rstd`` (``2 sbh + 4 sb``). That op decomposes on meta too, so this mode
      runs :class:`_MetaFusedRMSNorm`, which keeps what the CUDA kernel keeps.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            plain = all(type(t) is Tensor or type(t) is nn.Parameter for t in (q, k, v))
            if plain and q.is_meta and kwargs.get("attn_mask") is None and len(args) == 3:
                return _MetaFlashAttention.apply(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), kwargs.get("scale")
                )
        if func in _DATA_DEPENDENT and isinstance(args[0], Tensor) and args[0].is_meta:
            answer = _meta_answer(func)
            if answer is not None:
                return answer
        if func is F.rms_norm and args[0].is_meta:
            x, shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")
            if len(shape) == 1:
                return _rms_norm(x, weight, eps)
        return func(*args, **kwargs)


_DATA_DEPENDENT = (Tensor.__bool__, Tensor.item)


# Answers to a library's data-dependent checks on meta tensors (``bool(t)``, ``t.item()``), which integrations
# register: each takes the function asked and the module name of the code that asked, and returns the answer, or
# None to let the check fail. Meta tensors have no values, so only a library that knows what the dry run's plain
# token windows would give may answer (``integrations/transformers/dry_run.py``); any other check still raises.
MetaAnswer = Callable[[Any, str], Any]
_META_ANSWERS: list[MetaAnswer] = []


def register_meta_answer(answer: MetaAnswer) -> None:
    """Add ``answer(func, caller_module)`` to the answers a dry run gives data-dependent checks on meta tensors."""
    if answer not in _META_ANSWERS:
        _META_ANSWERS.append(answer)


def _meta_answer(func):  # noqa: ANN001, ANN202
    """The registered answer to the caller of ``Tensor.__bool__`` / ``.item`` on a meta tensor, or ``None``."""
    frame = sys._getframe(1)  # private: up to the caller of Tensor.__bool__ / .item, past the torch-function modes
    while frame is not None and (
        frame.f_code.co_name == "__torch_function__" or frame.f_globals.get("__name__", "").startswith("torch")
    ):
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    load_plugins()
    for answer in _META_ANSWERS:
        value = answer(func, caller)
        if value is not None:
            return value
    return None


# The dry run's name for it before the split (tests and callers used it).
_FusedAttention = FusedKernels

__all__ = ["FusedKernels", "MetaAnswer", "register_meta_answer"]
