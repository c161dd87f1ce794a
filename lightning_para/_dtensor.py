"""The one home of small tensor helpers every dimension needs.

* the local view of a DTensor, and a full plain tensor from one;
* plain values out of a Lightning step's output;
* placements that shard (``Shard`` and torch's ``_StridedShard``);
* which modules own each parameter (tied parameters), walked once;
* ``scale_grad``: identity forward, scaled gradient (expert weights under expert parallelism).

Nothing here imports another module of the package, so every module may import it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # private: see docs/architecture.md
from torch.distributed.tensor.placement_types import Placement, _StridedShard  # private: see docs/architecture.md


def local_tensor(t: Tensor, *, allow_partial: bool = False) -> Tensor:
    """This rank's values of a plain tensor or DTensor, sharing its storage.

    For reading and writing a *reduced* gradient or a parameter's data in place: a ``Partial``
    DTensor (a gradient not yet summed over its mesh) raises instead of silently giving one
    rank's addend, unless ``allow_partial`` (e.g. to count the bytes it holds).
    """
    if not isinstance(t, DTensor):
        return t
    if not allow_partial and any(p.is_partial() for p in t.placements):
        raise RuntimeError(
            "A gradient is still a Partial DTensor when it is read; it must be reduced over its mesh first."
            f" Placements: {t.placements}."
        )
    with torch.no_grad():  # a view of the same storage, without an autograd node
        return t.to_local()


def full_tensor(t: Tensor) -> Tensor:
    """A plain tensor with the global values (a DTensor is gathered; a plain tensor is returned as is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def plain_step_output(output: Any, gather: bool = False) -> Any:
    """What a Lightning step returns, with DTensors made plain: scalar DTensors (a loss under
    tensor parallelism) always, every DTensor when ``gather`` (``predict_step`` outputs)."""
    if isinstance(output, DTensor):
        return output.full_tensor() if gather or output.dim() == 0 else output
    if isinstance(output, dict):
        return {k: plain_step_output(v, gather) for k, v in output.items()}
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return type(output)(plain_step_output(v, gather) for v in output)
    return output


def is_sharded_placement(placement: Any) -> bool:
    """``Shard`` or ``_StridedShard`` (whose ``is_shard()`` answers False)."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


class DTensorViews:
    """DTensors of one fixed global description over local tensors, made at the cost of a constructor.

    ``DTensor.from_local`` is an autograd op that builds its spec on every call (tens to hundreds of
    microseconds); what is shown once per parameter and step (ZeRO's ``.grad`` shards) needs neither, so the
    spec is built once per dtype and the DTensor constructed directly. ``local`` must be this rank's piece of
    that description; nothing checks it (as ``from_local(run_check=False)``).
    """

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.mesh, self.placements, self.shape, self.stride = mesh, tuple(placements), torch.Size(shape), tuple(stride)
        self._specs: dict[torch.dtype, DTensorSpec] = {}

    def __call__(self, local: Tensor) -> DTensor:
        spec = self._specs.get(local.dtype)
        if spec is None:
            spec = self._specs[local.dtype] = DTensorSpec(
                self.mesh, self.placements, tensor_meta=TensorMeta(self.shape, self.stride, local.dtype))
        return DTensor(local.view_as(local), spec, requires_grad=False)  # private constructor: see docs/architecture.md


def is_strided(param: Tensor) -> bool:
    """A DTensor with a ``_StridedShard`` placement (a fused q|k|v or gate|up projection under TP)."""
    return isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements)


def parameter_owners(root: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """For each parameter (by ``id``), every ``(module name, attribute name)`` that holds it directly.

    One walk with ``remove_duplicate=False``, so a module reachable under two names and a
    parameter tied between two modules show up once per name.
    """
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, module in root.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((fqn, name))
    return owners


def tied_parameter_groups(root: nn.Module) -> list[list[tuple[str, str]]]:
    """``(module name, attribute name)`` of every parameter held by more than one module (tied weights).

    One module reachable under two names (a user's wrapper, a ``ModuleList`` of references)
    is one holder, listed under its first name: that is not tying.
    """
    groups = []
    for owners in parameter_owners(root).values():
        holders: dict[tuple[int, str], tuple[str, str]] = {}
        for fqn, name in owners:
            holders.setdefault((id(root.get_submodule(fqn)), name), (fqn, name))
        if len(holders) > 1:
            groups.append(list(holders.values()))
    return groups


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """``x`` in forward; its gradient times ``scale`` in backward (expert weights under expert parallelism)."""
    return _ScaleGrad.apply(x, scale)


__all__ = [
    "DTensorViews",
    "full_tensor",
    "is_sharded_placement",
    "is_strided",
    "local_tensor",
    "parameter_owners",
    "plain_step_output",
    "scale_grad",
    "tied_parameter_groups",
]
