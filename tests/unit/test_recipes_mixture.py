"""Weighted mixtures of prepared corpora in TokenDataModule: realised shares, exact resume at another dp after a
source wrapped, a changed mixture refused or restarted explicitly, ``stop``, and a YAML config through the CLI."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_para.cli.prepare import prepare
from lightning_para.recipes import TokenDataModule
from lightning_para.recipes.mixture import Mixture
from tests.token_data import stdlib_documents, text_folder, train_bpe

SEQ, BATCH = 16, 8
WEIGHTS = {"web": 0.4, "code": 0.25, "math": 0.15, "books": 0.1, "tiny": 0.1}
# documents of each source (of 16 stdlib files): "tiny" (1,500 characters) holds ~35 sequences, read 200 times
# in 2,000 samples
SPLIT = {"web": slice(0, 6), "code": slice(6, 10), "math": slice(10, 13), "books": slice(13, 15), "tiny": slice(15, 16)}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    texts = stdlib_documents(16, max_chars=4000)
    texts[15] = texts[15][:1500]
    tokenizer = train_bpe(root / "tokenizer", texts, vocab_size=512)
    paths = {}
    for name, part in SPLIT.items():
        paths[name] = str(root / name)
        prepare(str(tokenizer), paths[name], [str(text_folder(root / f"{name}-text", texts[part]))], progress=False)
    return SimpleNamespace(root=root, paths=paths, tokenizer=tokenizer)


def _module(corpora, weights=WEIGHTS, dp=1, rank=0, **kwargs) -> TokenDataModule:
    sources = {name: (corpora.paths[name], w) for name, w in weights.items()}
    dm = TokenDataModule(sources=sources, seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.0, seed=7, **kwargs)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}))
    return dm


def _epochs(loader):
    """The loader's batches over consecutive epochs, as Lightning's fit loop sets them."""
    while True:
        yield from loader
        loader.sampler.set_epoch(loader.sampler.epoch + 1)


def _global_batches(corpora, dp: int, steps: int, state=None, **kwargs) -> tuple[list[torch.Tensor], dict]:
    """``steps`` global batches of token windows as dp simulated ranks load them (rank r holds every dp-th)."""
    loaders = [_module(corpora, dp=dp, rank=r, **kwargs).train_dataloader() for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    iters = [_epochs(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        per_rank = [next(it) for it in iters]
        x = torch.stack([b[0] for b in per_rank], 1).reshape(-1, SEQ)
        y = torch.stack([b[1] for b in per_rank], 1).reshape(-1, SEQ)
        out.append(torch.cat([x, y[:, -1:]], 1))  # the whole window: seq_len + 1 tokens
    return out, loaders[0].state_dict()


def _sources_of(dm: TokenDataModule, windows: torch.Tensor) -> list[str]:
    """Which source each window is from, by its tokens (no source holds another's window)."""
    owner: dict[bytes, str] = {}
    for name, seqs in zip(dm.mixture.names, dm.splits["train"].sources):
        for i in range(len(seqs)):
            key = seqs.window(i).astype(np.int64).tobytes()
            assert owner.setdefault(key, name) == name, "two sources share a window; the test cannot tell them apart"
    return [owner[w.numpy().tobytes()] for w in windows]


def test_realised_token_shares_match_the_weights_over_2000_samples(corpora):
    dm = _module(corpora)
    sizes = dict(zip(dm.mixture.names, dm.mixture.sizes.tolist()))
    assert sizes["tiny"] * 3 < 0.1 * 2000 < sizes["web"]  # the small source wraps, the large one does not
    batches, _ = _global_batches(corpora, 1, 2000 // BATCH)
    names = _sources_of(dm, torch.cat(batches))
    tokens = {n: names.count(n) * (SEQ + 1) for n in WEIGHTS}  # every sample is seq_len + 1 tokens
    shares = {n: t / sum(tokens.values()) for n, t in tokens.items()}
    assert all(abs(shares[n] - w) <= 0.02 for n, w in WEIGHTS.items()), shares
    assert dm.mixture.proportions(0, 2000) == pytest.approx(shares, abs=1e-12)  # what the module reports
    # every pass of the small source is a new permutation of all its sequences
    tiny = dm.splits["train"].sources[list(WEIGHTS).index("tiny")]
    seen = [w for w, n in zip(torch.cat(batches), names) if n == "tiny"]
    first, second = seen[: len(tiny)], seen[len(tiny) : 2 * len(tiny)]
    whole = sorted(tiny.window(i).astype(np.int64).tobytes() for i in range(len(tiny)))
    assert sorted(w.numpy().tobytes() for w in first) == whole == sorted(w.numpy().tobytes() for w in second)
    assert [w.numpy().tobytes() for w in first] != [w.numpy().tobytes() for w in second]


def test_resume_after_a_source_wrapped_at_dp4_from_dp2_continues_the_exact_token_stream(corpora):
    full, _ = _global_batches(corpora, 2, 250)  # an epoch is 230 steps: the resumed run crosses into the next
    _, state = _global_batches(corpora, 2, 100)  # stopped after 100 steps at dp=2 ...
    tiny = state["mixture"]["sources"]["tiny"]
    assert tiny["draws"] > tiny["samples"]  # ... after the small source's first pass
    for dp in (4, 1):  # ... resumed at dp=4 (2 sequences per rank, was 4) and on one rank
        resumed, _ = _global_batches(corpora, dp, 150, state)
        assert all(torch.equal(a, b) for a, b in zip(full[100:], resumed, strict=True))
    # the global batches do not depend on dp either
    assert all(torch.equal(a, b) for a, b in zip(_global_batches(corpora, 8, 20)[0], full))


def test_a_changed_mixture_is_refused_or_restarted_explicitly(corpora, monkeypatch):
    _, state = _global_batches(corpora, 2, 60)
    changed = {**WEIGHTS, "code": 0.35}
    with pytest.raises(ValueError, match=r"source 'code' has weight .*`data.on_mixture_change='restart_mixture'`"):
        _global_batches(corpora, 2, 1, state, weights=changed)
    smaller = {n: w for n, w in WEIGHTS.items() if n != "books"}
    with pytest.raises(ValueError, match=r"source 'books' was removed"):
        _global_batches(corpora, 2, 1, state, weights=smaller)
    # restart_mixture: every source continues from its saved position, in its own order
    dm = _module(corpora, changed)
    resumed, state2 = _global_batches(corpora, 4, 40, state, weights=changed, on_mixture_change="restart_mixture")
    names = _sources_of(dm, torch.cat(resumed))
    for d, name in enumerate(dm.mixture.names):
        seqs = dm.splits["train"].sources[d]
        alone = Mixture([name], [1.0], [len(seqs)], seed=7)  # the source's own order: draw k at position k
        start = state["mixture"]["sources"][name]["draws"]
        got = [w.numpy().tobytes() for w, n in zip(torch.cat(resumed), names) if n == name]
        expected = [seqs.window(alone.locate(start + k)[1]).astype(np.int64).tobytes() for k in range(len(got))]
        assert got == expected, name
    assert dm.mixture.proportions(0, 10**5)["code"] == pytest.approx(0.35 / 1.1, abs=0.01)
    # A checkpoint written after the restart resumes exactly: the restart point travels in the state.
    further, _ = _global_batches(corpora, 4, 60, state, weights=changed, on_mixture_change="restart_mixture")
    again, _ = _global_batches(corpora, 2, 20, state2, weights=changed)
    assert all(torch.equal(a, b) for a, b in zip(further[40:], again))
    # planted bug: the restart point not restored from the checkpoint -> the stream moves (the check above fails)
    monkeypatch.setattr(Mixture, "resume", lambda self, saved, g, on_change: self.check(saved, on_change) and None)
    planted, _ = _global_batches(corpora, 2, 20, state2, weights=changed)
    assert not all(torch.equal(a, b) for a, b in zip(further[40:], planted))


def test_stop_ends_the_epoch_where_the_first_source_runs_out():
    m = Mixture(["big", "small"], [0.7, 0.3], [1000, 90], seed=3, exhausted="stop")
    for epoch in range(2):
        drawn = [m.locate(g) for g in range(epoch * m.epoch_samples, (epoch + 1) * m.epoch_samples)]
        assert len(set(drawn)) == len(drawn)  # nothing read twice within an epoch
        assert sum(d == 1 for d, _ in drawn) == 90  # the small source read exactly once
        assert abs(sum(d == 0 for d, _ in drawn) / len(drawn) - 0.7) < 0.02
    assert m.draws(m.epoch_samples).tolist() == [1000, 90]  # epoch 1 starts every source's next pass
    with pytest.raises(ValueError, match=r"`data.sources\['small'\]` has weight 0"):
        Mixture(["big", "small"], [0.7, 0], [10, 10])
    # a weight far below 1/1024: the blocks grow so every source is in each (counts never fall)
    rare = Mixture(["a", "b"], [1.0, 1e-4], [10, 10])
    counts = np.array([rare.draws(g) for g in range(0, 40_000, 997)])
    assert (np.diff(counts, axis=0) >= 0).all() and rare.proportions(0, 20002)["b"] == pytest.approx(2 / 20002)


def test_bad_mixtures_are_clear_errors(corpora):
    with pytest.raises(ValueError, match=r"Give `data.path` \(one corpus\) or `data.sources`"):
        TokenDataModule(path=corpora.paths["web"], sources={"web": (corpora.paths["web"], 1.0)})
    with pytest.raises(ValueError, match=r"`data.exhausted` must be one of"):
        TokenDataModule(sources={"web": (corpora.paths["web"], 1.0)}, exhausted="wrap")
    texts = stdlib_documents(2)
    other = train_bpe(corpora.root / "other-tokenizer", texts, vocab_size=300)
    prepare(str(other), str(corpora.root / "other"), [str(text_folder(corpora.root / "other-text", texts))], progress=False)
    with pytest.raises(ValueError, match=r"`data.sources\['other'\]` was tokenized with vocabulary 300 .* the first source with 512"):
        TokenDataModule(sources={"web": (corpora.paths["web"], 1.0), "other": (str(corpora.root / "other"), 1.0)})


def test_a_mixture_from_a_yaml_config_through_the_cli(corpora, tmp_path, monkeypatch):
    from lightning_para.cli import ParaCLI
    from lightning_para.recipes import config_path

    monkeypatch.setattr("sys.argv", ["lightning-para"])
    (tmp_path / "data.yaml").write_text(
        "data:\n  class_path: lightning_para.recipes.TokenDataModule\n  init_args:\n    seq_len: 16\n"
        "    global_batch_size: 16\n    exhausted: stop\n    sources:\n"
        f"      web: [{corpora.paths['web']}, 0.7]\n      code: [{corpora.paths['code']}, 0.3]\n"
    )
    cli = ParaCLI(args=["--config", str(config_path("gpt-cpu-demo")), "--config", str(tmp_path / "data.yaml"),
                        "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
                        "--model.init_args.vocab_size", "512"], run=False)
    dm = cli.datamodule
    assert dm.weights == {"web": 0.7, "code": 0.3} and dm.exhausted == "stop"
    assert dm.mixture.proportions(0, dm.mixture.epoch_samples)["web"] == pytest.approx(0.7, abs=0.01)
