"""``lightning-para prepare``: tokenize text, jsonl and parquet files into memory-mapped token shards.

::

    lightning-para prepare --tokenizer ./llama-tokenizer --output ./corpus data/*.jsonl --text-field text --workers 8

The tokenizer is a Hugging Face tokenizer in a local folder (``tokenizer.json``, read by the ``tokenizers``
library; other local formats through ``transformers.AutoTokenizer(local_files_only=True)``): nothing is
downloaded. A text file is one document, a jsonl line or a parquet row is one document (its
``--text-field``). Each document's tokens are followed by one EOS id (the separator that packs documents
into one stream). One shard per input, in the format of :mod:`lightning_para.recipes.token_format`.

Resumable: a shard's completion record is written last, atomically; a rerun with the same output skips
every input whose record matches (same file size and modification time, same tokenizer, same ``--errors``)
and redoes the rest, so an interrupted shard is never counted half. ``meta.json`` is rewritten at the end and
lists every shard in the folder: this run's and those earlier runs with the same tokenizer wrote (named on
stderr). One ``prepare`` per output folder at a time, held by a lock that names its holder.

Input problems are never hidden: invalid UTF-8 is an error naming the file and byte offset (jsonl: and line)
unless ``--errors replace`` (U+FFFD, counted) or ``--errors skip`` (the document dropped, counted); a null
text is skipped and counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from lightning_para.recipes.token_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    SHARD_DIR,
    token_dtype,
    write_json_atomic,
)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# Names EOS goes by in common tokenizers (GPT-2, Llama 2 / 3, Gemma, T5-style), tried when the folder does not say.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
ENCODE_BATCH = 1024
LOCK_FILE = ".prepare.lock"
LOCK_TRIES = 30  # 3 s
ERRORS = ("strict", "replace", "skip")
COUNTS = ("skipped_null", "skipped_invalid_utf8", "replaced_invalid_utf8")  # per shard and in meta.json


class TokenizerText:
    """A local Hugging Face tokenizer: ``encode_batch`` of texts without added special tokens, vocab, EOS."""

    def __init__(self, folder: Path, eos_token: Optional[str]) -> None:
        self.folder = folder
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if file.is_file() and file.suffix == ".json":
            from tokenizers import Tokenizer  # optional: the `tokenizers` library reads tokenizer.json

            self._fast = Tokenizer.from_file(str(file))
            self._hf = None
            ids = self._fast.get_vocab(with_added_tokens=True).values()
            self.fingerprint = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
            token_to_id = self._fast.token_to_id
        else:
            try:
                from transformers import AutoTokenizer  # optional: tokenizers without a tokenizer.json
            except ImportError:
                raise ValueError(f"`--tokenizer {folder}` has no tokenizer.json; install transformers to read other formats.") from None
            try:
                self._hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            except (OSError, ValueError) as err:
                raise ValueError(f"`--tokenizer {folder}` is not a local Hugging Face tokenizer folder: {err}") from None
            self._fast = None
            ids = [*self._hf.get_vocab().values(), len(self._hf) - 1]
            self.fingerprint = hashlib.sha256(json.dumps(sorted(self._hf.get_vocab().items())).encode()).hexdigest()[:16]
            token_to_id = self._hf.convert_tokens_to_ids
        # The id space, not the entry count: a tokenizer may leave gaps (ids past its count).
        self.vocab_size = max(ids, default=-1) + 1
        if self.vocab_size > 2**32:
            raise ValueError(f"`--tokenizer {folder}` can emit id {self.vocab_size - 1}, beyond uint32 (token shards hold"
                             " uint16 or uint32 ids); use a tokenizer whose ids stay below 2**32.")
        self.eos_token = eos_token or _configured_eos(folder) or next(
            (t for t in EOS_CANDIDATES if _known(token_to_id(t), self._hf)), None
        )
        eos_id = token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is None or not _known(eos_id, self._hf):
            raise ValueError(
                f"`--tokenizer {folder}`: no end-of-text token found (tried {self.eos_token or list(EOS_CANDIDATES)}). Name the"
                " token that separates documents with `--eos-token`."
            )
        self.eos_id = int(eos_id)
        self.name = folder.name

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        assert self._hf is not None
        return self._hf(texts, add_special_tokens=False)["input_ids"]


def _known(token_id: Any, hf: Any) -> bool:
    return token_id is not None and (hf is None or token_id != hf.unk_token_id)


def _configured_eos(folder: Path) -> Optional[str]:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name if folder.is_dir() else None
        if path is not None and path.is_file():
            eos = json.loads(path.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and eos:
                return eos
    return None


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files as given, folders as their text/jsonl/parquet files (sorted); a missing path is a ValueError."""
    files: list[Path] = []
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    for given in inputs:
        p = Path(given).expanduser()
        if not p.exists():
            raise ValueError(f"input `{given}` does not exist; pass text, jsonl or parquet files, or folders of them.")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
            if not found:
                raise ValueError(f"input folder `{given}` holds no files ending in {list(suffixes)}.")
            files.extend(found)
        else:
            files.append(p)
    return [f.resolve() for f in files]


def _decode(data: bytes, errors: str, where: Callable[[int], str], counts: dict[str, int]) -> Optional[str]:
    """``data`` as UTF-8 under ``--errors``; None when the document is skipped. Counts what it changed."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if errors == "strict":
            raise ValueError(f"{where(err.start)} is not valid UTF-8 ({err.reason}); fix it, or pass `--errors replace`"
                             " (U+FFFD for each invalid sequence) or `--errors skip` (drop the document).") from None
        if errors == "skip":
            counts["skipped_invalid_utf8"] += 1
            return None
        text = data.decode("utf-8", errors="replace")
        counts["replaced_invalid_utf8"] += len(text) - len(data.decode("utf-8", errors="ignore"))
        return text


def documents(path: Path, text_field: str, errors: str = "strict",
              counts: Optional[dict[str, int]] = None) -> Iterator[str]:
    """The documents of one input: the whole text file, each jsonl line's or parquet row's ``text_field``.
    Null texts are skipped; ``counts`` (``COUNTS``) records what was skipped or replaced."""
    counts = counts if counts is not None else dict.fromkeys(COUNTS, 0)
    if path.suffix in JSONL_SUFFIXES:
        with open(path, "rb") as f:
            offset = 0
            for line_no, raw in enumerate(f, 1):
                where = lambda at, n=line_no, o=offset: f"`{path}` line {n} (byte {o + at})"
                offset += len(raw)
                line = _decode(raw, errors, where, counts)
                if line is None or not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"`{path}` line {line_no} is not JSON ({err.msg}); fix or remove that line.") from None
                if not isinstance(record, dict) or text_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"`{path}` line {line_no} has no `{text_field}` field (it has {keys}); set `--text-field`.")
                if record[text_field] is None:
                    counts["skipped_null"] += 1
                    continue
                yield str(record[text_field])
    elif path.suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq  # optional: pip install lightning-para[data]
        except ImportError:
            raise ValueError(f"`{path}` is a parquet file: install pyarrow (`pip install lightning-para[data]`).") from None
        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            raise ValueError(f"`{path}` has no column `{text_field}` (it has {table.schema_arrow.names}); set `--text-field`.")
        for batch in table.iter_batches(columns=[text_field], batch_size=ENCODE_BATCH):
            column = batch.column(0)
            counts["skipped_null"] += column.null_count
            yield from (str(t) for t in column.to_pylist() if t is not None)
    else:
        text = _decode(path.read_bytes(), errors, lambda at: f"`{path}` at byte {at}", counts)
        if text is not None:
            yield text


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def shard_name(path: Path) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:16]


def _input_stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


_WORKER_TOKENIZER: Optional[TokenizerText] = None


def _init_worker(folder: str, eos_token: Optional[str]) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel over files, one thread each
    _WORKER_TOKENIZER = TokenizerText(Path(folder), eos_token)


def tokenize_file(path: Path, out_dir: Path, text_field: str, errors: str = "strict") -> dict[str, Any]:
    """Tokenize one input into its shard: tokens to a hidden file, renamed into place, then the record."""
    tokenizer = _WORKER_TOKENIZER
    assert tokenizer is not None
    name = shard_name(path)
    shard_dir = out_dir / SHARD_DIR
    tmp = shard_dir / f".{name}.{os.getpid()}.bin.tmp"  # per process: never two writers on one file
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = docs = 0
    counts = dict.fromkeys(COUNTS, 0)
    with open(tmp, "wb") as f:
        for batch in _batches(documents(path, text_field, errors, counts), ENCODE_BATCH):
            for ids in tokenizer.encode_batch(batch):
                ids.append(tokenizer.eos_id)  # one separator after each document
                np.asarray(ids, dtype=dtype).tofile(f)
                tokens += len(ids)
                docs += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, shard_dir / f"{name}.bin")
    record = {"file": f"{SHARD_DIR}/{name}.bin", "input": str(path), **_input_stamp(path), "tokens": tokens,
              "documents": docs, "tokenizer": tokenizer.fingerprint, "errors": errors, **counts}
    write_json_atomic(shard_dir / f"{name}.json", record)
    return record


def _finished(path: Path, out_dir: Path, fingerprint: str, dtype: np.dtype, errors: str) -> Optional[dict[str, Any]]:
    """The completion record of ``path``'s shard if it is whole and current, else None (the shard is redone)."""
    name = shard_name(path)
    record_path, shard = out_dir / SHARD_DIR / f"{name}.json", out_dir / SHARD_DIR / f"{name}.bin"
    if not record_path.is_file() or not shard.is_file():
        return None
    record = json.loads(record_path.read_text())
    current = record.get("tokenizer") == fingerprint and all(record.get(k) == v for k, v in _input_stamp(path).items())
    current = current and record.get("errors", "replace") == errors
    whole = shard.stat().st_size == record.get("tokens", -1) * dtype.itemsize
    return record if current and whole else None


@contextmanager
def _output_lock(out_dir: Path) -> Iterator[None]:
    """One ``prepare`` per output folder: an exclusive ``flock`` on ``LOCK_FILE``, which names its holder. The
    kernel drops the lock when its holder dies, so a killed run's lock is taken over (its file only names it)."""
    import fcntl
    import socket
    import time

    with open(out_dir / LOCK_FILE, "a+") as f:
        for attempt in range(LOCK_TRIES):  # a killed run's workers may take a moment to exit and let go
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.1)
        else:
            f.seek(0)
            raise ValueError(f"`--output {out_dir}` is in use by another `lightning-para prepare` ({f.read().strip()});"
                             " wait for it to finish, or choose another `--output`.")
        f.seek(0)
        if previous := f.read().strip():
            print(f"prepare: taking over the lock of a run that ended without releasing it ({previous})", file=sys.stderr)
        f.truncate(0)
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)


def _earlier_shards(out_dir: Path, files: list[Path], fingerprint: str, dtype: np.dtype) -> list[dict[str, Any]]:
    """The finished shards earlier runs left in ``out_dir`` for inputs this run does not list: kept in meta.json
    when whole and of this tokenizer; any other is a ValueError (meta.json would not describe the folder)."""
    mine = {f"{SHARD_DIR}/{shard_name(p)}.bin" for p in files}
    kept: list[dict[str, Any]] = []
    for path in sorted((out_dir / SHARD_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("file") in mine:
            continue
        shard = out_dir / record.get("file", "")
        if record.get("tokenizer") != fingerprint or not shard.is_file() or \
                shard.stat().st_size != record.get("tokens", -1) * dtype.itemsize:
            raise ValueError(f"`--output {out_dir}` holds a shard of `{record.get('input')}` made with another tokenizer"
                             f" or cut short ({shard}); choose another `--output`, or delete it and its record ({path}).")
        kept.append(record)
    kept.sort(key=lambda r: r.get("input", ""))
    if kept:
        print(f"prepare: meta.json also lists {len(kept)} shard(s) an earlier run wrote to {out_dir}: "
              f"{', '.join(r['input'] for r in kept)}", file=sys.stderr)
    return kept


def prepare(
    tokenizer_dir: str, output: str, inputs: list[str], *, text_field: str = "text", workers: int = 1,
    eos_token: Optional[str] = None, progress: bool = True, errors: str = "strict",
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``output`` (see the module docstring); returns the written ``meta.json`` record."""
    if workers < 1:
        raise ValueError(f"`--workers {workers}` must be at least 1.")
    if errors not in ERRORS:
        raise ValueError(f"`--errors {errors}` is not one of {list(ERRORS)}.")
    folder = Path(tokenizer_dir).expanduser()
    if not folder.exists():
        raise ValueError(f"`--tokenizer {tokenizer_dir}` does not exist; pass a local folder holding tokenizer.json.")
    tokenizer = TokenizerText(folder, eos_token)  # fails here, before any worker starts
    files = expand_inputs(inputs)
    if len(set(files)) != len(files):
        raise ValueError("An input is listed twice (directly or inside a folder); list each file once.")
    out_dir = Path(output).expanduser()
    (out_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    with _output_lock(out_dir):
        for partial in (out_dir / SHARD_DIR).glob(".*.tmp"):  # an interrupted run's unfinished files
            partial.unlink(missing_ok=True)
        dtype = token_dtype(tokenizer.vocab_size)
        earlier = _earlier_shards(out_dir, files, tokenizer.fingerprint, dtype)
        records = _tokenize_all(files, out_dir, tokenizer, dtype, text_field, workers, eos_token, progress, errors)
        shards = [records[p] for p in files] + earlier
        meta = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": dtype.name,
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            **{k: sum(s.get(k, 0) for s in shards) for k in COUNTS},
            "tokenizer": {"name": tokenizer.name, "path": str(folder.resolve()), "vocab_size": tokenizer.vocab_size,
                          "eos_token": tokenizer.eos_token, "eos_id": tokenizer.eos_id, "fingerprint": tokenizer.fingerprint},
            "text_field": text_field, "shards": shards,
        }
        write_json_atomic(out_dir / META_FILE, meta)
    return meta


def _tokenize_all(files: list[Path], out_dir: Path, tokenizer: TokenizerText, dtype: np.dtype, text_field: str,
                  workers: int, eos_token: Optional[str], progress: bool, errors: str) -> dict[Path, dict[str, Any]]:
    """Every input's completion record: the finished ones read back, the others tokenized in ``workers`` processes."""
    records: dict[Path, dict[str, Any]] = {}
    for path in files:
        done = _finished(path, out_dir, tokenizer.fingerprint, dtype, errors)
        if done is not None:
            records[path] = done
    pending = [p for p in files if p not in records]
    from tqdm import tqdm  # a dependency of lightning

    if records:
        print(f"prepare: {len(records)} of {len(files)} inputs already done in {out_dir}; tokenizing {len(pending)}",
              file=sys.stderr)
    total_bytes = sum(p.stat().st_size for p in pending)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress, file=sys.stderr) as bar:
        with ProcessPoolExecutor(
            max_workers=min(workers, max(len(pending), 1)), initializer=_init_worker,
            initargs=(str(tokenizer.folder.resolve()), eos_token),
        ) as pool:
            futures = {pool.submit(tokenize_file, p, out_dir, text_field, errors): p for p in pending}
            for future in as_completed(futures):
                records[futures[future]] = future.result()
                bar.update(futures[future].stat().st_size)
    return records


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-para prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text, jsonl or parquet files, or folders of them")
    parser.add_argument("--tokenizer", required=True, help="a local Hugging Face tokenizer folder (tokenizer.json)")
    parser.add_argument("--output", required=True, help="the folder for the shards and meta.json")
    parser.add_argument("--text-field", default="text", help="the jsonl field / parquet column holding the text")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing files in parallel")
    parser.add_argument("--eos-token", default=None, help="the token that ends each document (default: the tokenizer's)")
    parser.add_argument("--errors", choices=ERRORS, default="strict",
                        help="invalid UTF-8: stop naming the file and byte (strict), U+FFFD (replace), drop the document (skip)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.tokenizer, args.output, args.inputs, text_field=args.text_field, workers=args.workers,
                       eos_token=args.eos_token, progress=not args.no_progress, errors=args.errors)
    except ValueError as err:
        print(f"lightning-para prepare: error: {err}", file=sys.stderr)
        return 2
    print(f"{meta['tokens']} tokens ({meta['dtype']}) in {meta['documents']} documents from {len(meta['shards'])} files"
          f" -> {Path(args.output) / META_FILE}")
    changed = {k: meta[k] for k in COUNTS if meta[k]}
    if changed:
        print("not tokenized as read: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in changed.items()))
    return 0


__all__ = ["main", "prepare"]
