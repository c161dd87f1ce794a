"""The losses of a pipeline step, shared over the pipeline ranks.

Only the last stage computes the loss; the MoE aux losses live in every stage that has MoE layers
(``lightning_para.moe``). One all-reduce over the pipeline group gives every rank the loss (the others add an
exact 0.0), so logging and ``ModelCheckpoint(monitor=...)`` see the same value on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_para._dtensor import full_tensor
from lightning_para.moe import aux_loss, moe_layers


def mean_loss(losses: list[Tensor], device: torch.device) -> Tensor:
    """The mean of the microbatches' losses in fp32 (0 on a rank without the last stage)."""
    if not losses:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([full_tensor(loss).float() for loss in losses]).mean()


def stages_aux_loss(stage_modules: list[nn.Module], device: torch.device) -> Optional[Tensor]:
    """This rank's MoE aux-loss values (each layer's mean over the microbatches), if its stages have MoE layers:
    the schedule's loss function sees only the last stage, the aux losses live in every stage."""
    if not any(True for stage in stage_modules for _ in moe_layers(stage)):
        return None
    return sum(aux_loss(stage).to(device=device, dtype=torch.float32) for stage in stage_modules)


def share_from_last(loss: Tensor, *, has_last: bool, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """The last stage's loss on every pipeline rank (the others add an exact 0.0)."""
    loss = loss.detach().to(device=device, dtype=torch.float32).clone()
    if not has_last:
        loss.zero_()
    dist.all_reduce(loss, group=group)
    return loss


def share_train_losses(
    loss: Tensor, aux: Optional[Tensor], *, has_last: bool, group: dist.ProcessGroup, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """In one all-reduce over pp: the last stage's loss, the sum of every stage's MoE aux losses, and how many
    ranks have MoE layers (a device tensor: the caller reads it once, the layout being fixed)."""
    values = torch.zeros(3, dtype=torch.float32, device=device)
    if has_last:
        values[0] = loss.detach().float()
    if aux is not None:
        values[1] = aux.detach().float()
        values[2] = 1.0
    dist.all_reduce(values, group=group)
    return values[0], values[1], values[2]


__all__ = ["mean_loss", "share_from_last", "share_train_losses", "stages_aux_loss"]
