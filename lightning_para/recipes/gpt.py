"""A nanoGPT-class decoder as a LightningModule, ready for every lightning-para dimension.

One readable file: :class:`GPTConfig` (named size presets), the blocks, and :class:`GPT`.

* Pre-norm blocks (RMSNorm or LayerNorm), RoPE or learned positions, SwiGLU or GELU MLP,
  ``F.scaled_dot_product_attention``, optional weight tying.
* Separate ``q``/``k``/``v`` projections, so a column-wise split over ``tp`` keeps whole heads
  on each rank; attention reshapes with ``-1`` heads, so it runs unchanged with ``n_head / tp``
  local heads.
* Context parallel: :class:`Embedding` and :class:`CausalSelfAttention` take their global token
  positions from the strategy (``set_context_parallel``), since a cp rank holds non-contiguous
  chunks of each sequence and ``arange(local length)`` would be wrong.
* ``embed`` -> ``blocks`` -> ``head`` are separate modules that each map ``x -> x``: that is
  the pipeline contract (:meth:`GPT.configure_pipeline`). Each of them declares its own
  tensor-parallel plan (``tensor_parallel_plan()`` on :class:`Embedding`, :class:`Block`,
  :class:`Head`, relative to itself), so the plan applies unchanged to whichever layers a
  pipeline stage holds.

The default style is Llama-like (RMSNorm, RoPE, SwiGLU, no biases, untied); GPT-2 style is
``norm="layernorm", pos="learned", mlp="gelu", bias=True, tie_weights=True``.

Why this module is long: a recipe is one readable file per model (nanoGPT's shape), so a user
can copy it and change it in one place.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from lightning_para._dtensor import full_tensor
from lightning_para.parallel.context import ContextParallelShard
from lightning_para.parallel.pipeline.spec import PipelineSpec
from lightning_para.recipes.data import ByteTokenizer, check_positions, check_vocab
from lightning_para.recipes.optim import adamw_warmup_cosine

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
    tokens' global positions (context parallel); ``None`` means ``0..T-1``.
    """
    _, seq, _, dim = x.shape
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    if positions is None:
        positions = torch.arange(seq, device=x.device)
    angles = torch.outer(positions.to(device=x.device, dtype=torch.float32), inv_freq)  # (T, dim/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


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

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: the local count, which is n_head / tp once c_q/c_k/c_v are split column-wise.
        q = self.c_q(x).view(batch, seq, -1, self.head_dim)
        k = self.c_k(x).view(batch, seq, -1, self.head_dim)
        v = self.c_v(x).view(batch, seq, -1, self.head_dim)
        if self.rope_theta is not None:
            shard = self.context_shard
            positions = shard.local_positions(seq, x.device) if shard is not None else None
            q, k = apply_rope(q, self.rope_theta, positions), apply_rope(k, self.rope_theta, positions)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            **({"enable_gqa": True} if k.shape[2] != q.shape[2] else {}),  # GQA: each k/v head serves n_head/n_kv_head
        )
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

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

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

    def forward(self, idx: Tensor) -> Tensor:
        shard = self.context_shard
        seq = idx.shape[1] * (shard.cp if shard is not None else 1)
        if seq > self.block_size:
            raise ValueError(f"A sequence of {seq} tokens is longer than the model's block_size={self.block_size}.")
        x = self.wte(idx)
        if self.wpe is not None:
            positions = shard.local_positions(idx.shape[1], idx.device) if shard is not None else None
            x = x + self.wpe(positions if positions is not None else torch.arange(seq, device=idx.device))
        return self.dropout(x)

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

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Logits split by vocabulary and left sharded for the vocab-parallel loss."""
        return {"ln_f": "norm", "lm_head": "lm_head"}


# ---------------------------------------------------------------------- the LightningModule
class GPT(L.LightningModule):
    """A decoder-only language model trained with next-token cross-entropy.

    Args:
        preset: a named size from :data:`PRESETS` (``"tiny"``, ``"gpt-125m"``, ``"gpt-350m"``,
            ``"gpt-1.3b"``, ``"gpt-7b"``); the fields below, when given, override it.
        init_std: the weights' init std (GPT-2's 0.02 by default). Parity checks use 0.3: at
            0.02 a tiny model attends almost uniformly, so a wrong position or mask barely
            moves the loss (docs/planner.md, "What makes a parity check able to fail").
        lr, weight_decay, betas: AdamW (no decay on norms, biases and embeddings).
        warmup_steps, min_lr_ratio: linear warmup, then cosine decay to ``lr * min_lr_ratio``
            at ``trainer.max_steps``.
        prompt, sample_tokens, temperature: after each validation, generate ``sample_tokens``
            tokens from ``prompt`` and log the text to TensorBoard (0 switches it off).
        loss_fp32: cast the logits to fp32 before the cross-entropy (torchtitan's and transformers' loss;
            under ``bf16-true`` the softmax is then computed in fp32). Costs fp32 log-probabilities, priced by
            the planner as ``ModelDesc.loss_upcast``.
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: Optional[int] = None,
        block_size: Optional[int] = None,
        n_layer: Optional[int] = None,
        n_head: Optional[int] = None,
        n_embd: Optional[int] = None,
        n_kv_head: Optional[int] = None,
        mlp_hidden: Optional[int] = None,
        norm: Optional[str] = None,
        pos: Optional[str] = None,
        mlp: Optional[str] = None,
        bias: Optional[bool] = None,
        tie_weights: Optional[bool] = None,
        dropout: Optional[float] = None,
        init_std: Optional[float] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        prompt: str = "def ",
        sample_tokens: int = 48,
        temperature: float = 0.8,
        loss_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig.from_preset(
            preset, vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            n_kv_head=n_kv_head, mlp_hidden=mlp_hidden, norm=norm, pos=pos, mlp=mlp, bias=bias, tie_weights=tie_weights,
            dropout=dropout, init_std=init_std,
        )
        self.loss_fp32 = loss_fp32
        self.build()
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()
        self._eval_metric: Optional[str] = None  # name of the metric loss_fn feeds, while evaluating
        self.last_sample: Optional[str] = None

    # -------------------------------------------------------------- model
    def make_mlp(self, layer_index: int) -> Optional[nn.Module]:
        """The block's feed-forward module; ``None`` means the dense :class:`MLP` (MoE overrides this)."""
        return None

    def build(self) -> None:
        config = self.config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, i, self.make_mlp(i)) for i in range(config.n_layer))
        self.head = Head(config)
        self.init_weights()
        if config.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight
        # Counted now, on the whole model: after a pipeline split a rank holds only its stages.
        self.flops_params = self.num_params(matmul_only=True, active=True)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer) (Radford et al. 2019)."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, 0.0, std * scale)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy (works on vocab-sharded DTensor logits under loss parallel).

        During validation/test it also feeds the perplexity metric. It is the pipeline's
        ``loss_fn`` too, so under ``pp > 1`` the metric is updated on the last stage, the only
        place the logits exist.
        """
        loss = F.cross_entropy((logits.float() if self.loss_fp32 else logits).flatten(0, 1), targets.flatten(0, 1))
        # Under the vocab-parallel loss this is a replicated DTensor; a plain tensor (no
        # communication, the gradient flows back as a DTensor) is what Lightning and the
        # pipeline schedule start backward from.
        loss = full_tensor(loss)
        if self._eval_metric is not None and not torch.is_grad_enabled():
            getattr(self, self._eval_metric).update(full_tensor(logits).detach().float(), targets)
        return loss

    @staticmethod
    def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
        inputs, targets = batch
        return inputs, targets

    # -------------------------------------------------------------- parallel declarations
    def configure_pipeline(self):
        """The pipeline contract: embedding, each block, then final norm + head, in order."""
        if self.config.tie_weights:
            raise ValueError(
                "`tie_weights=True` shares the embedding with the output head, which pipeline parallelism puts on"
                " different stages. Set `tie_weights=False` (model.tie_weights) to use pp > 1."
            )
        return PipelineSpec(layers=[self.embed, *self.blocks, self.head], split_batch=self.split_batch, loss_fn=self.loss_fn)

    # -------------------------------------------------------------- accounting
    def num_params(self, matmul_only: bool = False, active: bool = False) -> int:
        """All parameters, or (``matmul_only``) those that take part in a matmul per token:
        without the embedding lookups (but with a tied output head). ``active`` matters for
        mixture-of-experts subclasses (experts a token does not use are not counted)."""
        params = {id(p): p for p in self.parameters()}
        if matmul_only:
            params.pop(id(self.embed.wte.weight), None)
            if self.embed.wpe is not None:
                params.pop(id(self.embed.wpe.weight), None)
            if self.config.tie_weights:
                params[id(self.head.lm_head.weight)] = self.head.lm_head.weight
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token: 6 N + 12 L d T (PaLM, Chowdhery et al. 2022, App. B), with N
        the matmul parameters a token uses (counted when the model was built)."""
        seq_len = seq_len or self.config.block_size
        return 6 * self.flops_params + 12 * self.config.n_layer * self.config.n_embd * seq_len

    # -------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str) -> None:
        # private: see docs/architecture.md
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        check_vocab(self.config.vocab_size, datamodule)
        check_positions(self.config.block_size, datamodule)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = self.split_batch(batch)
        loss = self.loss_fn(self(inputs), targets)
        # The same name and meaning the pipeline runner logs under pp > 1, so every layout shows one curve:
        # sync_dist averages the dp ranks' batch means (one scalar all-reduce): the global batch's loss.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _eval_step(self, batch: Any, prefix: str) -> Tensor:
        inputs, targets = self.split_batch(batch)
        loss = self.loss_fn(self(inputs), targets)
        self.log(f"{prefix}_loss", loss, sync_dist=True, prog_bar=prefix == "val")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        """Next-token logits ``(B, T, vocab)`` (what the pipeline returns under pp > 1 too)."""
        inputs, _ = self.split_batch(batch)
        return full_tensor(self(inputs))

    def on_validation_epoch_start(self) -> None:
        self._eval_metric = "val_ppl"

    def on_test_epoch_start(self) -> None:
        self._eval_metric = "test_ppl"

    def _log_perplexity(self, name: str) -> None:
        self._eval_metric = None
        metric = getattr(self, name)
        with warnings.catch_warnings():
            # Under pp > 1 only last-stage ranks update; compute() still sums every rank's state.
            warnings.filterwarnings("ignore", message=".*compute.*before the.*update.*")
            value = metric.compute()  # all-gathers the metric state over every rank
        metric.reset()
        self.log(name, value, sync_dist=True)  # already global; the mean of equal values keeps it

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test_ppl")

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val_ppl")
        if self.hparams.sample_tokens <= 0 or self.trainer.sanity_checking:
            return
        self.last_sample = text = self.generate_text(self.hparams.prompt, self.hparams.sample_tokens)
        if self.trainer.is_global_zero:
            experiment = getattr(self.logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("samples/text", f"```\n{text}\n```", self.global_step)
            self.print(f"\n[sample @ step {self.global_step}] {text!r}")

    def configure_optimizers(self) -> Any:
        # no decay on embeddings, biases and norms
        return adamw_warmup_cosine(self, lambda n, p: p.dim() >= 2 and "wte" not in n and "wpe" not in n)

    # -------------------------------------------------------------- generation
    def _next_token_logits(self, context: Tensor, length: int) -> Tensor:
        """Logits after ``context[:, :length]`` through whatever layout the model runs in.

        ``context`` has a fixed shape (right-padded): causal attention makes the padding
        invisible to earlier positions, and one shape means one pipeline schedule. Without a
        trainer the module runs directly; with one, through ``strategy.predict_step``, which is
        the pipeline schedule under pp > 1 (every stage takes part) and the module's own
        ``predict_step`` otherwise (under ZeRO-3 / TP every rank runs the same forward).
        """
        strategy = self._trainer.strategy if self._trainer is not None else None  # private: see docs/architecture.md
        if strategy is None:
            return self(context)[:, length - 1]
        # ParaStrategy's public degrees (either front end); any other strategy runs the module whole.
        dims = strategy.parallel_dims if hasattr(type(strategy), "parallel_dims") else None
        copies = 1
        if dims is not None and dims.pp > 1:
            copies = strategy.pipeline_stats().microbatches  # each microbatch needs one sample
        batch = context.expand(copies, -1).contiguous()
        logits = full_tensor(strategy.predict_step((batch, batch), 0))
        return logits[:1, length - 1]

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 0.8, seed: int = 0) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (1, T). Call it on every rank.

        Collective-safe under every layout: all ranks run the same forwards; each token is
        sampled from a seeded generator on full logits and broadcast from rank 0, so every
        rank feeds identical input to the next step.
        """
        generator = torch.Generator(device="cpu").manual_seed(seed)
        window = self.config.block_size
        tokens = idx[0].tolist()
        for _ in range(max_new_tokens):
            context_tokens = tokens[-window:]
            context = torch.zeros(1, window, dtype=torch.long, device=idx.device)
            context[0, : len(context_tokens)] = torch.tensor(context_tokens, device=idx.device)
            logits = self._next_token_logits(context, len(context_tokens)).float().cpu()
            if temperature <= 0:
                next_token = logits.argmax(-1)
            else:
                next_token = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
            tokens.append(int(broadcast_from_rank0(next_token.to(idx.device))[0]))
        return torch.tensor([tokens], dtype=torch.long, device=idx.device)

    def generate_text(self, prompt: str, max_new_tokens: int) -> str:
        # private: see docs/architecture.md
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None) if self._trainer else None
        tokenizer = tokenizer or ByteTokenizer()
        ids = torch.tensor([tokenizer.encode(prompt) or [ord("\n")]], dtype=torch.long, device=self.device)
        was_training = self.training
        self.eval()
        try:
            out = self.generate(ids, max_new_tokens, temperature=self.hparams.temperature)
        finally:
            self.train(was_training)
        return tokenizer.decode(out[0].tolist())


def broadcast_from_rank0(t: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return t

