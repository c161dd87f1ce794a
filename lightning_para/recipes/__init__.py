"""Ready-to-train recipes shipped with the package: ``lightning_para.recipes.GPT``, ``MoEGPT``,
``HFCausalLM`` (a transformers causal LM), ``LitGPTCausalLM`` (a LitGPT model), ``TextDataModule`` and ``TokenDataModule`` (tokenized corpora), and their LightningCLI configs
(``configs/*.yaml``, also linked from the repository's ``recipes/``), found by short name with
:func:`config_path`."""

from pathlib import Path

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".data": ("ByteTokenizer", "TextDataModule", "check_vocab"),
    ".gpt": ("GPT", "GPTConfig"),
    ".hf": ("HFCausalLM",),
    ".litgpt": ("LitGPTCausalLM",),
    ".moe": ("MoEGPT",),
    ".tokens": ("TokenDataModule",),
})
__all__ += ["CONFIG_DIR", "config_names", "config_path"]

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


