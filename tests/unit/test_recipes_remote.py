"""Remote shards: a prepared corpus served by a real local HTTP server (range requests) trains on the same token
stream as its local copy; a connection dropped mid-shard is retried from the range it stopped in; the local cache
stays under its bound; shards are fetched ahead in the background; missing packages and URLs are clear errors."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_para.cli.prepare import prepare
from lightning_para.recipes import TokenDataModule, shard_cache
from tests.http_server import serve
from tests.token_data import stdlib_documents, text_folder, train_bpe

SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    texts = stdlib_documents(8, max_chars=3000)
    tokenizer = train_bpe(root / "tokenizer", texts, vocab_size=512)
    prepare(str(tokenizer), str(root / "corpus"), [str(text_folder(root / "text", texts))], progress=False)
    meta = json.loads((root / "corpus" / "meta.json").read_text())
    with serve(root) as server:
        yield SimpleNamespace(root=root, server=server, meta=meta, url=f"{server.url}/corpus")


def _epoch(path, **kwargs) -> tuple[list[torch.Tensor], TokenDataModule]:
    dm = TokenDataModule(path, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, seed=1, **kwargs)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}))
    return [torch.cat([x, y[:, -1:]], 1) for x, y in dm.train_dataloader()], dm


def _folder_bytes(folder) -> int:
    """Bytes of the cache's shards and downloads; the fetch thread renames a ``.part`` while this lists them."""
    total = 0
    for p in folder.iterdir():
        if p.suffix in (".bin", ".part"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # renamed to its .bin (listed or not) or evicted meanwhile
                pass
    return total


def test_remote_shards_give_the_local_token_stream_and_a_dropped_connection_is_retried(served, tmp_path, monkeypatch):
    monkeypatch.setattr(shard_cache, "CHUNK", 512)  # a shard in several ranges: the drop is mid-shard
    victim = "/corpus/" + served.meta["shards"][2]["file"]
    assert served.meta["shards"][2]["tokens"] * 2 > 3 * 512
    served.server.drop_once.add((victim, 1024))
    local, _ = _epoch(str(served.root / "corpus"))
    remote, dm = _epoch(served.url, cache_dir=str(tmp_path / "cache"))
    assert len(local) == len(remote) > 10 and all(torch.equal(a, b) for a, b in zip(local, remote))
    asked = [(start, cut) for path, start, _, cut in served.server.log if path == victim]
    assert asked[:4] == [(0, False), (512, False), (1024, True), (1024, False)]  # the cut range again, not the shard
    assert dm.cache.downloads == len(served.meta["shards"])  # each shard fetched once
    # two DataLoader workers (forked: each its own fetching thread) share the folder and read the same stream
    workers, _ = _epoch(served.url, cache_dir=str(tmp_path / "workers"), num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(local, workers, strict=True))
    # nanoGPT / llm.c .bin files by their URLs
    tokens = np.arange(1000, dtype=np.uint16) * 7
    tokens.tofile(served.root / "nanogpt.bin")
    bin_dm = TokenDataModule(f"{served.server.url}/nanogpt.bin", seq_len=10, global_batch_size=4, vocab_size=50257,
                             val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    bin_dm.setup()
    np.testing.assert_array_equal(bin_dm.splits["train"].sources[0][5][0].numpy(), tokens[50:60])


def _bounded_run(served, cache, bound: int, batches: int) -> tuple[list[torch.Tensor], int, TokenDataModule]:
    """``batches`` batches read through a cache of ``bound`` bytes, and the most the folder held after any batch."""
    dm = TokenDataModule(served.url, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, seed=1,
                         cache_dir=str(cache), cache_bytes=bound)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}))
    seen, most = [], 0
    for (x, y), _ in zip(dm.train_dataloader(), range(batches)):  # shuffled: each batch reads shards all over
        seen.append(torch.cat([x, y[:, -1:]], 1))
        most = max(most, _folder_bytes(cache))
    return seen, most, dm


def test_the_cache_stays_under_its_bound_and_fetches_ahead(served, tmp_path, monkeypatch):
    bound = int(2.5 * max(s["tokens"] for s in served.meta["shards"]) * 2)  # two and a half shards of eight
    local, _ = _epoch(str(served.root / "corpus"))
    seen, most, dm = _bounded_run(served, tmp_path / "small", bound, 12)
    assert all(torch.equal(a, b) for a, b in zip(local, seen))
    assert most <= bound and dm.cache.peak_bytes <= bound  # after every batch, and at every reservation
    assert dm.cache.downloads > len(served.meta["shards"])  # shards were evicted and fetched again
    # planted bug: eviction that ignores the bound -> the folder outgrows it (the check above fails)
    with monkeypatch.context() as planted:
        planted.setattr(shard_cache.ShardCache, "_make_room", lambda self, nbytes, keep: True)
        assert _bounded_run(served, tmp_path / "planted", bound, 4)[1] > bound
    # fetched ahead, in the background: after one read, the coming positions' shards arrive with no further read
    ahead = tmp_path / "ahead"
    dm = TokenDataModule(served.url, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, cache_dir=str(ahead))
    dm.setup()
    dm.splits["train"][0]
    deadline = time.monotonic() + 30
    while len(list(ahead.glob("*.bin"))) < len(served.meta["shards"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(list(ahead.glob("*.bin"))) == len(served.meta["shards"])  # 32 positions ahead touch every shard
    # a bound below one shard: named, with the size to set
    tiny = TokenDataModule(served.url, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, cache_dir=str(tmp_path / "t"),
                           cache_bytes=100)
    tiny.setup()
    with pytest.raises(ValueError, match=r"more than `data.cache_bytes=100`. Set `data.cache_bytes` to at least"):
        tiny.splits["train"][0]


def test_remote_errors_name_the_url_and_the_fix(served, monkeypatch):
    with pytest.raises(ValueError, match=r"`data.path='http://127.0.0.1:\d+/nope'` was not found"):
        TokenDataModule(f"{served.server.url}/nope")
    monkeypatch.setitem(sys.modules, "fsspec.core", None)  # fsspec not installed
    with pytest.raises(ImportError, match=r"needs fsspec \(pip install 'lightning-para\[remote\]'\)"):
        TokenDataModule(served.url)
