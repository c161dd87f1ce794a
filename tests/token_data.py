"""Test corpora and a BPE tokenizer trained at test time (``tokenizers``; nothing downloaded)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"


def stdlib_documents(count: int, max_chars: int = 6000) -> list[str]:
    """``count`` real text documents: the first ``max_chars`` of standard-library modules, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)[:count]
    return [f.read_text(encoding="utf-8", errors="replace")[:max_chars] for f in files]


def train_bpe(folder: Path, texts: list[str], vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (EOS included) saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(f'{{"eos_token": "{EOS}"}}')
    return folder


def text_folder(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"doc{i:03d}.txt").write_text(text)
    return folder
