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

from lightning_para.recipes.shard_cache import is_url, read_range, remote_size

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
    """One token file: ``tokens`` ids of ``dtype`` from byte ``offset``; a local path (memory-mapped) or a URL
    (read from a :class:`~lightning_para.recipes.shard_cache.ShardCache`)."""

    path: Union[Path, str]
    offset: int
    tokens: int
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return self.offset + self.tokens * self.dtype.itemsize

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


def _bin_file(path: Union[Path, str], retries: int) -> TokenFile:
    """A nanoGPT (raw uint16) or llm.c (header + tokens) ``.bin`` file, checked against its size."""
    if is_url(path):
        try:
            size, head = remote_size(str(path)), read_range(str(path), 0, 12, retries)
        except FileNotFoundError:
            raise ValueError(f"`data.path={path!r}` was not found: neither `{path}/{META_FILE}` nor `{path}` exists.") from None
    else:
        with open(path, "rb") as f:
            size, head = os.fstat(f.fileno()).st_size, f.read(12)
    header = np.frombuffer(head, dtype="<i4") if len(head) == 12 else np.zeros(0, dtype="<i4")
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


def _meta(where: Union[Path, str], retries: int) -> Optional[dict[str, Any]]:
    """``meta.json`` of a prepared folder (local or a URL), or None when there is none."""
    if not is_url(where):
        file = Path(where) / META_FILE
        return json.loads(file.read_text()) if file.is_file() else None
    try:
        return json.loads(read_range(f"{str(where).rstrip('/')}/{META_FILE}", None, None, retries))
    except FileNotFoundError:
        return None


def _prepared(folder: Union[Path, str], meta: dict[str, Any]) -> TokenCorpus:
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"`{folder}/{META_FILE}` is not a {FORMAT_NAME} v{FORMAT_VERSION} record; re-run `lightning-para prepare`.")
    dtype = np.dtype(meta["dtype"])
    files = []
    for shard in meta["shards"]:
        if is_url(folder):  # checked against its record when it is fetched
            files.append(TokenFile(f"{str(folder).rstrip('/')}/{shard['file']}", 0, shard["tokens"], dtype))
            continue
        path = Path(folder) / shard["file"]
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


def open_corpus(path: Union[str, Path, list], vocab_size: Optional[int] = None, retries: int = 5) -> TokenCorpus:
    """A prepared folder (with ``meta.json``), a ``.bin`` file, a list of them, or a folder of ``.bin`` files;
    each may be a URL (``retries``: for its metadata).

    ``vocab_size`` states the vocabulary of ``.bin`` files, which do not record it (GPT-2's is 50 257).
    """
    paths = [p if is_url(p) else Path(p).expanduser() for p in (path if isinstance(path, (list, tuple)) else [path])]
    meta = _meta(paths[0], retries) if len(paths) == 1 else None
    if meta is not None:
        corpus = _prepared(paths[0], meta)
        if vocab_size is not None and corpus.vocab_size is not None and vocab_size != corpus.vocab_size:
            raise ValueError(
                f"`data.vocab_size={vocab_size}` differs from the prepared corpus' tokenizer vocabulary"
                f" ({corpus.vocab_size}). Leave `data.vocab_size` unset for a prepared folder."
            )
        return corpus
    files: list[Union[Path, str]] = []
    for p in paths:
        if isinstance(p, str) or p.is_file():
            files.append(p)
            continue
        if not p.exists():
            raise ValueError(
                f"`data.path={str(p)!r}` does not exist. Pass a folder written by `lightning-para prepare`, or nanoGPT /"
                " llm.c `.bin` token files."
            )
        found = sorted(p.glob("*.bin"))
        if not found:
            raise ValueError(
                f"`data.path={str(p)!r}` holds neither `{META_FILE}` (a `lightning-para prepare` output) nor `.bin`"
                " token files. Run `lightning-para prepare --tokenizer DIR --output OUT INPUT...` first."
            )
        files.extend(found)
    token_files = tuple(_bin_file(f, retries) for f in files)
    return TokenCorpus(token_files, vocab_size, None, ", ".join(str(p) for p in paths))


__all__ = ["LLMC_MAGIC", "META_FILE", "TokenCorpus", "TokenFile", "open_corpus", "token_dtype", "write_json_atomic"]
