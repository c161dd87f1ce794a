"""Fine-tune a Hugging Face ``transformers`` causal LM with any layout: :class:`HFCausalLM`.

An ordinary LightningModule around ``AutoModelForCausalLM``: a tiny random-config model built
from ``model_type`` + ``config`` (no download), or a local ``pretrained`` folder. Its loss is the
model's own (labels in the transformers convention, shifted inside; plus the router auxiliary
loss for MoE models with ``output_router_logits``). Everything parallel comes from
``ParaStrategy``: the automatic tensor-parallel plan, expert parallelism for transformers MoE
blocks, and for ``pp > 1`` the one-line ``configure_pipeline()`` of
:func:`lightning_para.integrations.transformers.pipeline_spec`.

Batches of :class:`~lightning_para.recipes.TextDataModule` are ``(x, y)`` next-token windows;
the transformers convention wants ``labels == input_ids`` (the model shifts them), so a window
gives ``input_ids = labels = x`` (``seq_len - 1`` predictions per window). Dict batches with
``input_ids`` (and ``labels``) are used as they are. Windows with document masks, ``(x, y, document_ids,
position_ids)`` (``TokenDataModule(document_mask=True, reset_positions=True)``), pass ``position_ids`` that
restart at each document: transformers' packed sequences, whose mask keeps attention inside each document.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

from lightning_para.checkpoint.pretrained import PretrainedWeights, stored_tensors
from lightning_para.integrations.transformers.pipeline import (
    pipeline_spec,
    split_causal_lm_batch,
)
from lightning_para.integrations.transformers.weights import (
    empty_causal_lm,
    load_config,
    pretrained_weights,
)
from lightning_para.parallel.expert import balance_experts
from lightning_para.recipes.data import check_positions, check_vocab
from lightning_para.recipes.optim import adamw_warmup_cosine


def causal_lm_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` in the transformers convention from a TextDataModule window ``(x, y)``
    (``labels = x``), or from a dict / ``input_ids`` batch (see ``split_causal_lm_batch``)."""
    if isinstance(batch, (tuple, list)) and 2 <= len(batch) <= 4 and not isinstance(batch, Mapping):
        return batch[0], batch[0]
    return split_causal_lm_batch(batch)


def packed_positions(batch: Any) -> Optional[Tensor]:
    """The ``position_ids`` of a window with document masks ``(x, y, document_ids, position_ids)``; ``None``
    for a batch without documents. ``ValueError`` naming the option for document ids without positions."""
    if not isinstance(batch, (tuple, list)) or len(batch) <= 2:
        return None
    if len(batch) == 3:
        raise ValueError(
            "HFCausalLM takes document masks as transformers' packed sequences: position ids that restart at each"
            " document. Set `data.reset_positions=True` (with `data.document_mask=True`)."
        )
    return batch[3]


def _pipeline_batch(batch: Any) -> tuple[Tensor, Tensor]:
    if packed_positions(batch) is not None:  # the pipeline layers build their mask from the sequence alone
        raise ValueError(
            "HFCausalLM under pp > 1 does not take document masks: its pipeline stages build the causal mask and"
            " positions from the sequence alone. Set `data.document_mask=False`, or pp=1 (tp, cp, ZeRO take them)."
        )
    return causal_lm_batch(batch)


class HFCausalLM(L.LightningModule):
    """A transformers causal LM as a LightningModule.

    Args:
        model_type: a transformers model type (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``,
            ``"mixtral"``, ...); with ``config``, a randomly initialised model (no download).
        config: fields of that model type's config (``hidden_size``, ``num_hidden_layers``, ...).
        pretrained: a local folder written by ``save_pretrained`` (or ``lightning_para.integrations.
            transformers.export``) to start from instead; ``model_type``/``config`` are then ignored.
        sharded_load: read ``pretrained`` sharded: the model is built with its parameters on the meta
            device and ``ParaStrategy`` reads each rank's slices of the safetensors after parallelizing
            (a rank holds its shard, never the whole model). ``None`` (default): sharded when the module is
            built inside ``trainer.init_module(empty_init=True)``, else ``from_pretrained`` in every process.
        lr, weight_decay, betas: AdamW (no decay on norms and biases).
        warmup_steps, min_lr_ratio: linear warmup, then cosine decay to ``lr * min_lr_ratio``.
        bias_update_rate: auxiliary-loss-free balancing of an MoE model's routers (DeepSeek-V3: 0.001; 0: off),
            beside or instead of its router loss (``lightning_para.parallel.expert.balance_experts``).
    """

    # TokenDataModule(document_mask=True) checks that the model takes the document ids it adds to batches.
    accepts_documents = True

    def __init__(
        self,
        model_type: str = "llama",
        config: Optional[dict[str, Any]] = None,
        pretrained: Optional[str] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        sharded_load: Optional[bool] = None,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # optional: transformers is needed only by this recipe
        from transformers import AutoConfig, AutoModelForCausalLM

        self._pretrained_weights: Optional[PretrainedWeights] = None
        if pretrained is not None:
            if sharded_load is None:
                sharded_load = torch.empty(0).is_meta  # inside init_module(empty_init=True)'s meta context
            if sharded_load:
                self.model = empty_causal_lm(pretrained)
                self._pretrained_weights = pretrained_weights(pretrained, prefix="model.")
            else:
                load_config(pretrained)  # a clear error for a folder without config.json
                folder = Path(pretrained).expanduser()
                if not any(folder.glob("*.bin")):  # ... without weights, or with a missing or truncated shard
                    stored_tensors(folder)
                self.model = AutoModelForCausalLM.from_pretrained(pretrained)
        else:
            try:
                hf_config = AutoConfig.for_model(model_type, **(config or {}))
            except ValueError as err:
                raise ValueError(f"`model.model_type={model_type!r}`: {err}") from None
            self.model = AutoModelForCausalLM.from_config(hf_config)
        if bias_update_rate:
            balance_experts(self.model, bias_update_rate)
        # Counted now, on the whole model: after a pipeline split a rank holds only its stages.
        self.flops_params = self._active_params()

    def pretrained_weights(self) -> Optional[PretrainedWeights]:
        """The weights ``ParaStrategy`` reads sharded after parallelizing (None once they are in place)."""
        if self._pretrained_weights is not None and not any(p.is_meta for p in self.model.parameters()):
            self._pretrained_weights = None
        return self._pretrained_weights

    def on_fit_start(self) -> None:
        if any(p.is_meta for p in self.model.parameters()):
            raise ValueError(
                "HFCausalLM(pretrained=..., sharded_load=True) is loaded by ParaStrategy after it parallelized the"
                " model; this trainer's strategy left the weights on the meta device. Train it with"
                " `strategy=ParaStrategy(...)`, or set `sharded_load=False`."
            )

    @property
    def config(self) -> Any:
        """The transformers config (its ``vocab_size`` is checked against the data's tokenizer)."""
        return self.model.config

    def setup(self, stage: str) -> None:
        # private: see docs/architecture.md
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        check_vocab(self.config.vocab_size, datamodule)
        check_positions(getattr(self.config, "max_position_embeddings", None), datamodule)

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def _loss(self, batch: Any) -> tuple[Tensor, Optional[Tensor]]:
        input_ids, labels = causal_lm_batch(batch)
        # No KV cache in training; without one transformers reads restarting positions as packed documents.
        out = self.model(input_ids=input_ids, labels=labels, position_ids=packed_positions(batch), use_cache=False)
        return out.loss, getattr(out, "aux_loss", None)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, aux = self._loss(batch)
        # sync_dist: the global batch's loss on every rank (the name the pipeline runner logs under pp > 1).
        # For an MoE model it is what transformers returns: LM loss + router_aux_loss_coef * aux.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        if isinstance(aux, Tensor):
            self.log("train_aux_loss", aux.detach(), sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_pipeline(self):
        return pipeline_spec(self.model, split_batch=_pipeline_batch)

    def _active_params(self) -> int:
        """Parameters a token uses: all, with only ``top_k / num_experts`` of the routed experts."""
        config = self.config
        params = sum(p.numel() for p in self.model.parameters())
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if experts and top_k:
            expert_params = sum(p.numel() for n, p in self.model.named_parameters() if ".experts." in n)
            params -= expert_params - expert_params * top_k // experts
        return params

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token, 6 N (Kaplan et al. 2020) with N the parameters a token uses."""
        return 6.0 * self.flops_params

    def configure_optimizers(self) -> Any:
        # no decay on biases and norms
        return adamw_warmup_cosine(self, lambda n, p: p.dim() >= 2)


__all__ = ["HFCausalLM", "causal_lm_batch", "packed_positions"]
