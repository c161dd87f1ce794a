"""``lightning-para prepare`` and TokenDataModule: token counts, formats, dp sharding, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_para.cli.prepare import main as prepare_main
from lightning_para.cli.prepare import prepare
from lightning_para.recipes import TokenDataModule
from lightning_para.recipes.data import check_positions, check_vocab
from lightning_para.recipes.token_format import LLMC_MAGIC
from tests.token_data import EOS, stdlib_documents, text_folder, train_bpe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    texts = stdlib_documents(12)
    tokenizer = train_bpe(root / "tokenizer", texts, vocab_size=512)
    inputs = text_folder(root / "text", texts)
    meta = prepare(str(tokenizer), str(root / "out"), [str(inputs)], workers=2, progress=False)
    return SimpleNamespace(root=root, texts=texts, tokenizer=tokenizer, inputs=inputs, out=root / "out", meta=meta)


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _attach(dm, num_replicas: int, rank: int):
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}))
    return dm


def test_prepare_counts_the_tokenizers_own_tokens_plus_one_separator_per_document(corpus):
    tok = _tokenizer(corpus.tokenizer)
    own = [tok.encode(t, add_special_tokens=False).ids for t in corpus.texts]
    meta = corpus.meta
    assert meta["tokenizer"]["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert meta["documents"] == len(corpus.texts)
    assert meta["tokens"] == sum(map(len, own)) + len(corpus.texts)  # exactly one EOS per document
    eos = tok.token_to_id(EOS)
    assert meta["tokenizer"]["eos_id"] == eos
    # The shards are the documents' ids, each followed by EOS, in input order.
    stream = np.concatenate([np.fromfile(corpus.out / s["file"], dtype=np.uint16) for s in meta["shards"]])
    expected = np.concatenate([np.array(ids + [eos], dtype=np.uint16) for ids in own])
    np.testing.assert_array_equal(stream, expected)


def test_prepare_jsonl_and_parquet_documents(corpus, tmp_path):
    texts = corpus.texts[:4]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts[::-1]}), tmp_path / "b.parquet")
    meta = prepare(str(corpus.tokenizer), str(tmp_path / "out"), [str(jsonl), str(tmp_path / "b.parquet")],
                   text_field="body", progress=False)
    tok = _tokenizer(corpus.tokenizer)
    assert meta["documents"] == 8
    assert meta["tokens"] == 2 * sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    with pytest.raises(ValueError, match=r"line 1 has no `text` field \(it has \['body', 'id'\]\); set `--text-field`"):
        prepare(str(corpus.tokenizer), str(tmp_path / "out2"), [str(jsonl)], progress=False)


def test_prepare_rerun_skips_finished_inputs_and_redoes_an_interrupted_shard(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    first = prepare(str(corpus.tokenizer), str(out), [str(corpus.inputs)], progress=False)
    victim = first["shards"][3]
    # What an interrupt leaves: the record not yet written, the shard partly written under its hidden name,
    # and (an older crash) a finished-looking shard cut short.
    (out / victim["file"]).with_suffix(".json").unlink()
    (out / victim["file"]).rename(out / "shards" / f".{Path(victim['file']).stem}.12345.bin.tmp")
    other = first["shards"][5]
    with open(out / other["file"], "r+b") as f:
        f.truncate(10)
    (out / "meta.json").unlink()
    assert prepare_main(["--tokenizer", str(corpus.tokenizer), "--output", str(out), str(corpus.inputs)]) == 0
    err = capsys.readouterr().err
    assert f"{len(first['shards']) - 2} of {len(first['shards'])} inputs already done" in err
    again = json.loads((out / "meta.json").read_text())
    assert again["tokens"] == first["tokens"] == corpus.meta["tokens"]
    assert [s["tokens"] for s in again["shards"]] == [s["tokens"] for s in first["shards"]]


def test_token_datamodule_windows_dp_sharding_and_resume_at_another_dp(corpus):
    seq = 32
    stream = np.concatenate([np.fromfile(corpus.out / s["file"], dtype=np.uint16) for s in corpus.meta["shards"]])
    dm = TokenDataModule(str(corpus.out), seq_len=seq, global_batch_size=8, val_fraction=0.1)
    assert dm.vocab_size == 512
    assert dm.tokenizer.decode(dm.tokenizer.encode("def main():\n")) == "def main():\n"  # the recipes' text samples
    dm.setup()
    x, y = dm.splits["train"].sources[0][7]  # consecutive windows of the packed stream, across shard boundaries
    np.testing.assert_array_equal(x.numpy(), stream[7 * seq : 8 * seq])
    np.testing.assert_array_equal(y.numpy(), stream[7 * seq + 1 : 8 * seq + 1])
    assert len(dm.splits["train"].sources[0]) + len(dm.splits["val"]) == (len(stream) - 1) // seq

    def global_batches(dp: int, steps: int, state=None):
        loaders = [_attach(TokenDataModule(str(corpus.out), seq_len=seq, global_batch_size=8, val_fraction=0.1), dp, r)
                   .train_dataloader() for r in range(dp)]
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        iters = [iter(loader) for loader in loaders]
        out = []
        for _ in range(steps):
            per_rank = [next(it)[0] for it in iters]
            # a dp rank's samples are every dp-th of the global batch (DistributedSampler's interleave)
            merged = torch.stack(per_rank, 1).reshape(-1, seq)
            out.append(merged)
        return out, loaders[0].state_dict()

    one, _ = global_batches(1, 6)
    two, _ = global_batches(2, 6)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b)
    _, state = global_batches(2, 3)  # stopped after 3 steps at dp=2 ...
    resumed, _ = global_batches(4, 3, state)  # ... resumed at dp=4
    for a, b in zip(one[3:], resumed):
        torch.testing.assert_close(a, b)
    # tp/pp ranks of one dp slot: the same samples (the strategy hands them the same dp coordinate)
    same = [next(iter(_attach(TokenDataModule(str(corpus.out), seq_len=seq, global_batch_size=8), 2, 1)
                      .train_dataloader()))[0] for _ in range(2)]
    torch.testing.assert_close(same[0], same[1])


def test_nanogpt_and_llmc_bin_files_read_as_they_are(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) * 50
    tokens.tofile(tmp_path / "nanogpt.bin")
    header = np.zeros(256, dtype="<i4")
    header[:3] = (LLMC_MAGIC, 1, len(tokens))
    with open(tmp_path / "llmc.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(tokens[::-1].tobytes())
    dm = TokenDataModule(str(tmp_path / "nanogpt.bin"), seq_len=10, global_batch_size=4, val_path=str(tmp_path / "llmc.bin"),
                         vocab_size=50257)
    dm.setup()
    np.testing.assert_array_equal(dm.splits["train"].sources[0][2][0].numpy(), tokens[20:30])
    np.testing.assert_array_equal(dm.splits["val"][0][1].numpy(), tokens[::-1][1:11])
    assert dm.vocab_size == 50257
    # truncated files: a clear error, before training starts
    with open(tmp_path / "llmc.bin", "r+b") as f:
        f.truncate(1024 + 100)
    with pytest.raises(ValueError, match=r"truncated or corrupt: its llm.c header promises 1000 tokens"):
        TokenDataModule(str(tmp_path / "llmc.bin"), seq_len=10)
    with open(tmp_path / "nanogpt.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="odd number of bytes"):
        TokenDataModule(str(tmp_path / "nanogpt.bin"), seq_len=10)


def test_bad_input_is_a_clear_error(corpus, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(corpus.out, out)
    meta = json.loads((out / "meta.json").read_text())
    dm = TokenDataModule(str(out), seq_len=16)
    with pytest.raises(ValueError, match=r"the data's tokenizer has 512 tokens but the model's `vocab_size=256`"):
        check_vocab(256, dm)
    check_vocab(512, dm)
    with pytest.raises(ValueError, match=r"`data.seq_len=16` is longer than the model's 8 positions"):
        check_positions(8, dm)
    shard = out / meta["shards"][1]["file"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with pytest.raises(ValueError, match="is truncated or was changed.*re-run `lightning-para prepare`"):
        TokenDataModule(str(out), seq_len=16)
    shard.unlink()
    with pytest.raises(ValueError, match="which is missing"):
        TokenDataModule(str(out), seq_len=16)
    with pytest.raises(ValueError, match="neither `meta.json`"):
        TokenDataModule(str(tmp_path), seq_len=16)
    with pytest.raises(ValueError, match="fewer than `data.global_batch_size=100000`"):
        TokenDataModule(str(corpus.out), seq_len=16, global_batch_size=100000).setup()
    assert prepare_main(["--tokenizer", str(tmp_path / "nope"), "--output", str(tmp_path / "o"), str(corpus.inputs)]) == 2
    no_eos = tmp_path / "tok"
    no_eos.mkdir()
    tok = json.loads((corpus.tokenizer / "tokenizer.json").read_text())
    (no_eos / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="--eos-token"):
        prepare(str(no_eos), str(tmp_path / "o"), [str(corpus.inputs)], eos_token="<nope>", progress=False)


def test_prepare_killed_midway_then_rerun_counts_every_document_once(corpus, tmp_path):
    """A real interruption: `lightning-para prepare` is killed (SIGKILL) once its first shard is recorded."""
    import os
    import signal
    import subprocess
    import sys
    import time

    texts = [t * 20 for t in corpus.texts]  # ~120 KB per file: tokenizing them all takes seconds
    inputs = text_folder(tmp_path / "big", texts * 2)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lightning_para.cli", "prepare", "--tokenizer", str(corpus.tokenizer),
               "--output", str(out), "--no-progress", str(inputs)]
    # its own process group, killed whole, as Ctrl-C or a scheduler's cancel stops it and its workers
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((out / "shards").glob("*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list((out / "shards").glob("*.json")))
    assert not (out / "meta.json").exists() and 1 <= done < len(texts) * 2, done  # really cut short
    meta = prepare(str(corpus.tokenizer), str(out), [str(inputs)], progress=False)
    tok = _tokenizer(corpus.tokenizer)
    expected = 2 * sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    assert meta["documents"] == len(texts) * 2 and meta["tokens"] == expected
    assert not list((out / "shards").glob(".*"))  # no partial files left behind


def test_prepare_locks_its_output_and_takes_over_a_dead_runs_lock(corpus, tmp_path, capsys):
    """A second run into a folder in use is refused, naming the first (a real flock held by this process); a lock
    file a killed run left (no flock) is taken over."""
    import os
    import socket

    from lightning_para.cli.prepare import LOCK_FILE, _output_lock

    out = tmp_path / "out"
    out.mkdir()
    with _output_lock(out):
        holder = f"pid {os.getpid()} on host {socket.gethostname()}"
        with pytest.raises(ValueError, match=f"in use by another `lightning-para prepare` \\({holder}, started"):
            prepare(str(corpus.tokenizer), str(out), [str(corpus.inputs)], progress=False)
    (out / LOCK_FILE).write_text("pid 999999 on host elsewhere, started 2026-01-01 00:00:00")
    (out / "shards" / ".abc.999999.bin.tmp").write_bytes(b"half")  # what the dead run left
    meta = prepare(str(corpus.tokenizer), str(out), [str(corpus.inputs)], progress=False)
    assert "taking over the lock of a run that ended without releasing it (pid 999999" in capsys.readouterr().err
    assert meta["tokens"] == corpus.meta["tokens"] and not list((out / "shards").glob(".*"))
    assert (out / LOCK_FILE).read_text() == ""  # released


def test_prepare_meta_lists_every_shard_in_the_folder(corpus, tmp_path, capsys):
    """A second run with other inputs keeps the first run's shards in meta.json and says so; a shard of another
    tokenizer left in the folder is an error naming it."""
    out = tmp_path / "out"
    files = sorted(corpus.inputs.iterdir())
    first = prepare(str(corpus.tokenizer), str(out), [str(f) for f in files[:3]], progress=False)
    second = prepare(str(corpus.tokenizer), str(out), [str(f) for f in files[3:5]], progress=False)
    assert "meta.json also lists 3 shard(s) an earlier run wrote" in capsys.readouterr().err
    assert {s["input"] for s in second["shards"]} == {str(f) for f in files[:5]}
    assert second["tokens"] == first["tokens"] + sum(s["tokens"] for s in second["shards"][:2])
    record = out / second["shards"][0]["file"].replace(".bin", ".json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "tokenizer": "another"}))
    with pytest.raises(ValueError, match="holds a shard of .* made with another tokenizer"):
        prepare(str(corpus.tokenizer), str(out), [str(files[6])], progress=False)


def test_prepare_invalid_utf8_and_null_texts_are_named_or_counted(corpus, tmp_path):
    text = tmp_path / "bad.txt"
    text.write_bytes(b"good text \xff\xfe and more \xc3")
    lines = tmp_path / "bad.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n{"text": null}\n{"text": "caf\xe9"}\n{"text": "ok"}\n')
    tok = str(corpus.tokenizer)
    with pytest.raises(ValueError, match=r"`.*bad\.txt` at byte 10 is not valid UTF-8 .*--errors replace"):
        prepare(tok, str(tmp_path / "a"), [str(text)], progress=False)
    with pytest.raises(ValueError, match=r"`.*bad\.jsonl` line 3 \(byte 45\) is not valid UTF-8"):
        prepare(tok, str(tmp_path / "b"), [str(lines)], progress=False)
    replaced = prepare(tok, str(tmp_path / "c"), [str(text), str(lines)], progress=False, errors="replace")
    # \xff, \xfe and the cut-off \xc3 in the text file, \xe9 in the jsonl: 4 sequences, each one U+FFFD
    assert (replaced["replaced_invalid_utf8"], replaced["skipped_null"], replaced["documents"]) == (4, 1, 4)
    skipped = prepare(tok, str(tmp_path / "d"), [str(text), str(lines)], progress=False, errors="skip")
    assert (skipped["skipped_invalid_utf8"], skipped["skipped_null"], skipped["documents"]) == (2, 1, 2)
    tokenizer = _tokenizer(corpus.tokenizer)
    assert skipped["tokens"] == sum(len(tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in ("fine", "ok"))


def test_prepare_token_dtype_follows_the_largest_id(corpus, tmp_path):
    """A tokenizer with 513 entries, one of them id 70000: uint32 and an id space of 70001, not uint16 and an
    overflow."""
    folder = tmp_path / "tok"
    folder.mkdir()
    spec = json.loads((corpus.tokenizer / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<far>"] = 70000
    spec["added_tokens"].append({"id": 70000, "content": "<far>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<far>"}))
    meta = prepare(str(folder), str(tmp_path / "out"), [str(sorted(corpus.inputs.iterdir())[0])], progress=False)
    assert (meta["dtype"], meta["tokenizer"]["vocab_size"], meta["tokenizer"]["eos_id"]) == ("uint32", 70001, 70000)
    stream = np.fromfile(tmp_path / "out" / meta["shards"][0]["file"], dtype=np.uint32)
    assert stream[-1] == 70000 and len(stream) == meta["tokens"]
