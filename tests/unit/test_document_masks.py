"""Document masks on one device: the data's document ids and positions, ``document_attention``, and the three
model families (the recipe GPT, transformers' Llama, LitGPT) computing each packed document as if it ran alone.

Tolerance 1e-5 (fp32): the packed and the alone run do the same math on the same rows, except that the packed
attention's softmax also meets masked (-inf) keys; measured differences are ~5e-6 on logits of magnitude ~10.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_para.parallel.context.documents import causal_document_mask, document_attention
from lightning_para.recipes.documents import document_ids, document_positions
from lightning_para.recipes.tokens import TokenDataModule
from tests.document_models import (
    PackedDocuments, documents_alone, gpt, gpt2_style, hf_llama, litgpt, planted_mask_off,
)

ATOL = 1e-5


def _max_error_alone(logits_of, dataset: PackedDocuments, windows=range(5)) -> float:
    """The largest |packed - alone| over the documents of ``windows``: ``logits_of(batch)`` on the packed
    window (with its documents) against ``logits_of((x,))`` on each document alone."""
    worst = 0.0
    for i in windows:
        packed = logits_of((dataset.x[i : i + 1], dataset.documents[i : i + 1], dataset.positions[i : i + 1]))
        for where, tokens in documents_alone(dataset, i):
            worst = max(worst, (packed[:, where] - logits_of((tokens,))).abs().max().item())
    return worst


def test_document_ids_and_positions_follow_the_eos_ids():
    tokens = torch.tensor([[5, 0, 3, 4, 0, 0, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]])
    docs = document_ids(tokens, eos_id=0)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [0] * 8]  # an EOS ends (and belongs to) its document
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], list(range(8))]


def test_token_datamodule_adds_documents_when_asked(tmp_path):
    stream = np.array([3, 4, 0, 5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7], dtype=np.uint16)
    stream.tofile(tmp_path / "a.bin")
    path = str(tmp_path / "a.bin")
    plain = TokenDataModule(path, seq_len=8, global_batch_size=1, val_fraction=0.0)
    plain.setup()
    assert len(plain.splits["train"][0]) == 2  # off by default: (x, y)
    dm = TokenDataModule(path, seq_len=8, global_batch_size=1, val_fraction=0.0, document_mask=True, eos_id=0,
                         reset_positions=True)
    dm.setup()
    x, y, docs, positions = dm.splits["train"][0]
    assert x.tolist() == [3, 4, 0, 5, 6, 7, 0, 8] and y.tolist() == [4, 0, 5, 6, 7, 0, 8, 9]
    assert docs.tolist() == [0, 0, 0, 1, 1, 1, 1, 2] and positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    dm = TokenDataModule(path, seq_len=8, global_batch_size=1, val_fraction=0.0, document_mask=True, eos_id=0)
    dm.setup()
    assert len(dm.splits["train"][1]) == 3 and dm.splits["train"][1][2].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]


def test_document_options_are_checked_naming_the_option(tmp_path):
    np.arange(1, 100, dtype=np.uint16).tofile(tmp_path / "a.bin")
    path = str(tmp_path / "a.bin")
    with pytest.raises(ValueError, match=r"`data.reset_positions=True` .* set `data.document_mask=True` too"):
        TokenDataModule(path, seq_len=8, reset_positions=True)
    with pytest.raises(ValueError, match=r"`data.document_mask=True` finds documents by their EOS id.*`data.eos_id`"):
        TokenDataModule(path, seq_len=8, document_mask=True)
    # A model that does not say it takes document ids is refused before training starts.
    dm = TokenDataModule(path, seq_len=8, global_batch_size=1, document_mask=True, eos_id=0)
    dm.trainer = SimpleNamespace(lightning_module=torch.nn.Linear(1, 1))
    refused = r"`Linear` does not declare `accepts_documents = True`.*`data.document_mask=False`"
    with pytest.raises(ValueError, match=refused):
        dm.setup()
    dm.trainer = SimpleNamespace(lightning_module=gpt())
    dm.setup()


def test_document_attention_backends_match_each_document_alone():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 4 + [1] * 8 + [2] * 4])
    sdpa = document_attention(q, k, v, docs, enable_gqa=True)
    flex = document_attention(q, k, v, docs, enable_gqa=True, backend="flex")  # eager FlexAttention on CPU
    torch.testing.assert_close(flex, sdpa, atol=ATOL, rtol=0)
    for doc in range(3):
        rows = (docs[0] == doc).nonzero()[:, 0]
        alone = F.scaled_dot_product_attention(q[:1, :, rows], k[:1, :, rows], v[:1, :, rows], is_causal=True,
                                               enable_gqa=True)
        torch.testing.assert_close(sdpa[:1, :, rows], alone, atol=ATOL, rtol=0)
    assert causal_document_mask(docs)[0, 0, 6].tolist() == [False] * 5 + [True] * 2 + [False] * 9
    with pytest.raises(ValueError, match=r"`document_ids` must be an integer tensor \[batch, seq\] = \[2, 16\]"):
        document_attention(q, k, v, docs[:, :8], enable_gqa=True)


@pytest.mark.parametrize("model", [gpt, gpt2_style], ids=["rope", "learned"])
def test_gpt_packed_logits_equal_each_document_alone(model):
    torch.manual_seed(0)
    module = model().eval()
    dataset = PackedDocuments(5)
    assert _max_error_alone(lambda batch: module(*batch), dataset) < ATOL
    # Without the mask the later documents see the earlier ones: the check can fail.
    cross = (module(dataset.x[:1])[:, 4:12] - module(dataset.x[:1, 4:12])).abs().max().item()  # document 1 of 3
    assert cross > 1.0


def test_planted_bug_mask_off_in_one_layer_fails_the_check():
    torch.manual_seed(0)
    module = planted_mask_off().eval()
    assert _max_error_alone(lambda batch: module(*batch), PackedDocuments(5)) > 0.1


def test_gpt_pipeline_layers_carry_the_documents():
    torch.manual_seed(0)
    module = gpt().eval()
    spec = module.configure_pipeline()
    dataset = PackedDocuments(2)
    inputs, targets = spec.split_batch((dataset.x, dataset.y, dataset.documents, dataset.positions))
    assert len(inputs) == 3 and targets is not None
    x = inputs
    for layer in spec.layers:  # the stream is (hidden, document_ids, position_ids) from layer to layer
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    torch.testing.assert_close(x, module(*inputs))


def test_hf_llama_packed_logits_equal_each_document_alone():
    torch.manual_seed(0)
    module = hf_llama().eval()

    def logits(batch):
        return module(batch[0], position_ids=batch[2] if len(batch) > 1 else None)

    assert _max_error_alone(logits, PackedDocuments(5)) < ATOL
    with pytest.raises(ValueError, match=r"position ids that restart at each document. Set `data.reset_positions"):
        module.training_step(PackedDocuments(2, positions=False)[0:2], 0)
    dataset = PackedDocuments(2)
    with pytest.raises(ValueError, match=r"under pp > 1 does not take document masks.*`data.document_mask=False`"):
        module.configure_pipeline().split_batch((dataset.x, dataset.y, dataset.documents, dataset.positions))


def test_litgpt_packed_logits_equal_each_document_alone():
    torch.manual_seed(0)
    module = litgpt().eval()
    assert _max_error_alone(lambda batch: module(*batch), PackedDocuments(5)) < ATOL
    dataset = PackedDocuments(2)
    with pytest.raises(ValueError, match=r"does not take document masks.*`data.document_mask=False`, or pp=1"):
        module.configure_pipeline().split_batch((dataset.x, dataset.y, dataset.documents))
    module.model.config.sliding_window_size = 4
    with pytest.raises(ValueError, match=r"sliding_window_size.*Set `data.document_mask=False`"):
        module(dataset.x, dataset.documents)
