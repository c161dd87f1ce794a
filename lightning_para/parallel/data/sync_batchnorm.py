"""BatchNorm statistics over the whole data-parallel batch: ``Trainer(sync_batchnorm=True)``.

Lightning's DDP/FSDP strategies answer ``sync_batchnorm=True`` with
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` over the world. ParaStrategy converts over
the **dp** group instead (tensor- and pipeline-parallel ranks of one dp coordinate see the same
samples, so they must not be counted twice), and on every device:

* on CUDA/XPU/HPU it uses ``torch.nn.SyncBatchNorm`` (fused kernels);
* elsewhere, where ``torch.nn.SyncBatchNorm`` raises ("expected input tensor to be on GPU"),
  notably on CPU with gloo, it uses :class:`DataParallelBatchNorm` below.

:class:`DataParallelBatchNorm` computes exactly what one BatchNorm computes on the global batch:
the per-channel mean and the biased variance over all dp ranks' samples normalise the input;
the running variance takes the unbiased variance (``n / (n - 1)``, ``n`` the global count), as
``torch.nn.functional.batch_norm`` does. Two all-reduces per layer in forward (sum and count,
then the centred sum of squares: the two-pass formula, no ``E[x^2] - E[x]^2`` cancellation),
and their mirror images in backward: the gradient of every rank's loss reaches every rank's
input through the shared statistics (Ioffe & Szegedy 2015, Sec. 3, with the sums taken over
ranks).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.modules.batchnorm import _BatchNorm  # private: see docs/architecture.md

# Devices on which torch.nn.SyncBatchNorm runs (it raises elsewhere).
_TORCH_SYNC_BN_DEVICES = ("cuda", "hpu", "xpu")


class _AllReduceSum(torch.autograd.Function):
    """``sum over ranks`` with its adjoint: backward all-reduces the output gradient too."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class DataParallelBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training statistics cover the batch of every rank in ``process_group``.

    Outside training (or on one rank, or without a process group) it is the ordinary BatchNorm.
    Build it with :func:`convert_sync_batchnorm`; ``original_type`` is the class it replaced.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        bias: bool = True,
        original_type: type = nn.BatchNorm1d,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, bias=bias)
        self.process_group = process_group
        self.original_type = original_type

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _sync_size(self) -> int:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        if self._sync_size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        x = input.float()  # statistics in fp32, as torch's kernels accumulate them
        reduce_dims = [0, *range(2, x.dim())]
        shape = [1, x.size(1)] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(reduce_dims), x.new_full((1,), x.numel() // x.size(1))])
        total = _AllReduceSum.apply(local, self.process_group)
        count = total[-1]
        mean = total[:-1] / count
        centred = x - mean.view(shape)
        var = _AllReduceSum.apply((centred * centred).sum(reduce_dims), self.process_group) / count
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.float().view(shape)
        if self.bias is not None:
            out = out + self.bias.float().view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                n = float(count)
                unbiased = var.detach() * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup, device_type: str) -> nn.Module:
    """Replace every BatchNorm of ``module`` by one synchronised over ``process_group``.

    Returns ``module`` (or the new layer if ``module`` itself is a BatchNorm). Parameters and
    buffers are moved over, not copied, so optimizers and hooks keep pointing at them. Layers
    already synchronised are left as they are (converting twice is a no-op). Raises ``ValueError``
    when a BatchNorm to convert sits under ``fully_shard``: FSDP2 holds on to the module objects.
    """
    if any(isinstance(m, FSDPModule) for m in module.modules()) and any(
        isinstance(m, _BatchNorm) and not isinstance(m, (DataParallelBatchNorm, nn.SyncBatchNorm)) for m in module.modules()
    ):
        raise ValueError(
            "sync_batchnorm=True, but configure_model already applied fully_shard, and FSDP2 keeps the BatchNorm"
            " modules it wrapped, so they can no longer be replaced. Convert them in configure_model before"
            " fully_shard: `lightning_para.parallel.data.convert_sync_batchnorm(self,"
            " self.device_mesh['data_parallel'].get_group(), self.device.type)`."
        )
    if device_type in _TORCH_SYNC_BN_DEVICES:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert(module, process_group)


def _convert(module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (DataParallelBatchNorm, nn.SyncBatchNorm)):
        out = DataParallelBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, group,
            bias=module.affine and module.bias is not None, original_type=type(module),
        )
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, _convert(child, group))
    return out


__all__ = ["DataParallelBatchNorm", "convert_sync_batchnorm"]
