"""``grad_norm``: Lightning's gradient-norm utility, for gradients that are DTensors.

``lightning.pytorch.utilities.grad_norm`` computes each ``p.grad.norm()`` and then
``torch.tensor(list_of_norms)``. A DTensor (ZeRO-1/2's and ZeRO-3's sharded gradients, tensor
parallel gradients, and the same under Lightning's own ``ModelParallelStrategy`` with FSDP2)
has no storage of its own, so that ``torch.tensor`` call fails; and the norm of a shard taken
as a plain number would be one rank's part only. This function returns the same dictionary
(same keys, plain 0-dim tensors) with the norms of the *global* gradients, on every rank.

It only reads ``p.grad``, so it works wherever ``p.grad`` holds the gradient: plain tensors
(ZeRO-0, DDP) cost nothing extra; DTensors cost one small all-reduce per distinct layout
(mesh and placements), in parameter order, so call it on every rank, like Lightning's.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, as if the model were on one device.

    A drop-in for ``lightning.pytorch.utilities.grad_norm`` (same arguments, same keys:
    ``grad_{p}_norm{sep}{name}`` and ``grad_{p}_norm_total``) that also accepts DTensor
    gradients. Collective when gradients are DTensors: call it on every rank.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    norms: dict[str, Tensor] = {}
    # DTensor norms come back as partial results over their mesh; stacking those of one layout
    # and materializing once is one all-reduce per layout instead of one per parameter.
    groups: dict[tuple, list[tuple[str, Tensor]]] = {}
    for name, grad in named:
        if isinstance(grad, DTensor):
            groups.setdefault((grad.device_mesh, tuple(grad.placements)), []).append((name, grad.norm(norm_type)))
        else:
            norms[name] = grad.detach().norm(norm_type)
    for members in groups.values():
        stacked = torch.stack([n for _, n in members]).full_tensor()
        for (name, _), value in zip(members, stacked.unbind(0)):
            norms[name] = value
    ordered = {f"grad_{norm_type}_norm{group_separator}{name}": norms[name] for name, _ in named}
    if ordered:
        ordered[f"grad_{norm_type}_norm_total"] = torch.stack([v.float().cpu() for v in ordered.values()]).norm(norm_type)
    return ordered


__all__ = ["grad_norm"]
