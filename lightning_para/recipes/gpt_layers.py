"""The GPT recipe's configuration and building blocks (:class:`~lightning_para.recipes.gpt.GPT` assembles them).

Each block maps ``x -> x`` and declares its own tensor-parallel plan relative to itself (the pipeline contract
and the tp plan of :mod:`lightning_para.recipes.gpt`); attention reshapes with ``-1`` heads so it runs with
``n_head / tp`` local heads, and takes its global positions from the strategy under context parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_para.parallel.context import ContextParallelShard
from lightning_para.parallel.context.documents import document_attention

NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
MLPS = ("swiglu", "gelu")


@dataclass
class GPTConfig:
    """Shape and style of the decoder. ``vocab_size`` defaults to the byte tokenizer's 256."""

    vocab_size: int = 256
    block_size: int = 64  # the longest context (learned positions have this many rows)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: Optional[int] = None  # grouped-query attention (Ainslie et al. 2023): key/value heads; None: n_head
    mlp_hidden: Optional[int] = None  # default: 4*d (GELU) or 8d/3 rounded up to 64 (SwiGLU)
    norm: str = "rmsnorm"
    pos: str = "rope"
    mlp: str = "swiglu"
    bias: bool = False
    tie_weights: bool = False
    dropout: float = 0.0
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}={value!r}` must be a positive integer.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"`n_embd={self.n_embd}` must be divisible by `n_head={self.n_head}` (head_dim = n_embd / n_head)."
            )
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if isinstance(self.n_kv_head, bool) or not isinstance(self.n_kv_head, int) or self.n_kv_head < 1 \
                or self.n_head % self.n_kv_head:
            raise ValueError(f"`n_kv_head={self.n_kv_head!r}` must be a positive divisor of `n_head={self.n_head}`.")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of channels: head_dim={self.head_dim} must be even.")
        for name, value, choices in (("norm", self.norm, NORMS), ("pos", self.pos, POSITIONS), ("mlp", self.mlp, MLPS)):
            if value not in choices:
                raise ValueError(f"`{name}={value!r}` is unknown. Choose one of {', '.join(map(repr, choices))}.")
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.n_embd if self.mlp == "gelu" else 64 * math.ceil(8 * self.n_embd / 3 / 64)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout={self.dropout!r}` must be in [0, 1).")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A named size with some fields replaced (``None`` values are ignored)."""
        if name not in PRESETS:
            raise ValueError(f"`preset={name!r}` is unknown. Choose one of {', '.join(map(repr, PRESETS))}.")
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"Unknown GPTConfig fields {sorted(unknown)}; valid fields: {sorted(known)}.")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "mlp" in overrides and "mlp_hidden" not in overrides:
            overrides["mlp_hidden"] = None  # recompute the default width for the new MLP kind
        if "n_head" in overrides and "n_kv_head" not in overrides:
            overrides["n_kv_head"] = None  # multi-head attention with the new head count (the default)
        return replace(PRESETS[name], **overrides)


# Shapes of well-known models (layers, heads, width). With the 256-byte vocabulary the
# embeddings are tiny, so counts are a little below the names (which include a 50k vocab).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),  # CPU demos and tests
    "gpt-125m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small / GPT-3 Small
    "gpt-350m": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),  # GPT-3 Medium
    "gpt-1.3b": GPTConfig(block_size=2048, n_layer=24, n_head=16, n_embd=2048),  # GPT-3 XL
    "gpt-7b": GPTConfig(block_size=4096, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008),  # Llama-7B
}


# ---------------------------------------------------------------------- layers
def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


def apply_rope(x: Tensor, theta: float, positions: Optional[Tensor] = None) -> Tensor:
    """Rotary position embedding (Su et al. 2021) on ``x`` of shape (B, T, heads, head_dim).

    Computed from the positions each call (no buffers), in fp32, so it is the same on every
    pipeline stage and unaffected by casting the model to bf16. ``positions`` (T,) are the
    tokens' global positions (context parallel), or (B, T) each sequence's (positions that restart
    at each packed document); ``None`` means ``0..T-1``.
    """
    _, seq, _, dim = x.shape
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    if positions is None:
        positions = torch.arange(seq, device=x.device)
    positions = positions.to(device=x.device, dtype=torch.float32)
    if positions.dim() == 1:  # the ops the planner counts per layer (plan/overhead.py)
        angles = torch.outer(positions, inv_freq)  # (T, dim/2)
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    else:
        angles = positions[..., None] * inv_freq  # (B, T, dim/2)
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


def stream(x: Tensor, document_ids: Optional[Tensor], position_ids: Optional[Tensor]) -> Any:
    """What a layer passes on: the hidden states, with the batch's document ids (and positions) when it has
    them, as a tuple (the next pipeline layer's arguments: they travel with each microbatch)."""
    if document_ids is None:
        if position_ids is not None:
            raise ValueError("`position_ids` that restart at each document need the `document_ids` they restart at.")
        return x
    return (x, document_ids) if position_ids is None else (x, document_ids, position_ids)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.n_head = config.n_head  # global head count; a tp rank computes n_head / tp of them
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta if config.pos == "rope" else None
        self.dropout = config.dropout
        d, kv = config.n_embd, config.n_kv_head * config.head_dim
        self.c_q = nn.Linear(d, d, bias=config.bias)
        self.c_k = nn.Linear(d, kv, bias=config.bias)
        self.c_v = nn.Linear(d, kv, bias=config.bias)
        self.c_proj = nn.Linear(d, d, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.context_shard: Optional[ContextParallelShard] = None  # set under context parallel

    def set_context_parallel(self, shard: ContextParallelShard) -> None:
        """Context parallel: this rank holds chunks ``shard`` of each sequence (RoPE needs their positions)."""
        self.context_shard = shard

    def forward(self, x: Tensor, document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Tensor:
        """``document_ids`` (B, T): attend only within each token's document; ``position_ids`` (B, T): RoPE's
        positions (restarting per document); both split like the tokens under context parallel."""
        batch, seq, _ = x.shape
        # -1 heads: the local count, which is n_head / tp once c_q/c_k/c_v are split column-wise.
        q = self.c_q(x).view(batch, seq, -1, self.head_dim)
        k = self.c_k(x).view(batch, seq, -1, self.head_dim)
        v = self.c_v(x).view(batch, seq, -1, self.head_dim)
        if self.rope_theta is not None:
            shard = self.context_shard
            positions = position_ids
            if positions is None and shard is not None:
                positions = shard.local_positions(seq, x.device)
            q, k = apply_rope(q, self.rope_theta, positions), apply_rope(k, self.rope_theta, positions)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        options = {"dropout_p": self.dropout if self.training else 0.0}
        if k.shape[1] != q.shape[1]:
            options["enable_gqa"] = True  # GQA: each k/v head serves n_head/n_kv_head
        if document_ids is not None:
            y = document_attention(q, k, v, document_ids, **options)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GELU: ``c_proj(gelu(c_fc(x)))``; SwiGLU (Shazeer 2020): ``c_proj(silu(c_gate(x)) * c_fc(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden = config.n_embd, config.mlp_hidden
        self.c_fc = nn.Linear(d, hidden, bias=config.bias)
        self.c_gate = nn.Linear(d, hidden, bias=config.bias) if config.mlp == "swiglu" else None
        self.c_proj = nn.Linear(hidden, d, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.c_gate is not None:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, layer_index: int = 0, mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_index)
        self.ln_2 = make_norm(config)
        self.mlp = mlp if mlp is not None else MLP(config)

    def forward(self, x: Tensor, document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Any:
        x = x + self.attn(self.ln_1(x), document_ids, position_ids)
        return stream(x + self.mlp(self.ln_2(x)), document_ids, position_ids)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron-style TP (Shoeybi et al. 2019), in the shorthands of docs/tensor_parallel.md.

        q/k/v and the MLP's input projections split column-wise (whole heads per rank), the
        output projections row-wise (one all-reduce per sublayer, a reduce-scatter under
        sequence parallel); ``attention``/``mlp`` mark the sublayers whose input is gathered
        once; norms run on sequence shards under sequence parallel. An MoE feed-forward runs
        whole on every tp rank (``gather_sequence``): expert parallelism splits its experts.
        """
        plan = {
            "ln_1": "norm",
            "attn": "attention",
            "attn.c_q": "colwise",
            "attn.c_k": "colwise",
            "attn.c_v": "colwise",
            "attn.c_proj": "rowwise",
            "ln_2": "norm",
        }
        if not isinstance(self.mlp, MLP):
            plan["mlp"] = "gather_sequence"
            return plan
        plan.update({"mlp": "mlp", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"})
        if self.mlp.c_gate is not None:
            plan["mlp.c_gate"] = "colwise"
        return plan


class Embedding(nn.Module):
    """Token embedding (+ learned positions), the first pipeline layer: ids (B, T) -> (B, T, d)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.dropout = nn.Dropout(config.dropout)
        self.context_shard: Optional[ContextParallelShard] = None  # set under context parallel

    def set_context_parallel(self, shard: ContextParallelShard) -> None:
        """Context parallel: ``idx`` holds chunks ``shard`` of each sequence (their positions are global)."""
        self.context_shard = shard

    def forward(self, idx: Tensor, document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Any:
        shard = self.context_shard
        seq = idx.shape[1] * (shard.cp if shard is not None else 1)
        if seq > self.block_size:
            raise ValueError(f"A sequence of {seq} tokens is longer than the model's block_size={self.block_size}.")
        x = self.wte(idx)
        if self.wpe is not None:
            positions = position_ids
            if positions is None:
                positions = shard.local_positions(idx.shape[1], idx.device) if shard is not None else None
            x = x + self.wpe(positions if positions is not None else torch.arange(seq, device=idx.device))
        return stream(self.dropout(x), document_ids, position_ids)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The vocabulary split over tp; learned positions follow the (sequence-sharded) stream."""
        plan = {"wte": "vocab_parallel"}
        if self.wpe is not None:
            plan["wpe"] = "sequence_slice"
        return plan


class Head(nn.Module):
    """Final norm and the vocabulary projection, the last pipeline layer: (B, T, d) -> logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor, *documents: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Logits split by vocabulary and left sharded for the vocab-parallel loss."""
        return {"ln_f": "norm", "lm_head": "lm_head"}


# ---------------------------------------------------------------------- the LightningModule


__all__ = [
    "MLPS", "NORMS", "POSITIONS", "PRESETS", "Block", "CausalSelfAttention", "Embedding", "GPTConfig", "Head", "MLP", "apply_rope",
    "make_norm", "stream",
]
