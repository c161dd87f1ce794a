"""Small GPT-style LightningModules for the tensor-parallel tests, and their data.

Ordinary Lightning code with common names and no lightning-para imports:

* :class:`NanoGPT` -- nanoGPT names (``transformer.wte/wpe/h/ln_f``, ``attn.c_attn`` fused qkv,
  ``c_proj``, ``mlp.c_fc``), learned position embeddings, LayerNorm with bias, explicit
  softmax attention, weights tied between ``wte`` and ``lm_head``.
* :class:`LlamaLike` -- Hugging Face names (``model.embed_tokens``, ``layers.*.self_attn.q_proj``
  ... ``o_proj``, ``mlp.gate_proj/up_proj/down_proj``, RMSNorm), grouped-query attention,
  sublayers called with keyword arguments, untied head.

Attention reshapes with its own head-count attributes and ``-1``, which tensor parallelism
needs (each rank holds ``n_head / tp`` heads; see docs/tensor_parallel.md).
"""

from __future__ import annotations

import functools
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# Parity models are sharp (tests/sharpness.py): at std 0.05 attention is ~uniform and a wrong
# position, mask or head order moves the loss by less than the 1e-5 tolerance.
SHARP_STD = 0.3
# Sharp weights make SGD at the old lr 0.3 chaotic: a 1e-7 relative perturbation of the initial weights (a
# reordered fp32 sum) moved NanoGPT's parameters by 2.5e-5 after 10 unclipped steps and LlamaLike's loss by
# 9.4e-4; at lr 0.01, 2.0e-7 and 3.6e-7 (tests.sharpness.perturbation_param_drift / perturbation_growth).
SHARP_LR = 0.01


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum for parity runs; AdamW where optimizer state matters (checkpoints).

    Parity against one device uses SGD: AdamW divides each update by the gradient's own
    magnitude, so in elements whose gradient is nearly zero (dead GELU units, rare tokens)
    it turns fp32 summation-order differences (~1e-9) into update differences of ~lr*1e-2.
    With SGD the parallel and single-device parameters agree to ~1e-7.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        # No bias: the key bias has an analytically zero gradient (softmax ignores q.b_k), which
        # AdamW would turn into noise-driven updates that no two summation orders share.
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(L.LightningModule):
    def __init__(self, vocab_size: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, dropout: float = 0.0, lr: float = SHARP_LR, optimizer: str = "sgd",
                 init_std: float = SHARP_STD) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(functools.partial(self._init_weights, std=init_std))
        # LayerNorm weights away from 1 so that their gradients matter in the parity checks.
        for name, p in self.named_parameters():
            if "ln_" in name:
                nn.init.normal_(p, mean=1.0 if name.endswith("weight") else 0.0, std=0.1)

    @staticmethod
    def _init_weights(module: nn.Module, std: float = SHARP_STD) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.normal_(module.bias, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.lr)


# ----------------------------------------------------------------------------- HF-like
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_key_value_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None) -> tuple[torch.Tensor, None]:
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), None


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv: int, intermediate: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden_size, num_heads, num_kv)
        self.mlp = LlamaMLP(hidden_size, intermediate)
        self.input_layernorm = RMSNorm(hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=None)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv: int, intermediate: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([LlamaDecoderLayer(hidden, heads, kv, intermediate) for _ in range(layers)])
        self.norm = RMSNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class LlamaLike(L.LightningModule):
    def __init__(self, vocab_size: int = 64, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 num_key_value_heads: int = 2, intermediate_size: int = 96, lr: float = SHARP_LR, optimizer: str = "sgd",
                 init_std: float = SHARP_STD) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LlamaModel(vocab_size, hidden_size, num_layers, num_heads, num_key_value_heads, intermediate_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        for name, p in self.named_parameters():
            nn.init.normal_(p, mean=1.0 if "layernorm" in name or name.endswith("norm.weight") else 0.0, std=init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self(input_ids)
        loss = nn.CrossEntropyLoss()(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.lr)


# ----------------------------------------------------------------------------- data
class TokenDataset(Dataset):
    """Next-token prediction on a noisy periodic sequence (learnable in a few steps)."""

    def __init__(self, n: int = 40, seq: int = 16, vocab: int = 64, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        tokens = (start + step * torch.arange(seq + 1)) % vocab
        noise = torch.rand(n, seq + 1, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, vocab, (n, seq + 1), generator=g), tokens)
        self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def token_dataset() -> TokenDataset:
    """40 sequences of 16 tokens: 5 steps per epoch at a global batch of 8."""
    return TokenDataset()


def odd_length_dataset() -> TokenDataset:
    return TokenDataset(seq=15)


class TinyMoE(nn.Module):
    """A soft mixture of two expert MLPs with a router: found as an MoE layer by its class name."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.router = nn.Linear(n_embd, 2)
        self.experts = nn.ModuleList([MLP(n_embd) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(self.router(x), dim=-1)
        return sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class NanoGPTWithMoE(NanoGPT):
    """The second block's MLP is an MoE layer (kept whole on every tp rank: 'gather_sequence')."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h[1].mlp = TinyMoE(64)
        self.transformer.h[1].mlp.apply(self._init_weights)


# ----------------------------------------------------------------------------- bad input
class BlockWithGate(Block):
    """A block with one more Linear (h -> h) that no automatic rule can classify."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__(n_embd, n_head, block_size, dropout)
        self.gate = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(self.gate(x))


class NanoGPTWithGate(NanoGPT):
    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList([BlockWithGate(64, 4, 16) for _ in range(2)])


class NanoGPTThreeHeads(NanoGPT):
    def __init__(self) -> None:
        super().__init__(n_head=3, n_embd=48)
