"""The recipes' optimizer: AdamW with decoupled weight decay (or Muon for the hidden matrices, AdamW for the rest),
linear warm-up, cosine decay."""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning as L
import torch
from torch import Tensor

from lightning_para.optim import Muon, split_param_groups


def adamw_warmup_cosine(module: L.LightningModule, decays: Callable[[str, Tensor], bool]) -> dict[str, Any]:
    """``configure_optimizers()`` of the recipes: AdamW (``hparams.lr``, ``betas``, ``weight_decay`` on the
    parameters ``decays(name, param)`` selects, none on the rest), its rate warmed up linearly over
    ``hparams.warmup_steps`` steps, then decayed on a cosine to ``hparams.min_lr_ratio * lr`` at the
    last step (``trainer.max_steps``, else Lightning's estimate), stepped every optimizer step.
    ``hparams.optimizer == "muon"``: :class:`lightning_para.optim.Muon` at ``hparams.muon_lr`` for the hidden
    matrices (its own split), AdamW as above for the rest."""
    hparams = module.hparams
    decay = [p for n, p in module.named_parameters() if decays(n, p)]
    decay_ids = {id(p) for p in decay}
    no_decay = [p for p in module.parameters() if id(p) not in decay_ids]
    groups = [{"params": decay, "weight_decay": hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if hparams.get("optimizer", "adamw") == "muon":
        muon = {id(p) for p in split_param_groups(module)[0]["params"]}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in muon], "use_muon": False} for g in groups]
        optimizer = Muon([{"params": [p for p in module.parameters() if id(p) in muon], "use_muon": True}] + groups,
                         lr=hparams.muon_lr, weight_decay=hparams.weight_decay, adamw_lr=hparams.lr,
                         adamw_betas=tuple(hparams.betas))
    else:
        optimizer = torch.optim.AdamW(groups, lr=hparams.lr, betas=tuple(hparams.betas))
    trainer = module.trainer
    total = trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
    warmup, floor = hparams.warmup_steps, hparams.min_lr_ratio

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


__all__ = ["adamw_warmup_cosine"]
