"""Packed documents for the document-mask tests: windows of three documents, and models that take them.

:class:`PackedDocuments` gives ``(x, y, document_ids, position_ids)`` windows of 16 tokens holding three
documents each (an EOS id, 0, ends the first two), the batches ``TokenDataModule(document_mask=True,
reset_positions=True)`` makes. Some windows cut their documents at multiples of 4 tokens: the chunk boundaries of
load-balanced cp=2, where whole K/V blocks of the ring are hidden from a query chunk (and must give no NaN).

The models are the recipes as a user trains them, with sharp weights (init 0.3, tests/sharpness.py) and SGD
(parameters then compare within 1e-5 after training; see tests/distributed/test_context_parallel_training.py).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lightning_para.recipes.gpt import GPT
from lightning_para.recipes.gpt_layers import CausalSelfAttention
from lightning_para.recipes.hf import HFCausalLM
from lightning_para.recipes.litgpt import LitGPTCausalLM
from lightning_para.recipes.documents import document_ids, document_positions
from tests.hf_models import SHARP_LR, SHARP_RANGE
from tests.tp_models import TokenDataset

EOS = 0
SEQ = 16
VOCAB = 64
# Document lengths per window (cycled); (4, 8, 4) and (8, 4, 4) end documents on cp=2's chunk boundaries.
LENGTHS = ((4, 8, 4), (5, 6, 5), (3, 9, 4), (8, 4, 4), (6, 3, 7))


class PackedDocuments(Dataset):
    """``n`` windows ``(x, y, document_ids, position_ids)`` of three documents (``TokenDataset``'s noisy sequences
    with EOS at the end of the first two documents and nowhere else); ``positions=False`` leaves positions out."""

    def __init__(self, n: int = 40, positions: bool = True) -> None:
        base = TokenDataset(n, SEQ, VOCAB)
        windows = torch.cat([base.x, base.y[:, -1:]], dim=1)
        windows = torch.where(windows == EOS, 1, windows)  # EOS only where a document ends
        for i, lengths in enumerate(self.lengths(j) for j in range(n)):
            windows[i, lengths[0] - 1] = windows[i, lengths[0] + lengths[1] - 1] = EOS
        self.x, self.y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        self.documents = document_ids(self.x, EOS)
        self.positions = document_positions(self.documents) if positions else None

    @staticmethod
    def lengths(i: int) -> tuple[int, int, int]:
        return LENGTHS[i % len(LENGTHS)]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if self.positions is None:
            return self.x[i], self.y[i], self.documents[i]
        return self.x[i], self.y[i], self.documents[i], self.positions[i]


def packed_documents() -> PackedDocuments:
    """40 windows: 5 steps per epoch at a global batch of 8."""
    return PackedDocuments()


def documents_alone(dataset: PackedDocuments, i: int) -> list[tuple[slice, torch.Tensor]]:
    """Each document of window ``i`` as ``(its slice of the window, its tokens [1, length])``."""
    out, start = [], 0
    for length in dataset.lengths(i):
        out.append((slice(start, start + length), dataset.x[i : i + 1, start : start + length]))
        start += length
    return out


class SGDGPT(GPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def gpt(pos: str = "rope") -> GPT:
    """The GPT recipe (Llama style, GQA) with sharp weights."""
    return SGDGPT(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, block_size=SEQ, vocab_size=VOCAB, sample_tokens=0,
                  init_std=0.3, pos=pos)


def gpt2_style() -> GPT:
    """GPT-2 style: learned positions, LayerNorm, GELU, biases."""
    return SGDGPT(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB, sample_tokens=0, init_std=0.3,
                  norm="layernorm", pos="learned", mlp="gelu", bias=True)


class _MaskOffAttention(CausalSelfAttention):
    def forward(self, x, document_ids=None, position_ids=None):
        return super().forward(x, None, position_ids)  # the planted bug: this layer attends across documents


def planted_mask_off() -> GPT:
    """A planted bug: the last layer's attention ignores the document ids."""
    model = gpt()
    model.blocks[-1].attn.__class__ = _MaskOffAttention
    return model


class SGDHFCausalLM(HFCausalLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=SHARP_LR)


def hf_llama() -> HFCausalLM:
    """The transformers recipe on a tiny random Llama (GQA, SDPA), sharp weights."""
    return SGDHFCausalLM("llama", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, initializer_range=SHARP_RANGE, attn_implementation="sdpa",
        tie_word_embeddings=False,
    ))


class SGDLitGPT(LitGPTCausalLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=SHARP_LR)


def litgpt() -> LitGPTCausalLM:
    """The LitGPT recipe on a tiny Llama-shaped config (GQA, RMSNorm, SwiGLU), sharp weights."""
    return SGDLitGPT(config=dict(
        name="tiny-llama", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
        block_size=SEQ, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=64, norm_class_name="RMSNorm",
        rotary_percentage=1.0, parallel_residual=False,
    ), init_std=SHARP_RANGE)
