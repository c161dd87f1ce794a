"""A small recurrent LightningModule like Lightning's ``ParityModuleRNN`` (our own code): an
``nn.LSTM`` over a sequence and a Linear head per time step, trained with Adam on MSE."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

SEQ, FEATURES, HIDDEN, OUT = 8, 10, 20, 5


def sequence_dataset(n: int = 64, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, FEATURES, generator=g)
    y = torch.tanh(x.cumsum(1)[..., :OUT] / 2)  # depends on the whole prefix: the recurrence matters
    return TensorDataset(x, y)


class RNNModule(L.LightningModule):
    def __init__(self, cell: str = "lstm", lr: float = 0.02) -> None:
        super().__init__()
        kind = {"lstm": nn.LSTM, "rnn": nn.RNN, "gru": nn.GRU}[cell]
        self.rnn = kind(FEATURES, HIDDEN, batch_first=True)
        self.linear_out = nn.Linear(HIDDEN, OUT)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, _ = self.rnn(x)
        return self.linear_out(seq)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)
