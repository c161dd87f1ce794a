"""Train from tokenized corpora: :class:`TokenDataModule`.

It reads a folder written by ``lightning-para prepare`` (token shards + ``meta.json``, see
:mod:`lightning_para.recipes.token_format`), or nanoGPT / llm.c ``.bin`` token files as they are. Every file
is memory-mapped: a rank touches only the pages of the windows it reads, whatever the corpus' size.

The corpus is one stream (documents already packed, each followed by the tokenizer's EOS id); training
sequences are its consecutive windows of ``seq_len + 1`` tokens (inputs and next-token targets), also
across file boundaries. Samples are sharded per *data-parallel* rank (``trainer.strategy.
distributed_sampler_kwargs``): the tp, pp and cp ranks of one dp slot read the same batch. The training
loader is a :class:`~lightning_para.reliability.ResumableDataLoader`, so a run resumes exactly mid-epoch,
also at another data-parallel degree.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_para.recipes.data import check_batch_shape, data_parallel_replicas
from lightning_para.recipes.token_format import META_FILE, TokenCorpus, open_corpus
from lightning_para.reliability.resumable_data import ResumableDataLoader


class TokenSequences(Dataset):
    """Windows ``[first + i * seq_len, ... + seq_len + 1)`` of a corpus' token stream as ``(x, y)`` pairs,
    for ``i`` in ``range(count)`` (the stream crosses file boundaries)."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, first: int = 0, count: Optional[int] = None) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.first = first
        total = max((corpus.tokens - 1) // seq_len, 0)
        self.count = total - first if count is None else count
        self._starts = np.cumsum([0] + [f.tokens for f in corpus.files])
        self._maps: Optional[list[np.ndarray]] = None  # opened lazily: DataLoader workers map their own

    def __len__(self) -> int:
        return self.count

    def _tokens(self, start: int, length: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [f.open() for f in self.corpus.files]
        parts = []
        while length > 0:
            index = bisect_right(self._starts, start) - 1
            offset = start - int(self._starts[index])
            piece = self._maps[index][offset : offset + length]
            parts.append(piece)
            start += len(piece)
            length -= len(piece)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        window = torch.from_numpy(self._tokens((self.first + index) * self.seq_len, self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]


class HFTokenizerText:
    """``encode``/``decode`` of the tokenizer a corpus was prepared with (for the recipes' text samples)."""

    def __init__(self, path: Path) -> None:
        # optional: tokenizers is needed only to show generated text
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class TokenDataModule(L.LightningDataModule):
    """Language-modelling batches from a tokenized corpus, sharded over the data-parallel ranks.

    Args:
        path: a folder written by ``lightning-para prepare``; or a nanoGPT (raw ``uint16``) / llm.c
            (``uint16`` after a 256 x int32 header, magic 20240520) ``.bin`` file, a folder of them, or a list.
        seq_len: tokens per training sequence (at most the model's positions).
        global_batch_size: sequences per optimizer micro-step over all data-parallel ranks (each dp rank
            loads ``global_batch_size // dp``).
        val_path: a separate validation corpus (same forms as ``path``); without it the last
            ``val_fraction`` of ``path``'s sequences are held out.
        val_fraction: the held-out tail when ``val_path`` is not given (0 switches validation off).
        vocab_size: the vocabulary of ``.bin`` files, which do not record it (GPT-2's: 50 257); a prepared
            folder records its own.
        shuffle, seed: the training order (a permutation seeded with ``seed + epoch``, the same for every layout).
        num_workers: DataLoader workers per rank.
    """

    def __init__(
        self,
        path: Union[str, list[str]],
        seq_len: int = 1024,
        global_batch_size: int = 8,
        val_path: Optional[Union[str, list[str]]] = None,
        val_fraction: float = 0.01,
        vocab_size: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_batch_shape(seq_len, global_batch_size)
        if not 0.0 <= val_fraction < 0.5:
            raise ValueError(f"`data.val_fraction={val_fraction!r}` must be in [0, 0.5).")
        self.path = path
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        # Opened here, in the launching process: a missing or truncated shard fails before any worker starts.
        self.corpus = open_corpus(path, vocab_size)
        self.val_corpus = open_corpus(val_path, vocab_size or self.corpus.vocab_size) if val_path is not None else None
        self.splits: dict[str, TokenSequences] = {}

    @property
    def vocab_size(self) -> Optional[int]:
        """The tokenizer's vocabulary (checked against the model's before training)."""
        return self.corpus.vocab_size

    @property
    def tokenizer(self) -> Optional[HFTokenizerText]:
        """The prepared corpus' tokenizer, when its ``tokenizer.json`` is still where ``prepare`` read it."""
        folder = Path(self.corpus.source)
        if not (folder / META_FILE).is_file():
            return None
        recorded = json.loads((folder / META_FILE).read_text())["tokenizer"].get("path")
        file = Path(recorded) / "tokenizer.json" if recorded else None
        if file is None or not file.is_file():
            return None
        try:
            return HFTokenizerText(file)
        except ImportError:
            return None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        train = TokenSequences(self.corpus, self.seq_len)
        if self.val_corpus is not None:
            self.splits = {"train": train, "val": TokenSequences(self.val_corpus, self.seq_len)}
        else:
            held_out = int(len(train) * self.val_fraction)
            self.splits = {"train": TokenSequences(self.corpus, self.seq_len, 0, len(train) - held_out)}
            if held_out:
                self.splits["val"] = TokenSequences(self.corpus, self.seq_len, len(train) - held_out, held_out)
        for name, split in self.splits.items():
            if len(split) < self.global_batch_size:
                source = self.val_corpus.source if name == "val" and self.val_corpus is not None else self.corpus.source
                raise ValueError(
                    f"The {name} split of `{source}` has {len(split)} sequences of seq_len+1={self.seq_len + 1} tokens,"
                    f" fewer than `data.global_batch_size={self.global_batch_size}`. Prepare more text, or lower"
                    " `data.seq_len`, `data.global_batch_size` or `data.val_fraction`."
                )

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        replicas = data_parallel_replicas(self.trainer)
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        if split == "train":
            return ResumableDataLoader(
                self.splits[split], self.global_batch_size, shuffle=shuffle, seed=self.seed, **replicas, **workers
            )
        dp = replicas["num_replicas"]
        if self.global_batch_size % dp:
            raise ValueError(
                f"`data.global_batch_size={self.global_batch_size}` is not divisible by the data-parallel degree dp={dp}."
                f" Choose a multiple of {dp}."
            )
        sampler = DistributedSampler(self.splits[split], shuffle=False, drop_last=True, **replicas)
        return DataLoader(self.splits[split], batch_size=self.global_batch_size // dp, sampler=sampler, drop_last=True, **workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> Any:
        self.setup()
        return self._loader("val", False) if "val" in self.splits else []


__all__ = ["TokenDataModule", "TokenSequences"]
