"""Tiny LitGPT models (``litgpt.Config(...)``, no download) in ordinary LightningModules.

The module is what a LitGPT user writes: ``self.model = GPT(config)``, a ``training_step`` with
next-token cross-entropy on the model's logits and, for pipeline parallelism, the one-line
``configure_pipeline()``. Weights are sharp (std 0.3, tests/sharpness.py): at LitGPT's 0.02
attention is nearly uniform and wrong heads or positions hide inside the tolerance.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from tests.hf_models import SHARP_LR, SHARP_RANGE, CausalLMModule

VOCAB = 128  # the data uses ids < 64 (tests/tp_models.TokenDataset)


def litgpt_config(**overrides):
    from litgpt import Config

    kwargs = dict(
        name="tiny-llama", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
        block_size=32, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=96, norm_class_name="RMSNorm",
        rotary_percentage=1.0, parallel_residual=False,
    )
    kwargs.update(overrides)
    return Config(**kwargs)


def sharpen(model: torch.nn.Module, std: float = SHARP_RANGE) -> None:
    """Normal(0, std) weights for every Linear/Embedding (seeded by the caller); norms stay ones."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)


class LitGPTModule(CausalLMModule):
    """An ordinary LightningModule around ``litgpt.model.GPT`` (the "after" of docs/litgpt.md)."""

    integration = "litgpt"

    def __init__(self, config=None, lr: float = SHARP_LR) -> None:
        from litgpt.model import GPT

        model = GPT(config if config is not None else litgpt_config())
        sharpen(model)
        super().__init__(model, lr)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gqa():
    return LitGPTModule(litgpt_config())


def mha():
    return LitGPTModule(litgpt_config(n_query_groups=4))


def moe():
    return LitGPTModule(litgpt_config(
        mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=48, n_embd=32,
    ))


def moe_biased():
    """``moe`` with auxiliary-loss-free balancing (a rate far above DeepSeek-V3's, so the routing moves in 5 steps)."""
    from lightning_para.parallel.expert import balance_experts

    module = moe()
    balance_experts(module, 0.05)
    return module


class LitGPTFromFolder(LitGPTModule):
    """A LitGPT checkpoint folder loaded in ``__init__`` (``load_checkpoint``), as a fine-tuning user would;
    ``export_on_start``: export the model, as the strategy laid it out, before the first step."""

    def __init__(self, folder: str, export_on_start: str = "") -> None:
        L.LightningModule.__init__(self)
        from lightning_para.integrations.litgpt import load_checkpoint

        self.model = load_checkpoint(folder)
        self.lr = SHARP_LR
        self.export_on_start = export_on_start

    def on_train_start(self) -> None:
        if self.export_on_start:
            from lightning_para.integrations.litgpt import export

            export(self, self.export_on_start)


def write_litgpt_folder(folder: str, config=None, seed: int = 0) -> None:
    """A LitGPT checkpoint folder as litgpt writes one (``lit_model.pth`` + ``model_config.yaml``), sharp weights."""
    from dataclasses import asdict
    from pathlib import Path

    import yaml
    from litgpt.model import GPT

    torch.manual_seed(seed)
    model = GPT(config if config is not None else litgpt_config())
    sharpen(model)
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(folder) / "lit_model.pth")
    with open(Path(folder) / "model_config.yaml", "w", encoding="utf-8") as f:
        yaml.dump(asdict(model.config), f)


def neox():
    """Pythia / GPT-NeoX shape: parallel residual, LayerNorm, biases, GELU MLP, rotary on a quarter of each head."""
    return LitGPTModule(litgpt_config(
        n_query_groups=4, bias=True, parallel_residual=True, shared_attention_norm=False, mlp_class_name="GptNeoxMLP",
        norm_class_name="LayerNorm", rotary_percentage=0.25, intermediate_size=128,
    ))
