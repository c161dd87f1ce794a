"""A model the library has not seen, written against the pipeline contract (tests only)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lightning_para

VOCAB, DIM, SEQ = 48, 32, 8


class ResidualMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def tensor_parallel_plan(self) -> dict[str, str]:  # read under tp > 1 only
        return {"up": "colwise", "down": "rowwise"}


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))

    def tensor_parallel_plan(self) -> dict[str, str]:  # read under tp > 1 only
        return {"proj": "lm_head"}


class TinyTokenModel(L.LightningModule):
    """Next-token prediction: embedding, residual MLP blocks, norm + head; AdamW + LR schedule."""

    def __init__(self, depth: int = 4, lr: float = 3e-3, init_std: float = 0.3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ResidualMLP(DIM) for _ in range(depth))
        self.head = Head(DIM, VOCAB)
        # Sharp (tests/sharpness.py): with PyTorch's default init (std ~0.1 for these Linears) the
        # next-token distribution is ~uniform, so labels paired with the wrong microbatch barely move the loss.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, init_std)
        self.example_input_array = torch.zeros(4, SEQ, dtype=torch.long)  # for pipeline_balance="time"

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = self.loss(self(tokens), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = self.loss(self(tokens), targets)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    # --- the pipeline contract: three lines ---
    def configure_pipeline(self) -> lightning_para.PipelineSpec:
        return lightning_para.PipelineSpec(
            layers=[self.embed, *self.blocks, self.head], split_batch=lambda b: (b[0], b[1]), loss_fn=self.loss
        )

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def token_dataset(n: int = 512, seed: int = 7) -> TensorDataset:
    """Sequences with a learnable rule (next token = (3 * token + 1) mod V, with noise)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = [first]
    for _ in range(SEQ):
        nxt = (3 * steps[-1] + 1) % VOCAB
        noise = torch.randint(0, VOCAB, nxt.shape, generator=g)
        steps.append(torch.where(torch.rand(nxt.shape, generator=g) < 0.2, noise, nxt))
    seq = torch.cat(steps, dim=1)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
