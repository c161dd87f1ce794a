"""Ready-to-train recipes shipped with the package: ``lightning_para.recipes.GPT``, ``MoEGPT``,
``HFCausalLM`` (a transformers causal LM), ``LitGPTCausalLM`` (a LitGPT model), ``TextDataModule`` and ``TokenDataModule`` (tokenized corpora), and their LightningCLI configs
(``configs/*.yaml``, also linked from the repository's ``recipes/``), found by short name with
:func:`config_path`."""

from pathlib import Path

from lightning_para.recipes.data import ByteTokenizer, TextDataModule, check_vocab
from lightning_para.recipes.gpt import GPT, GPTConfig
from lightning_para.recipes.hf import HFCausalLM
from lightning_para.recipes.litgpt import LitGPTCausalLM
from lightning_para.recipes.moe import MoEGPT
from lightning_para.recipes.tokens import TokenDataModule

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def config_names() -> list[str]:
    """The short names of the shipped configs (``gpt-cpu-demo``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The shipped config called ``name`` (with or without ``.yaml``); ``ValueError`` lists the names."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = CONFIG_DIR / f"{stem}.yaml"
    if not path.is_file():
        raise ValueError(f"No shipped config named {name!r}. Choose one of {', '.join(config_names())}, or give a path.")
    return path


__all__ = ["ByteTokenizer", "CONFIG_DIR", "GPT", "GPTConfig", "HFCausalLM", "LitGPTCausalLM", "MoEGPT", "TextDataModule", "TokenDataModule", "check_vocab", "config_names", "config_path"]
