"""The on-disk token format that ``lightning-para prepare`` writes and :class:`TokenDataModule` reads.

A prepared folder holds one flat token file per input (``shards/NNNNN.bin``: little-endian ``uint16`` when
the tokenizer's vocabulary fits in 65 536 ids, else ``uint32``; each document followed by one EOS id),
a completion record per shard (``shards/NNNNN.json``: written last and atomically, so a shard without one
was interrupted and is never counted), and ``meta.json`` (token count, documents, tokenizer name,
vocabulary size, EOS id, dtype, and the shards in order).

Why our own small format rather than LitData's optimized chunks: a language-model corpus is one token
stream, and the two formats the field already trains from (nanoGPT's raw ``uint16`` files, llm.c's
``uint16`` files after a 256 x int32 header) are exactly that; this one is the same bytes plus a JSON
record, so ``np.memmap`` reads all three with zero copies and no extra dependency, and a nanoGPT or llm.c
``.bin`` is read as it is. LitData's chunks serve item datasets (images, rows) and would add a
dependency and a conversion step for the same stream.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

META_FILE = "meta.json"
SHARD_DIR = "shards"
FORMAT_NAME = "lightning-para-tokens"
FORMAT_VERSION = 1
# llm.c's data files (dev/data/data_common.py): 256 int32 header, magic 20240520, version 1 = uint16 tokens.
LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_VERSIONS = {1: np.uint16, 2: np.uint32}


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65 536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to a hidden sibling, flush it to disk, then rename it into place (all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class TokenFile:
    """One memory-mappable token file: ``tokens`` ids of ``dtype`` from byte ``offset``."""

    path: Path
    offset: int
    tokens: int
    dtype: np.dtype

    def open(self) -> np.memmap:
        if self.tokens == 0:
            return np.zeros(0, dtype=self.dtype)  # type: ignore[return-value]
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.tokens,))


@dataclass(frozen=True)
class TokenCorpus:
    """The token files of a corpus in order, and what is known of its tokenizer."""

    files: tuple[TokenFile, ...]
    vocab_size: Optional[int]
    eos_id: Optional[int]
    source: str

    @property
    def tokens(self) -> int:
        return sum(f.tokens for f in self.files)


def _bin_file(path: Path) -> TokenFile:
    """A nanoGPT (raw uint16) or llm.c (header + tokens) ``.bin`` file, checked against its size."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=3) if size >= 12 else np.zeros(0, dtype="<i4")
    if len(header) == 3 and int(header[0]) == LLMC_MAGIC:
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_VERSIONS:
            raise ValueError(f"`{path}` is an llm.c token file of version {version}; versions {sorted(LLMC_VERSIONS)} are known.")
        dtype = np.dtype(LLMC_VERSIONS[version])
        offset = LLMC_HEADER_INTS * 4
        expected = offset + count * dtype.itemsize
        if size != expected:
            raise ValueError(
                f"`{path}` is truncated or corrupt: its llm.c header promises {count} tokens ({expected} bytes) but the"
                f" file has {size} bytes. Re-download or re-create it."
            )
        return TokenFile(path, offset, count, dtype)
    if size % 2:
        raise ValueError(f"`{path}` has an odd number of bytes ({size}); a nanoGPT uint16 token file is truncated. Re-create it.")
    return TokenFile(path, 0, size // 2, np.dtype(np.uint16))


def _prepared(folder: Path) -> TokenCorpus:
    meta = json.loads((folder / META_FILE).read_text())
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"`{folder / META_FILE}` is not a {FORMAT_NAME} v{FORMAT_VERSION} record; re-run `lightning-para prepare`.")
    dtype = np.dtype(meta["dtype"])
    files = []
    for shard in meta["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise ValueError(
                f"The prepared corpus `{folder}` lists the shard `{shard['file']}` (from `{shard['input']}`), which is missing."
                " Re-run `lightning-para prepare` with the same inputs and output: it re-creates missing shards."
            )
        expected = shard["tokens"] * dtype.itemsize
        if path.stat().st_size != expected:
            raise ValueError(
                f"The shard `{path}` has {path.stat().st_size} bytes but its record says {shard['tokens']} tokens"
                f" ({expected} bytes): it is truncated or was changed. Delete it and its `.json`, then re-run"
                " `lightning-para prepare` with the same inputs and output."
            )
        files.append(TokenFile(path, 0, shard["tokens"], dtype))
    tokenizer = meta["tokenizer"]
    return TokenCorpus(tuple(files), tokenizer["vocab_size"], tokenizer.get("eos_id"), str(folder))


def open_corpus(path: Union[str, Path, list], vocab_size: Optional[int] = None) -> TokenCorpus:
    """A prepared folder (with ``meta.json``), a ``.bin`` file, a list of them, or a folder of ``.bin`` files.

    ``vocab_size`` states the vocabulary of ``.bin`` files, which do not record it (GPT-2's is 50 257).
    """
    paths = [Path(p).expanduser() for p in (path if isinstance(path, (list, tuple)) else [path])]
    if len(paths) == 1 and (paths[0] / META_FILE).is_file():
        corpus = _prepared(paths[0])
        if vocab_size is not None and corpus.vocab_size is not None and vocab_size != corpus.vocab_size:
            raise ValueError(
                f"`data.vocab_size={vocab_size}` differs from the prepared corpus' tokenizer vocabulary"
                f" ({corpus.vocab_size}). Leave `data.vocab_size` unset for a prepared folder."
            )
        return corpus
    files: list[Path] = []
    for p in paths:
        if not p.exists():
            raise ValueError(
                f"`data.path={str(p)!r}` does not exist. Pass a folder written by `lightning-para prepare`, or nanoGPT /"
                " llm.c `.bin` token files."
            )
        if p.is_dir():
            found = sorted(p.glob("*.bin"))
            if not found:
                raise ValueError(
                    f"`data.path={str(p)!r}` holds neither `{META_FILE}` (a `lightning-para prepare` output) nor `.bin`"
                    " token files. Run `lightning-para prepare --tokenizer DIR --output OUT INPUT...` first."
                )
            files.extend(found)
        else:
            files.append(p)
    token_files = tuple(_bin_file(f) for f in files)
    return TokenCorpus(token_files, vocab_size, None, ", ".join(str(p) for p in paths))


__all__ = ["LLMC_MAGIC", "META_FILE", "TokenCorpus", "TokenFile", "open_corpus", "token_dtype", "write_json_atomic"]
