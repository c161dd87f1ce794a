"""Tiny random-config transformers causal LMs wrapped in ordinary LightningModules (no download).

The modules are what a user writes: ``self.model = AutoModelForCausalLM.from_config(cfg)``, a
``training_step`` that returns the model's own loss, and for pipeline parallelism the one-line
``configure_pipeline()``. Batches follow the transformers convention: ``(input_ids, labels)`` with
``labels == input_ids`` (the model shifts them).
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import Dataset

from tests.tp_models import TokenDataset, make_optimizer

VOCAB = 128  # the data uses ids < 64; 128 keeps the head (64 -> 128) distinct from the width
# Parity models are sharp (tests/sharpness.py): at transformers' default 0.02 attention is ~uniform and
# wrong positions under cp moved the step-0 loss by 8.7e-6, inside the 1e-5 tolerance (issue 24).
SHARP_RANGE = 0.3
# Sharp weights make SGD at lr 0.2 chaotic: a 1e-7 relative perturbation of the initial weights (the size
# of a reordered fp32 sum) grew to 3.8e-4 in the loss after 10 steps (1.3e-5 at lr 0.05, 1.8e-6 at 0.02;
# measured with tests/sharpness.py `perturbation_growth` on `llama`). Parallel layouts reorder sums every
# step, so at lr 0.2 the 1e-5 parity tolerance was only met by blunt weights; 0.02 keeps a 5x margin.
SHARP_LR = 0.02


def llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=SHARP_RANGE,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def mixtral_config(**overrides):
    from transformers import MixtralConfig

    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=SHARP_RANGE, output_router_logits=True, router_aux_loss_coef=0.02, attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


class CausalLMModule(L.LightningModule):
    """An ordinary LightningModule around a causal LM ``self.model`` of one integration (``transformers`` or
    ``litgpt``: whose ``pipeline_spec`` splits it); subclasses build the model and compute the loss."""

    integration = "transformers"

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def loss(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_pipeline(self):
        import importlib

        return importlib.import_module(f"lightning_para.integrations.{self.integration}").pipeline_spec(self.model)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), "sgd", self.lr)


class HFCausalLM(CausalLMModule):
    """An ordinary LightningModule around a transformers causal LM (the "after" of docs/transformers.md)."""

    def __init__(self, config=None, lr: float = SHARP_LR) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(AutoModelForCausalLM.from_config(config if config is not None else llama_config()), lr)

    def loss(self, batch) -> torch.Tensor:
        input_ids, labels = batch
        return self.model(input_ids=input_ids, labels=labels).loss


def llama():
    return HFCausalLM(llama_config())


def mixtral():
    return HFCausalLM(mixtral_config())


def mixtral_biased():
    """``mixtral`` with the auxiliary-loss-free selection bias beside its router loss (a rate far above DeepSeek-V3's
    0.001, so that the routing moves within the test's steps)."""
    from lightning_para.parallel.expert import balance_experts

    module = mixtral()
    balance_experts(module, 0.05)
    return module


def mixtral_without_router_loss():
    return HFCausalLM(mixtral_config(output_router_logits=False))


class HFTokens(Dataset):
    """The periodic token data of :mod:`tests.tp_models` as ``(input_ids, labels = input_ids)``."""

    def __init__(self, seq: int = 16) -> None:
        self.tokens = TokenDataset(seq=seq).x

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.tokens[i]


def hf_tokens() -> HFTokens:
    return HFTokens()


def hf_tokens_odd() -> HFTokens:
    return HFTokens(seq=15)


# ----------------------------------------------------------------------------- a user's own pipeline wrappers
class _Embed(torch.nn.Module):
    def __init__(self, embed: torch.nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, input_ids):
        return self.embed(input_ids)


class _Layer(torch.nn.Module):
    """What users wrote before `pipeline_spec`: each decoder layer computes its positions, rotary table and mask."""

    def __init__(self, layer: torch.nn.Module, model: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = [model.model.rotary_emb]  # a plain list: not a second registration
        self.config = model.config

    def forward(self, hidden):
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        return self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                          position_embeddings=self.rotary[0](hidden, position_ids))


class _NormHead(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module, head: torch.nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden):
        return self.head(self.norm(hidden))


class LlamaUserPipeline(HFCausalLM):
    """The failing case of issue 13: wrappers registered before the model, so the head is reachable as
    `_pp_layers.3.head` (first) and `model.lm_head`, and every module's first name is under a ModuleList."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(llama_config())
        base = model.model
        self._pp_layers = torch.nn.ModuleList(
            [_Embed(base.embed_tokens), *[_Layer(layer, model) for layer in base.layers], _NormHead(base.norm, model.lm_head)]
        )
        self.model = model
        self.lr = SHARP_LR

    def configure_pipeline(self):
        from lightning_para import PipelineSpec

        vocab = self.model.config.vocab_size
        return PipelineSpec(
            layers=list(self._pp_layers),
            split_batch=lambda batch: (batch[0], batch[1]),
            loss_fn=lambda logits, labels: self.model.loss_function(logits=logits, labels=labels, vocab_size=vocab),
        )


class GPT2Module(HFCausalLM):
    """An architecture pipeline_spec does not know (GPT-2: transformer.h, wte/wpe, no rotary_emb)."""

    def __init__(self) -> None:
        from transformers import GPT2Config

        # No dropout: its masks differ between one process and several, so parity could not hold.
        super().__init__(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                    initializer_range=SHARP_RANGE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
