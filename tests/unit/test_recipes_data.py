"""Byte tokenizer and TextDataModule: splits, dp-sub-mesh sampling, bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_para.recipes.data import ByteTokenizer, TextDataModule, TokenWindows, check_vocab, stdlib_source_files


def _attach(dm: TextDataModule, num_replicas: int, rank: int) -> TextDataModule:
    """What ParaStrategy exposes: one sample stream per dp coordinate."""
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}))
    return dm


def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(["<|endoftext|>", "<pad>"])
    assert tok.vocab_size == 258
    text = "déf f(x):\n    return 'ü' * 2  # 😀"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    eot = tok.special_id("<|endoftext|>")
    assert eot == 256
    assert tok.decode(ids[:4] + [eot] + ids[4:]) == text[:3] + "<|endoftext|>" + text[3:]  # "dé" + "f" = 4 bytes
    # A sampled sequence can cut a UTF-8 character; decoding still succeeds.
    assert tok.decode([0xC3]) == "\ufffd"
    with pytest.raises(ValueError, match="outside this tokenizer's vocabulary"):
        tok.decode([258])
    with pytest.raises(ValueError, match="duplicates"):
        ByteTokenizer(["<a>", "<a>"])


def test_token_windows_are_next_token_pairs():
    tokens = torch.arange(20, dtype=torch.uint8)
    ds = TokenWindows(tokens, seq_len=4)
    assert len(ds) == 4  # windows of 5 tokens every 4: starts 0, 4, 8, 12 (16 needs tokens up to 20)
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert x.dtype == torch.long


def test_default_is_the_stdlib_source_deterministic_and_split_by_position():
    files = stdlib_source_files()
    assert files and files == stdlib_source_files()
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    a, b = TextDataModule(max_bytes=200_000, seq_len=32), TextDataModule(max_bytes=200_000, seq_len=32)
    a.setup(), b.setup()
    for split in ("train", "val", "test"):
        assert torch.equal(a.splits[split].tokens, b.splits[split].tokens)
    sizes = {k: len(v.tokens) for k, v in a.splits.items()}
    total = sum(sizes.values())
    assert total >= 200_000  # the byte budget plus one separator per file
    assert sizes["val"] == int(total * 0.05) and sizes["test"] == int(total * 0.05)
    # val follows train in the stream: its first tokens are not the start of any training window
    assert not torch.equal(a.splits["val"].tokens[:64], a.splits["train"].tokens[:64])


def test_dp_sub_mesh_sampling_partitions_the_global_batch(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"{i:05d}" for i in range(2000)))  # every window distinct
    batches = {}
    for rank in range(2):
        dm = _attach(TextDataModule(str(path), seq_len=16, global_batch_size=8, shuffle=True), 2, rank)
        loader = dm.train_dataloader()
        assert loader.batch_size == 4  # global 8 over dp=2
        batches[rank] = [x for x, _ in loader]
    # same dp coordinate -> same batches (what every tp/pp rank of that slot loads)
    again = [x for x, _ in _attach(TextDataModule(str(path), seq_len=16, global_batch_size=8), 2, 0).train_dataloader()]
    assert all(torch.equal(p, q) for p, q in zip(again, batches[0]))
    # different dp coordinates -> disjoint halves of exactly the global batch one device loads,
    # step by step: the losses of a run do not depend on the layout
    single = [x for x, _ in _attach(TextDataModule(str(path), seq_len=16, global_batch_size=8), 1, 0).train_dataloader()]
    assert len(single) == len(batches[0]) == len(batches[1]) > 3
    for step, full in enumerate(single):
        parts = [tuple(r) for r in torch.cat([batches[0][step], batches[1][step]]).tolist()]
        assert sorted(parts) == sorted(tuple(r) for r in full.tolist())
        assert not set(map(tuple, batches[0][step].tolist())) & set(map(tuple, batches[1][step].tolist()))
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree dp=3"):
        _attach(TextDataModule(str(path), seq_len=16, global_batch_size=8), 3, 0).train_dataloader()


def test_folder_and_bad_paths(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# title\n" * 50)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 10)
    dm = TextDataModule(str(tmp_path), seq_len=8, global_batch_size=2)
    assert [f.name for f in dm.files] == ["a.txt", "b.md"]
    with pytest.raises(ValueError, match=r"`data.path='/no/such/file.txt'` does not exist"):
        TextDataModule("/no/such/file.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is an empty file"):
        TextDataModule(str(empty))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no non-empty files ending in"):
        TextDataModule(str(tmp_path / "nothing"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 30)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        TextDataModule(str(tiny), seq_len=16).setup()
    with pytest.raises(ValueError, match="global_batch_size"):
        TextDataModule(global_batch_size=0)


def test_vocab_mismatch_message():
    dm = TextDataModule(max_bytes=10_000, special_tokens=["<|endoftext|>"])
    with pytest.raises(ValueError, match=r"tokenizer has 257 tokens but the model's `vocab_size=256`"):
        check_vocab(256, dm)
    check_vocab(257, dm)
