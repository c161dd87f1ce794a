"""Train from tokenized corpora: :class:`TokenDataModule`.

It reads a folder written by ``lightning-para prepare`` (token shards + ``meta.json``, see
:mod:`lightning_para.recipes.token_format`), or nanoGPT / llm.c ``.bin`` token files as they are. Every file
is memory-mapped: a rank touches only the pages of the windows it reads, whatever the corpus' size.

A corpus is one stream (documents already packed, each followed by the tokenizer's EOS id); its sequences
are consecutive windows of ``seq_len + 1`` tokens (inputs and next-token targets), also across file
boundaries. Training reads one corpus or a weighted mixture of several (``sources``), in the order of
:mod:`lightning_para.recipes.mixture`: a function of the seed and the global sample position. Samples are
sharded per *data-parallel* rank (``trainer.strategy.distributed_sampler_kwargs``): the tp, pp and cp ranks
of one dp slot read the same batch. The training loader is a
:class:`~lightning_para.reliability.ResumableDataLoader` over that stream, so a run resumes exactly
mid-epoch, also at another data-parallel degree or after a source wrapped. With ``document_mask=True`` each
sample also carries the document of every input token (from the EOS ids in its window), and with
``reset_positions=True`` positions that restart at each document, for models that keep attention inside
documents (docs/data.md, "Document masks").
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler

from lightning_para.recipes.data import check_batch_shape, data_parallel_replicas
from lightning_para.recipes.documents import check_model_takes_documents, document_ids, document_positions
from lightning_para.recipes.mixture import EXHAUSTED, ON_CHANGE, Mixture
from lightning_para.recipes.shard_cache import ShardCache, is_url
from lightning_para.recipes.token_format import META_FILE, TokenCorpus, TokenFile, open_corpus
from lightning_para.reliability.resumable_data import ResumableDataLoader


class TokenSequences(Dataset):
    """Windows ``[first + i * seq_len, ... + seq_len + 1)`` of a corpus' token stream as ``(x, y)`` pairs,
    for ``i`` in ``range(count)`` (the stream crosses file boundaries); with ``eos_id``, ``(x, y,
    document_ids)`` and with ``reset_positions`` also the positions in each document."""

    def __init__(
        self, corpus: TokenCorpus, seq_len: int, first: int = 0, count: Optional[int] = None,
        cache: Optional[ShardCache] = None, eos_id: Optional[int] = None, reset_positions: bool = False,
    ) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.first = first
        total = max((corpus.tokens - 1) // seq_len, 0)
        self.count = total - first if count is None else count
        self.cache = cache  # where remote files are read from
        self.eos_id = eos_id
        self.reset_positions = reset_positions
        self._starts = np.cumsum([0] + [f.tokens for f in corpus.files])
        self._maps: dict[int, np.ndarray] = {}  # opened lazily: DataLoader workers map their own

    def __len__(self) -> int:
        return self.count

    def _read(self, index: int, offset: int, length: int) -> np.ndarray:
        """Up to ``length`` tokens from token ``offset`` of file ``index``."""
        file = self.corpus.files[index]
        length = min(length, file.tokens - offset)
        if is_url(file.path):
            assert self.cache is not None, "a remote corpus is read through a ShardCache"
            return self.cache.read(str(file.path), file.nbytes, file.dtype, file.offset + offset * file.dtype.itemsize, length)
        if index not in self._maps:
            self._maps[index] = file.open()
        return self._maps[index][offset : offset + length]

    def _tokens(self, start: int, length: int) -> np.ndarray:
        parts = []
        while length > 0:
            index = bisect_right(self._starts, start) - 1
            piece = self._read(index, start - int(self._starts[index]), length)
            parts.append(piece)
            start += len(piece)
            length -= len(piece)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def files_of(self, index: int) -> tuple[TokenFile, ...]:
        """The files sequence ``index`` reads."""
        start = (self.first + index) * self.seq_len
        return self.corpus.files[bisect_right(self._starts, start) - 1 : bisect_right(self._starts, start + self.seq_len)]

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sequence ``index``."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        return self._tokens((self.first + index) * self.seq_len, self.seq_len + 1)

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        # Every training and validation sample is made here, from its window.
        window = torch.from_numpy(self.window(index).astype(np.int64))
        x, y = window[:-1], window[1:]
        if self.eos_id is None:
            return x, y
        documents = document_ids(x, self.eos_id)
        return (x, y, documents, document_positions(documents)) if self.reset_positions else (x, y, documents)


class MixedSequences(Dataset):
    """The training stream: position ``g`` is the sequence the mixture draws there from one of ``sources``;
    an epoch is the next ``len()`` positions (a stream dataset of :class:`ResumableDataLoader`). With a ``cache``,
    the remote shards of the next ``ahead`` positions are fetched in the background, in the order they are read
    (``stride``: the data-parallel degree, as a rank reads every ``stride``-th position)."""

    def __init__(
        self, sources: dict[str, TokenSequences], mixture: Mixture, cache: Optional[ShardCache] = None, ahead: int = 0,
    ) -> None:
        self.sources = list(sources.values())
        self.mixture = mixture
        self.cache, self.ahead, self.stride = cache, ahead if cache is not None else 0, 1
        self._planned = (0, 0)  # the positions whose shards were last asked for

    def __len__(self) -> int:
        return self.mixture.epoch_samples

    def __getitem__(self, g: int) -> tuple[Tensor, ...]:
        if self.ahead and not self._planned[0] <= g < self._planned[1]:
            self._prefetch(g)
        source, index = self.mixture.locate(g)
        return self.sources[source][index]

    def _prefetch(self, g: int) -> None:
        shards: dict[str, int] = {}
        for p in range(g, g + self.ahead, self.stride):
            source, index = self.mixture.locate(p)
            for file in self.sources[source].files_of(index):
                if is_url(file.path):
                    shards.setdefault(str(file.path), file.nbytes)
        assert self.cache is not None
        self.cache.prefetch(list(shards.items()))
        self._planned = (g, g + self.ahead // 2)  # asked again halfway


class MixtureLoader(ResumableDataLoader):
    """The training loader of a mixture: its checkpoint state adds the mixture and every source's position, and a
    changed mixture is refused or (``on_mixture_change="restart_mixture"``) continued from those positions."""

    def __init__(self, dataset: MixedSequences, global_batch_size: int, on_mixture_change: str, **kwargs: Any) -> None:
        super().__init__(dataset, global_batch_size, shuffle=False, stream=True, **kwargs)
        self.mixture = dataset.mixture
        self.on_mixture_change = on_mixture_change

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "mixture": self.mixture.state(state["epoch"] * self.mixture.epoch_samples + state["samples"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture")
        if saved is None:
            raise ValueError(
                "The checkpoint's data position was written by a TokenDataModule without mixtures; it cannot be"
                " continued exactly. Start the data from its beginning (a fresh fit with the checkpoint's weights)."
            )
        self.mixture.check(saved, self.on_mixture_change)
        # The mixture fixes the epoch's length: changed (explicitly), the position keeps its epoch and sample count.
        super().load_state_dict({**state, "dataset_len": self.mixture.epoch_samples})
        now = super().state_dict()
        self.mixture.resume(saved, now["epoch"] * self.mixture.epoch_samples + now["samples"], self.on_mixture_change)


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
    """Language-modelling batches from a tokenized corpus or a weighted mixture of them, sharded over the
    data-parallel ranks.

    Args:
        path: a folder written by ``lightning-para prepare``; or a nanoGPT (raw ``uint16``) / llm.c
            (``uint16`` after a 256 x int32 header, magic 20240520) ``.bin`` file, a folder of them, or a list.
        seq_len: tokens per training sequence (at most the model's positions).
        global_batch_size: sequences per optimizer micro-step over all data-parallel ranks (each dp rank
            loads ``global_batch_size // dp``).
        val_path: a separate validation corpus (same forms as ``path``); without it the last
            ``val_fraction`` of every source's sequences are held out.
        val_fraction: the held-out tail when ``val_path`` is not given (0 switches validation off).
        vocab_size: the vocabulary of ``.bin`` files, which do not record it (GPT-2's: 50 257); a prepared
            folder records its own.
        shuffle, seed: the training order (each source's sequences in a permutation per pass, seeded by ``seed``,
            the source's name and the pass; the same for every layout).
        num_workers: DataLoader workers per rank.
        sources: instead of ``path``, a weighted mixture ``{name: (path, weight)}`` (see
            :mod:`lightning_para.recipes.mixture`); the sources share one tokenizer.
        exhausted: what a source that runs out does: ``"repeat"`` (its next pass; an epoch is as many sequences as
            the sources hold together) or ``"stop"`` (the epoch ends there; the next starts every source anew).
        on_mixture_change: a checkpoint written with another mixture (a weight, a source added or removed):
            ``"error"``, or ``"restart_mixture"`` (every source continues from its saved position, new weights).
        cache_dir, cache_bytes, retries: for paths that are URLs (``https://``, ``s3://``, ... through ``fsspec``):
            the local cache of their shards (default ``$LIGHTNING_PARA_CACHE/shards``, ``~/.cache/lightning-para``)
            and its bound in bytes, and the retries of a failed read (see
            :mod:`lightning_para.recipes.shard_cache`).
        document_mask: add each token's document (``document_ids``, from the EOS ids in the window) to every
            batch, ``(x, y, document_ids)``, so the model attends only within documents (the recipes' GPT,
            HFCausalLM and LitGPTCausalLM take it; a model that does not declare ``accepts_documents`` is refused
            at setup). Off: attention crosses EOS, as in nanoGPT and llm.c.
        reset_positions: with ``document_mask``, also positions that restart at 0 at each document,
            ``(x, y, document_ids, position_ids)`` (Megatron's ``reset_position_ids``).
        eos_id: the id that ends each document in ``.bin`` files (GPT-2's: 50 256); a prepared folder records its own.
    """

    def __init__(
        self,
        path: Optional[Union[str, list[str]]] = None,
        seq_len: int = 1024,
        global_batch_size: int = 8,
        val_path: Optional[Union[str, list[str]]] = None,
        val_fraction: float = 0.01,
        vocab_size: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        sources: Optional[dict[str, tuple[Union[str, list[str]], float]]] = None,
        exhausted: Literal["repeat", "stop"] = "repeat",
        on_mixture_change: Literal["error", "restart_mixture"] = "error",
        cache_dir: Optional[str] = None,
        cache_bytes: int = 64 << 30,
        retries: int = 5,
        document_mask: bool = False,
        reset_positions: bool = False,
        eos_id: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_batch_shape(seq_len, global_batch_size)
        if reset_positions and not document_mask:
            raise ValueError("`data.reset_positions=True` restarts positions at each document: set `data.document_mask=True` too.")
        if not 0.0 <= val_fraction < 0.5:
            raise ValueError(f"`data.val_fraction={val_fraction!r}` must be in [0, 0.5).")
        if (path is None) == (sources is None) or sources == {}:
            raise ValueError("Give `data.path` (one corpus) or `data.sources` (a mixture `{name: [path, weight]}`), not both.")
        if exhausted not in EXHAUSTED or on_mixture_change not in ON_CHANGE:
            raise ValueError(f"`data.exhausted` must be one of {EXHAUSTED}, `data.on_mixture_change` one of {ON_CHANGE}.")
        self.path = path
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.exhausted = exhausted
        self.on_mixture_change = on_mixture_change
        entries = {"data": (path, 1.0)} if sources is None else sources
        self.weights = {name: float(weight) for name, (_, weight) in entries.items()}
        given = [p for where, _ in entries.values() for p in ([where] if isinstance(where, str) else where)]
        root = os.environ.get("LIGHTNING_PARA_CACHE", os.path.join("~", ".cache", "lightning-para"))
        self.cache = ShardCache(cache_dir or os.path.join(root, "shards"), cache_bytes, retries) if any(
            is_url(p) for p in given + ([val_path] if isinstance(val_path, str) else val_path or [])) else None
        # Opened here, in the launching process: a missing or truncated shard fails before any worker starts.
        self.corpora = {name: open_corpus(where, vocab_size, retries) for name, (where, _) in entries.items()}
        self.corpus = next(iter(self.corpora.values()))
        for name, corpus in self.corpora.items():
            known = [(a, b) for a, b in ((corpus.vocab_size, self.corpus.vocab_size), (corpus.eos_id, self.corpus.eos_id))
                     if a is not None and b is not None]
            if any(a != b for a, b in known):  # .bin files record neither
                raise ValueError(
                    f"`data.sources[{name!r}]` was tokenized with vocabulary {corpus.vocab_size} and EOS id"
                    f" {corpus.eos_id}, the first source with {self.corpus.vocab_size} and {self.corpus.eos_id}. Prepare"
                    " every source with the same tokenizer."
                )
        self.val_corpus = open_corpus(val_path, vocab_size or self.corpus.vocab_size, retries) if val_path is not None else None
        self.document_mask, self.reset_positions = document_mask, reset_positions
        self.eos_id = eos_id if eos_id is not None else self.corpus.eos_id
        if document_mask and self.eos_id is None:
            raise ValueError(
                f"`data.document_mask=True` finds documents by their EOS id, which `{self.corpus.source}` does not record."
                " Set `data.eos_id` (GPT-2's is 50256)."
            )
        self.splits: dict[str, Dataset] = {}

    @property
    def mixture(self) -> Mixture:
        """Which source each training position reads; ``mixture.proportions(0, n)``: the realised shares."""
        self.setup()
        train = self.splits["train"]
        assert isinstance(train, MixedSequences)
        return train.mixture

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
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if self.document_mask and module is not None:
            check_model_takes_documents(module)
        if self.splits:
            return
        train, val = {}, []
        documents = {"eos_id": self.eos_id if self.document_mask else None, "reset_positions": self.reset_positions}
        for name, corpus in self.corpora.items():
            total = len(TokenSequences(corpus, self.seq_len))
            held_out = 0 if self.val_corpus is not None else int(total * self.val_fraction)
            train[name] = TokenSequences(corpus, self.seq_len, 0, total - held_out, self.cache, **documents)
            if held_out:
                val.append(TokenSequences(corpus, self.seq_len, total - held_out, held_out, self.cache, **documents))
        if self.val_corpus is not None:
            val = [TokenSequences(self.val_corpus, self.seq_len, cache=self.cache, **documents)]
        mixture = Mixture(list(train), [self.weights[n] for n in train], [len(t) for t in train.values()],
                          seed=self.seed, shuffle=self.shuffle, exhausted=self.exhausted)
        self.splits = {"train": MixedSequences(train, mixture, self.cache, ahead=4 * self.global_batch_size)}
        if val:
            self.splits["val"] = val[0] if len(val) == 1 else ConcatDataset(val)
        for name, split in self.splits.items():
            if len(split) < self.global_batch_size:  # type: ignore[arg-type]
                where = self.val_corpus.source if name == "val" and self.val_corpus is not None else ", ".join(
                    c.source for c in self.corpora.values())
                raise ValueError(
                    f"The {name} split of `{where}` has {len(split)} sequences of seq_len+1={self.seq_len + 1} tokens,"  # type: ignore[arg-type]
                    f" fewer than `data.global_batch_size={self.global_batch_size}`. Prepare more text, or lower"
                    " `data.seq_len`, `data.global_batch_size` or `data.val_fraction`."
                )

    def _loader(self, split: str) -> DataLoader:
        self.setup()
        replicas = data_parallel_replicas(self.trainer)
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        dataset = self.splits[split]
        if isinstance(dataset, MixedSequences):
            mixture = dataset.mixture
            if len(mixture.names) > 1:
                shares = mixture.proportions(0, len(dataset))
                rank_zero_info(f"Data mixture over one epoch of {len(dataset)} sequences: " + ", ".join(
                    f"{n} {shares[n]:.1%} (weight {w:.1%})" for n, w in zip(mixture.names, mixture.weights)))
            dataset.stride = replicas["num_replicas"]
            return MixtureLoader(dataset, self.global_batch_size, self.on_mixture_change, **replicas, **workers)
        dp = replicas["num_replicas"]
        if self.global_batch_size % dp:
            raise ValueError(
                f"`data.global_batch_size={self.global_batch_size}` is not divisible by the data-parallel degree dp={dp}."
                f" Choose a multiple of {dp}."
            )
        sampler = DistributedSampler(dataset, shuffle=False, drop_last=True, **replicas)
        return DataLoader(dataset, batch_size=self.global_batch_size // dp, sampler=sampler, drop_last=True, **workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> Any:
        self.setup()
        return self._loader("val") if "val" in self.splits else []


__all__ = ["MixedSequences", "MixtureLoader", "TokenDataModule", "TokenSequences"]
