"""A nanoGPT-class decoder as a LightningModule, ready for every lightning-para dimension.

Two readable files: the configuration and blocks (:class:`GPTConfig` with named size presets, attention, MLP,
block, embedding, head) in ``gpt_layers.py``, and :class:`GPT`, the LightningModule, here. The blocks are
importable from here too.

* Pre-norm blocks (RMSNorm or LayerNorm), RoPE or learned positions, SwiGLU or GELU MLP,
  ``F.scaled_dot_product_attention``, optional weight tying.
* Separate ``q``/``k``/``v`` projections, so a column-wise split over ``tp`` keeps whole heads
  on each rank; attention reshapes with ``-1`` heads, so it runs unchanged with ``n_head / tp``
  local heads.
* Context parallel: :class:`Embedding` and :class:`CausalSelfAttention` take their global token
  positions from the strategy (``set_context_parallel``), since a cp rank holds non-contiguous
  chunks of each sequence and ``arange(local length)`` would be wrong.
* Document masks: batches ``(x, y, document_ids[, position_ids])`` (``TokenDataModule(document_mask=True)``)
  keep attention inside each packed document (``document_attention``) and take positions that restart per
  document; the ids travel with the hidden states from layer to layer (a tuple), so with each microbatch.
* ``embed`` -> ``blocks`` -> ``head`` are separate modules that each map ``x -> x``: that is
  the pipeline contract (:meth:`GPT.configure_pipeline`). Each of them declares its own
  tensor-parallel plan (``tensor_parallel_plan()`` on :class:`Embedding`, :class:`Block`,
  :class:`Head`, relative to itself), so the plan applies unchanged to whichever layers a
  pipeline stage holds.

The default style is Llama-like (RMSNorm, RoPE, SwiGLU, no biases, untied); GPT-2 style is
``norm="layernorm", pos="learned", mlp="gelu", bias=True, tie_weights=True``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from lightning_para._dtensor import full_tensor
from lightning_para.parallel.pipeline.spec import PipelineSpec
from lightning_para.recipes.data import ByteTokenizer, check_positions, check_vocab
from lightning_para.recipes.gpt_layers import (
    MLPS,
    NORMS,
    POSITIONS,
    PRESETS,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    apply_rope,
    make_norm,
)
from lightning_para.recipes.optim import adamw_warmup_cosine

class GPT(L.LightningModule):
    """A decoder-only language model trained with next-token cross-entropy.

    Args:
        preset: a named size from :data:`PRESETS` (``"tiny"``, ``"gpt-125m"``, ``"gpt-350m"``,
            ``"gpt-1.3b"``, ``"gpt-7b"``); the fields below, when given, override it.
        init_std: the weights' init std (GPT-2's 0.02 by default). Parity checks use 0.3: at
            0.02 a tiny model attends almost uniformly, so a wrong position or mask barely
            moves the loss (docs/planner.md, "What makes a parity check able to fail").
        lr, weight_decay, betas: AdamW (no decay on norms, biases and embeddings).
        optimizer, muon_lr: ``"muon"``: :class:`lightning_para.optim.Muon` at ``muon_lr`` for the hidden
            matrices, AdamW at ``lr`` for embeddings, head, norms and biases (``docs/optimizers.md``).
        warmup_steps, min_lr_ratio: linear warmup, then cosine decay to ``lr * min_lr_ratio``
            at ``trainer.max_steps``.
        prompt, sample_tokens, temperature: after each validation, generate ``sample_tokens``
            tokens from ``prompt`` and log the text to TensorBoard (0 switches it off).
        loss_fp32: cast the logits to fp32 before the cross-entropy (torchtitan's and transformers' loss;
            under ``bf16-true`` the softmax is then computed in fp32). Costs fp32 log-probabilities, priced by
            the planner as ``ModelDesc.loss_upcast``.
    """

    # TokenDataModule(document_mask=True) checks that the model takes the document ids it adds to batches.
    accepts_documents = True

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
        optimizer: str = "adamw",
        muon_lr: float = 0.02,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        prompt: str = "def ",
        sample_tokens: int = 48,
        temperature: float = 0.8,
        loss_fp32: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"`optimizer={optimizer!r}`: choose 'adamw' or 'muon'.")
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

    def forward(self, idx: Tensor, document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Tensor:
        """Logits of ``idx`` (B, T); ``document_ids`` (B, T) keep attention inside each packed document,
        ``position_ids`` (B, T) are positions restarting per document."""
        x = self.embed(idx, document_ids, position_ids)
        for block in self.blocks:
            x = block(*x) if isinstance(x, tuple) else block(x)
        return self.head(*x) if isinstance(x, tuple) else self.head(x)

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
    def split_batch(batch: Any) -> tuple[Any, Tensor]:
        """``(x, y)`` -> ``(x, y)``; ``(x, y, document_ids[, position_ids])`` -> ``((x, document_ids[, ...]), y)``."""
        inputs, targets, *documents = batch
        return ((inputs, *documents) if documents else inputs), targets

    def _logits(self, inputs: Any) -> Tensor:
        return self(*inputs) if isinstance(inputs, tuple) else self(inputs)

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
        loss = self.loss_fn(self._logits(inputs), targets)
        # The same name and meaning the pipeline runner logs under pp > 1, so every layout shows one curve:
        # sync_dist averages the dp ranks' batch means (one scalar all-reduce): the global batch's loss.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _eval_step(self, batch: Any, prefix: str) -> Tensor:
        inputs, targets = self.split_batch(batch)
        loss = self.loss_fn(self._logits(inputs), targets)
        self.log(f"{prefix}_loss", loss, sync_dist=True, prog_bar=prefix == "val")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        """Next-token logits ``(B, T, vocab)`` (what the pipeline returns under pp > 1 too)."""
        inputs, _ = self.split_batch(batch)
        return full_tensor(self._logits(inputs))

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


# The blocks are part of this recipe's public surface (users and the MoE recipe import them from here).
__all__ = [
    "GPT", "MLPS", "NORMS", "POSITIONS", "PRESETS", "Block", "CausalSelfAttention", "Embedding", "GPTConfig", "Head", "MLP",
    "apply_rope", "broadcast_from_rank0", "make_norm",
]
