"""Real text with no download: a byte-level tokenizer and a ``LightningDataModule``.

By default the data is the Python standard library's own source code (every machine that
runs this package has it): the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, in
sorted path order, read until a byte budget is reached. ``path=`` takes any text file or
folder instead. The token stream is split by position into train | val | test, so the
split is deterministic and the held-out parts are files the model never trained on.

Batches follow the data-parallel sub-mesh: the sampler is built from
``trainer.strategy.distributed_sampler_kwargs`` (``num_replicas = dp``, ``rank =`` the dp
coordinate), so the tp and pp ranks of one dp slot see the same batch, and
``global_batch_size`` is split over the dp ranks only.

The training loader is a :class:`~lightning_para.reliability.ResumableDataLoader`: its global
position (epoch, samples consumed) is saved in every checkpoint, so a run resumed from a
mid-epoch checkpoint continues with the same batches, also at another data-parallel degree.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_para.reliability.resumable_data import ResumableDataLoader

BYTE_VOCAB = 256
DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst")
# Folders under the stdlib that are not the standard library itself.
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__"}


class ByteTokenizer:
    """UTF-8 bytes as tokens ``0..255``; special tokens (e.g. ``"<|endoftext|>"``) from 256 on.

    No vocabulary file, no download: every string encodes, and ``decode`` never fails
    (invalid UTF-8 from a sampled sequence is shown as U+FFFD).
    """

    def __init__(self, special_tokens: Sequence[str] = ()) -> None:
        special_tokens = list(special_tokens)
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"`special_tokens={special_tokens}` has duplicates; list each special token once.")
        if any(not s for s in special_tokens):
            raise ValueError("`special_tokens` must not contain empty strings.")
        self.special_tokens = special_tokens
        self._special_ids = {s: BYTE_VOCAB + i for i, s in enumerate(special_tokens)}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(self.special_tokens)

    def special_id(self, token: str) -> int:
        if token not in self._special_ids:
            raise ValueError(f"{token!r} is not a special token of this tokenizer ({self.special_tokens}).")
        return self._special_ids[token]

    def encode(self, text: str) -> list[int]:
        """Bytes of ``text`` (special-token strings inside ``text`` are encoded as bytes, not ids)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Union[Sequence[int], Tensor]) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < BYTE_VOCAB:
                pending.append(i)
                continue
            if not BYTE_VOCAB <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside this tokenizer's vocabulary of {self.vocab_size}.")
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            out.append(self.special_tokens[i - BYTE_VOCAB])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: Union[str, Path], extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> list[Path]:
    """``path`` itself if it is a file, else the files under it with one of ``extensions`` (sorted).

    Raises ``ValueError`` for a path that does not exist, an empty file or a folder without text files.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"`data.path={str(path)!r}` does not exist. Pass a text file or a folder of text files"
            " (or leave `path` unset to train on the Python standard library's source)."
        )
    if p.is_file():
        if p.stat().st_size == 0:
            raise ValueError(f"`data.path={str(path)!r}` is an empty file (0 bytes); pass a file that holds text.")
        return [p]
    files = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in extensions), key=lambda f: f.as_posix())
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise ValueError(
            f"`data.path={str(path)!r}` is a folder with no non-empty files ending in {list(extensions)}."
            " Point it at a text file, or set `data.extensions` to the suffixes of your files."
        )
    return files


def read_tokens(files: Sequence[Path], tokenizer: ByteTokenizer, max_bytes: Optional[int], separator: Optional[int]) -> Tensor:
    """One flat token stream of ``files`` in order, cut at ``max_bytes`` (``None``: no cap)."""
    chunks: list[Tensor] = []
    total = 0
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    sep = torch.tensor([separator], dtype=dtype) if separator is not None else None
    for f in files:
        data = f.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        if not data:
            continue
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dtype))
        total += len(data)
        if sep is not None:
            chunks.append(sep)
        if max_bytes is not None and total >= max_bytes:
            break
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype)


class TokenWindows(Dataset):
    """Next-token pairs ``(x, y)`` of ``seq_len`` tokens cut from a token stream every ``stride`` tokens."""

    def __init__(self, tokens: Tensor, seq_len: int, stride: Optional[int] = None) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self._len = max((len(tokens) - seq_len - 1) // self.stride + 1, 0)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(index)
        start = index * self.stride
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class TextDataModule(L.LightningDataModule):
    """Byte-level language-modelling data over real text, split over the data-parallel ranks.

    Args:
        path: a text file or a folder of text files; ``None`` (default) reads the Python
            standard library's ``.py`` source files, present on every machine.
        seq_len: tokens per training sequence (the model's context must be at least this).
        global_batch_size: sequences per optimizer micro-step over *all* data-parallel ranks;
            each dp rank loads ``global_batch_size // dp`` (tp/pp ranks of one dp slot load
            the same batch). Keeping it global makes a run's losses independent of the layout.
        val_fraction, test_fraction: the last parts of the token stream held out for
            validation and test.
        max_bytes: read at most this many bytes (a fixed budget keeps the default fast);
            ``None`` reads everything.
        special_tokens: extra tokens after the 256 bytes; if ``"<|endoftext|>"`` is among
            them it separates files, otherwise a newline does.
        extensions: file suffixes read from a folder.
        shuffle: shuffle training windows (seeded with ``seed``; same order for every layout).
        num_workers: DataLoader workers per rank.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        seq_len: int = 64,
        global_batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_bytes: Optional[int] = 2_000_000,
        special_tokens: Sequence[str] = (),
        extensions: Sequence[str] = DEFAULT_EXTENSIONS,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_batch_shape(seq_len, global_batch_size)
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0.0 < value < 0.5:
                raise ValueError(f"`data.{name}={value!r}` must be in (0, 0.5).")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"`data.max_bytes={max_bytes!r}` must be positive, or None to read everything.")
        self.path = path
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.max_bytes = max_bytes
        self.extensions = tuple(extensions)
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = ByteTokenizer(special_tokens)
        # Checked here, in the launching process, so a bad path fails before any worker starts.
        self.files = text_files(path, self.extensions) if path is not None else stdlib_source_files()
        if not self.files:
            raise ValueError("No standard-library source files were found; pass `data.path=` to a text file or folder.")
        self.splits: dict[str, TokenWindows] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def source(self) -> str:
        return str(self.path) if self.path is not None else f"Python {sysconfig.get_python_version()} stdlib source"

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        separator = (
            self.tokenizer.special_id("<|endoftext|>") if "<|endoftext|>" in self.tokenizer.special_tokens else ord("\n")
        )
        tokens = read_tokens(self.files, self.tokenizer, self.max_bytes, separator)
        n = len(tokens)
        n_val, n_test = int(n * self.val_fraction), int(n * self.test_fraction)
        n_train = n - n_val - n_test
        parts = {"train": tokens[:n_train], "val": tokens[n_train : n_train + n_val], "test": tokens[n_train + n_val :]}
        for name, part in parts.items():
            if len(part) < self.seq_len + 1:
                raise ValueError(
                    f"The {name} split of {self.source} has {len(part)} tokens, fewer than one sequence of"
                    f" seq_len+1={self.seq_len + 1}. Use more text (a larger file, or `data.max_bytes`), a smaller"
                    f" `data.seq_len`, or larger `data.val_fraction`/`test_fraction`."
                )
        self.splits = {name: TokenWindows(part, self.seq_len) for name, part in parts.items()}

    # ------------------------------------------------------------------ loaders
    def _replicas(self) -> dict[str, int]:
        return data_parallel_replicas(self.trainer)

    def per_rank_batch_size(self) -> int:
        dp = self._replicas()["num_replicas"]
        if self.global_batch_size % dp:
            raise ValueError(
                f"`data.global_batch_size={self.global_batch_size}` is not divisible by the data-parallel degree"
                f" dp={dp}. Choose a multiple of {dp}."
            )
        return self.global_batch_size // dp

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        dataset = self.splits[split]
        replicas = self._replicas()
        batch_size = self.per_rank_batch_size()
        if len(dataset) < self.global_batch_size:
            raise ValueError(
                f"The {split} split has {len(dataset)} sequences, fewer than `data.global_batch_size="
                f"{self.global_batch_size}`. Use more text or a smaller batch/seq_len."
            )
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        if split == "train":  # resumable mid-epoch: Lightning saves its global position in each checkpoint
            return ResumableDataLoader(
                dataset, self.global_batch_size, shuffle=shuffle, seed=self.seed, **replicas, **workers
            )
        # drop_last keeps every dp rank at the same number of equal batches (no padded duplicates).
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=self.seed, drop_last=True, **replicas)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", False)


def check_batch_shape(seq_len: object, global_batch_size: object) -> None:
    """``data.seq_len`` and ``data.global_batch_size`` are positive integers (``ValueError`` naming the argument)."""
    for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`data.{name}={value!r}` must be a positive integer.")


def data_parallel_replicas(trainer: object) -> dict[str, int]:
    """``{"num_replicas": dp, "rank": dp coordinate}`` from the strategy (tp/pp ranks of one dp slot share it)."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
    return dict(kwargs) if kwargs else {"num_replicas": 1, "rank": 0}


def check_positions(model_positions: Optional[int], datamodule: object) -> None:
    """Sequences longer than the model's positions would index past its position table (or its RoPE range)."""
    seq_len = getattr(datamodule, "seq_len", None)
    if model_positions is not None and isinstance(seq_len, int) and seq_len > model_positions:
        raise ValueError(
            f"`data.seq_len={seq_len}` is longer than the model's {model_positions} positions. Set `data.seq_len` to at"
            f" most {model_positions}, or build the model with more positions (`block_size` /"
            " `max_position_embeddings`)."
        )


def check_vocab(model_vocab_size: int, datamodule: object) -> None:
    """A tokenizer that emits ids the model's embedding cannot hold is a configuration error."""
    data_vocab = getattr(datamodule, "vocab_size", None)
    if data_vocab is not None and data_vocab > model_vocab_size:
        raise ValueError(
            f"Vocabulary mismatch: the data's tokenizer has {data_vocab} tokens but the model's"
            f" `vocab_size={model_vocab_size}`. Set `model.vocab_size` to at least {data_vocab}"
            " (a multiple of the tensor-parallel degree), or remove `data.special_tokens`."
        )
