"""Train a LitGPT model (``litgpt.model.GPT``) with any layout: :class:`LitGPTCausalLM`.

An ordinary LightningModule around LitGPT's ``GPT``: built from ``config`` fields (``litgpt.Config(**config)``,
no download), from a named LitGPT config (``name``, e.g. ``"pythia-14m"``; weights random), or from a
local LitGPT checkpoint folder (``checkpoint_dir``: ``lit_model.pth`` + ``model_config.yaml``). Its loss is
next-token cross-entropy on ``(x, y)`` windows whose targets are already shifted -- the convention of
:class:`~lightning_para.recipes.TextDataModule` and of ``litgpt pretrain`` -- or ``(x, y, document_ids[,
position_ids])`` windows with document masks (``forward_with_documents``; not under pp). Everything parallel comes from
``ParaStrategy`` and the LitGPT integration (:mod:`lightning_para.integrations.litgpt`): the tensor-parallel
plan with the grouped-query ``qkv`` blocks, context and expert parallelism, and for ``pp > 1`` the one-line
``configure_pipeline()``. Export the trained model with ``lightning_para.integrations.litgpt.export``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch.nn.functional as F
from torch import Tensor

from lightning_para.integrations.litgpt.checkpoint import load_checkpoint
from lightning_para.integrations.litgpt.documents import forward_with_documents
from lightning_para.integrations.litgpt.pipeline import pipeline_spec, split_batch
from lightning_para.recipes.data import check_vocab
from lightning_para.recipes.optim import adamw_warmup_cosine


class LitGPTCausalLM(L.LightningModule):
    """A LitGPT ``GPT`` as a LightningModule.

    Args:
        config: fields of ``litgpt.Config`` (``n_layer``, ``n_embd``, ``n_head``, ``n_query_groups``,
            ``vocab_size``, ``mlp_class_name``, ...): a randomly initialised model.
        name: a LitGPT config name (``litgpt.Config.from_name(name, **config)``) instead.
        checkpoint_dir: a LitGPT checkpoint folder to start from; ``config``/``name`` are then ignored.
        init_std: the std of the normal init of Linear/Embedding weights for a random model (LitGPT's 0.02).
        lr, weight_decay, betas, warmup_steps, min_lr_ratio: AdamW, linear warmup, cosine decay.
    """

    # TokenDataModule(document_mask=True) checks that the model takes the document ids it adds to batches.
    accepts_documents = True

    def __init__(
        self,
        config: Optional[dict[str, Any]] = None,
        name: Optional[str] = None,
        checkpoint_dir: Optional[str] = None,
        init_std: float = 0.02,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # optional: litgpt is needed only by this recipe
        from litgpt import Config
        from litgpt.model import GPT

        if checkpoint_dir is not None:
            self.model = load_checkpoint(checkpoint_dir)
        else:
            self.model = GPT(Config.from_name(name, **(config or {})) if name else Config(**(config or {})))
            for module in self.model.modules():  # LitGPT's own init (GPT._init_weights) with init_std
                if hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 2:
                    module.weight.data.normal_(0.0, init_std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.data.zero_()
        self.flops_params = sum(p.numel() for p in self.model.parameters())

    @property
    def config(self) -> Any:
        """The LitGPT config (its ``padded_vocab_size`` is checked against the data's tokenizer)."""
        return self.model.config

    def setup(self, stage: str) -> None:
        # private: see docs/architecture.md
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        check_vocab(self.config.padded_vocab_size, datamodule)

    def forward(self, input_ids: Tensor, document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Tensor:
        if document_ids is None:
            return self.model(input_ids)
        return forward_with_documents(self.model, input_ids, document_ids, position_ids)

    def _loss(self, batch: Any) -> Tensor:
        documents: list = []
        if isinstance(batch, (tuple, list)) and len(batch) in (3, 4):  # (x, y, document_ids[, position_ids])
            batch, documents = batch[:2], list(batch[2:])
        x, y = split_batch(batch)
        logits = self(x, *documents)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # sync_dist: the global batch's loss on every rank (the name the pipeline runner logs under pp > 1).
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_pipeline(self):
        return pipeline_spec(self.model)

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token, 6 N (Kaplan et al. 2020)."""
        return 6.0 * self.flops_params

    def configure_optimizers(self) -> Any:
        # no decay on biases and norms
        return adamw_warmup_cosine(self, lambda n, p: p.dim() >= 2)


__all__ = ["LitGPTCausalLM"]
