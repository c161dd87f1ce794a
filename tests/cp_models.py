"""Models for the context-parallel "any model" tests (issue 24): ordinary LightningModules with no cp hook.

* :class:`PlainHFLlama`: a tiny ``LlamaForCausalLM`` (GQA, SDPA, RoPE; ``initializer_range=0.3``,
  so wrong positions change the loss well beyond the parity tolerance) whose ``training_step`` is
  what a user writes: ``self.model(input_ids=x).logits`` and ``F.cross_entropy``. No position ids,
  no mask, no hook.
* :class:`PaddedHFLlama`: the same with right-padded sequences: a 2-D ``attention_mask`` with
  zeros and ``-100`` labels on the padding.
* :class:`OwnLossHFLlama`: the same model with its own loss (``labels=input_ids``: transformers
  shifts them inside the sequence it sees).
* :class:`LearnedPositionsLM`: learned absolute positions indexed by ``arange(x.shape[1])``, SDPA
  attention, no hook: the strategy cannot supply its positions, so cp must refuse it.
* :class:`ShiftedPositionsHFLlama`: a planted bug, a ``context_parallel_batch`` hook whose global
  positions are off by one.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from tests.tp_models import TokenDataset

VOCAB = 64
SEQ = 16


def llama(vocab: int = VOCAB, init: float = 0.3):
    # optional: transformers is needed by these models only
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa", initializer_range=init,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class PlainHFLlama(L.LightningModule):
    """``(x, y)`` next-token batches; the loss a user writes; no cp hook."""

    def __init__(self, vocab: int = VOCAB, init: float = 0.3, lr: float = 0.1, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = llama(vocab, init)
        self.lr = lr
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # SGD by default: parameters after training then compare within 1e-5 (Adam's m / sqrt(v) turns fp32
        # reordering of a near-zero gradient into an O(lr) change of that one weight).
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ShiftedPositionsHFLlama(PlainHFLlama):
    """A planted bug: under cp the hook hands the model positions off by one in each rank's second (tail)
    chunk. (Shifting *every* position by one would be invisible: RoPE only sees position differences.)"""

    def context_parallel_batch(self, batch, shard):
        x, y = batch
        positions = shard.position_ids(x.shape[1], batch_size=x.shape[0], device=x.device).clone()
        positions[:, positions.shape[1] // 2 :] += 1
        return shard.split(x), shard.split(y), positions

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, *positions = batch
        logits = self.model(input_ids=x, position_ids=positions[0] if positions else None).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss)
        return loss


class PaddedTokens(Dataset):
    """``{"input_ids", "attention_mask", "labels"}``: the token sequences right-padded at random lengths
    (at least half of each sequence is real), ``-100`` labels on the padding."""

    def __init__(self) -> None:
        self.tokens = TokenDataset()
        g = torch.Generator().manual_seed(5)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (len(self.tokens),), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        x, y = self.tokens[i]
        real = torch.arange(SEQ) < self.lengths[i]
        return {
            "input_ids": x.masked_fill(~real, 0),
            "attention_mask": real.long(),
            "labels": y.masked_fill(~real, -100),
        }


def padded_tokens() -> PaddedTokens:
    return PaddedTokens()


class PaddedHFLlama(PlainHFLlama):
    """Dict batches with a padding ``attention_mask`` and ``-100`` labels."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        self.log("train_loss", loss)
        return loss


class OwnLossTokens(Dataset):
    """``{"input_ids", "labels"}`` with ``labels == input_ids`` (transformers shifts them), a fifth ``-100``."""

    def __init__(self) -> None:
        self.tokens = TokenDataset()
        g = torch.Generator().manual_seed(3)
        self.ignored = torch.rand(len(self.tokens), SEQ, generator=g) < 0.2

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        x, _ = self.tokens[i]
        return {"input_ids": x, "labels": x.masked_fill(self.ignored[i], -100)}


def own_loss_tokens() -> OwnLossTokens:
    return OwnLossTokens()


class OwnLossHFLlama(PlainHFLlama):
    """The model's own loss: ``labels`` in the transformers convention (shifted inside the model)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss


class LearnedPositionsLM(L.LightningModule):
    """Token + learned absolute position embeddings (``arange(x.shape[1])``), one causal SDPA layer, a head.

    It has no ``set_context_parallel`` and no ``context_parallel_batch``: under cp each rank would
    number its chunks from 0."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, block: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape
        h = self.tok(x) + self.pos(torch.arange(s, device=x.device))
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return self.head(h + self.out(a))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)
