"""Small LightningModules the library has never seen, and their data.

They are ordinary Lightning code (no lightning-para imports), so every parity test shows a
user's module training unchanged under ``ParaStrategy``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class RegressionNet(L.LightningModule):
    """An MLP with LayerNorm, AdamW over two param groups and a warmup/decay LR schedule."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 16, depth: int = 2, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(d_in, d_hidden), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.LayerNorm(d_hidden), nn.Linear(d_hidden, d_hidden), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5) * 0.97**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SGDRegressionNet(RegressionNet):
    """The same network with SGD + momentum and a StepLR schedule (a second optimizer family)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)]


def regression_dataset(n: int = 640, d_in: int = 32, d_out: int = 16, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return TensorDataset(x, y)

