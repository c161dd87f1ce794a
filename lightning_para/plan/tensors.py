"""The parameter tensors one rank holds, with their local shapes: what ZeRO shards, pads and buckets.

:class:`~lightning_para.plan.model.ModelDesc` counts parameters; the data-parallel engines work
per *tensor*: ZeRO-1/2 (``parallel/data/layout.py``) and FSDP2 (ZeRO-3) split each tensor by rows
(dim 0) into ``ceil(rows / N)``-row chunks, so a tensor whose rows ``N`` does not divide is padded
(in the ZeRO-1/2 buckets and in FSDP2's sharded storage), and Adam keeps one 4-byte ``step``
counter per tensor. This module lists the tensors of a layer, the embedding and the head as a
rank holds them after tensor and expert parallelism split them, so the planner can count
those bytes exactly:

* ``nn.Linear`` weights are ``[out, in]``: column-parallel ones (q, k, v, MLP up/gate, the
  output head) keep ``out / tp`` rows, row-parallel ones (attention output, MLP down)
  ``in / tp`` columns (Megatron-LM, Shoeybi et al. 2019); a row-parallel bias stays whole;
* the token embedding is vocab-parallel, ``[V / tp, h]``; learned positions, norms, routers,
  shared experts and routed experts are not tensor parallel;
* routed experts are stacked ``[E / ep, h, f]`` (``GroupedExperts`` of ``lightning_para.moe``,
  ``w1``/``w3``) and ``[E / ep, f, h]`` (``w2``).

Uneven splits round up (``torch.chunk``'s and DTensor's first shard is the largest): the planner
prices the most loaded rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_para.plan.model import ModelDesc
from lightning_para.spec.zero import chunk_rows


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor as a rank holds it (after tensor and expert parallelism)."""

    name: str
    shape: tuple[int, ...]
    expert: bool = False  # a routed expert: sharded by ep, replicated over edp

    # Cached on the (frozen, itself cached) tensor: a search reads them millions of times.
    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def shard_numel(self, shards: int) -> int:
        """Elements of the largest of ``shards`` row chunks (``ceil(rows / shards)`` rows): what the
        first data-parallel rank holds, and what each rank's bucket segment or FSDP2 shard occupies."""
        return chunk_rows(self.rows, shards) * (self.numel // self.rows if self.rows else 0)


def muon_steps(t: ParamTensor) -> bool:
    """Whether ``lightning_para.optim.Muon`` steps ``t`` (a hidden matrix: not an embedding, the head or 1-D)."""
    return len(t.shape) >= 2 and not t.name.startswith(("embedding", "head"))


def _split(size: int, parts: int) -> int:
    return math.ceil(size / parts)


def _linear(name: str, out_features: int, in_features: int, bias: bool, *, col: int = 1, row: int = 1) -> list[ParamTensor]:
    """An ``nn.Linear`` split column-wise over ``col`` ranks or row-wise over ``row`` ranks."""
    tensors = [ParamTensor(f"{name}.weight", (_split(out_features, col), _split(in_features, row)))]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", (_split(out_features, col),)))
    return tensors


def norm_tensors(model: ModelDesc, name: str) -> list[ParamTensor]:
    tensors = [ParamTensor(f"{name}.weight", (model.hidden,))]
    if model.norm == "layernorm" and model.bias:
        tensors.append(ParamTensor(f"{name}.bias", (model.hidden,)))
    return tensors


def _mlp(model: ModelDesc, name: str, width: int, tp: int) -> list[ParamTensor]:
    h, bias = model.hidden, model.bias
    tensors = _linear(f"{name}.up", width, h, bias, col=tp)
    if model.gated_mlp:
        tensors += _linear(f"{name}.gate", width, h, bias, col=tp)
    return tensors + _linear(f"{name}.down", h, width, bias, row=tp)


def layer_tensors(model: ModelDesc, index: int, tp: int = 1, ep: int = 1) -> list[ParamTensor]:
    """The tensors of transformer layer ``index`` on one rank of a ``tp`` x ``ep`` layout."""
    return list(_layer_tensors(model, index, tp, ep))


@functools.lru_cache(maxsize=65536)
def _layer_tensors(model: ModelDesc, index: int, tp: int, ep: int) -> tuple[ParamTensor, ...]:
    # Cached: a search prices every layer of every layout (266,080 calls, 60% of an 8-GPU search's time).
    return tuple(_build_layer_tensors(model, index, tp, ep))


def _build_layer_tensors(model: ModelDesc, index: int, tp: int, ep: int) -> list[ParamTensor]:
    h, bias, prefix = model.hidden, model.bias, f"layers.{index}"
    tensors = norm_tensors(model, f"{prefix}.norm_1") + norm_tensors(model, f"{prefix}.norm_2")
    if model.attention_params is not None:
        # An attention variant given by its count only (e.g. DeepSeek's MLA): one tensor of rows of h.
        rows = _split(model.attention_params // h, tp)
        tensors.append(ParamTensor(f"{prefix}.attention", (rows, h)))
    else:
        for part, width in (("q", model.q_dim), ("k", model.kv_dim), ("v", model.kv_dim)):
            tensors += _linear(f"{prefix}.attention.{part}", width, h, bias, col=tp)
        tensors += _linear(f"{prefix}.attention.out", h, model.q_dim, bias, row=tp)
    if not model.is_moe_layer(index):
        return tensors + _mlp(model, f"{prefix}.mlp", model.ffn, tp)
    # MoE: router, routed experts stacked per matrix (sharded by ep), shared experts; none tensor parallel.
    experts, width = _split(model.num_experts, ep), model.moe_ffn or model.ffn
    tensors.append(ParamTensor(f"{prefix}.moe.router", (model.num_experts, h)))
    tensors.append(ParamTensor(f"{prefix}.moe.w1", (experts, h, width), expert=True))
    tensors.append(ParamTensor(f"{prefix}.moe.w2", (experts, width, h), expert=True))
    if model.gated_mlp:
        tensors.append(ParamTensor(f"{prefix}.moe.w3", (experts, h, width), expert=True))
    if model.shared_expert_ffn:
        tensors += _mlp(model.with_changes(bias=False), f"{prefix}.moe.shared", model.shared_expert_ffn, 1)
    return tensors


def embedding_tensors(model: ModelDesc, tp: int = 1) -> list[ParamTensor]:
    """The vocab-parallel token embedding and the learned position table (not split)."""
    tensors = [ParamTensor("embedding.tokens", (_split(model.vocab, tp), model.hidden))]
    if model.learned_positions:
        tensors.append(ParamTensor("embedding.positions", (model.learned_positions, model.hidden)))
    return tensors


def head_tensors(model: ModelDesc, tp: int = 1, *, final_norm: bool = True, matrix: bool = True) -> list[ParamTensor]:
    """The final norm and the column-parallel output projection (``matrix=False``: tied to an
    embedding this rank also holds, so not counted again)."""
    tensors = norm_tensors(model, "final_norm") if final_norm else []
    if matrix:
        tensors.append(ParamTensor("head", (_split(model.vocab, tp), model.hidden)))
    return tensors


def part_tensors(
    model: ModelDesc, layers: Iterable[int], *, embedding: bool, final_norm: bool, head_matrix: bool, tp: int = 1,
    ep: int = 1,
) -> list[ParamTensor]:
    """The parameter tensors of a piece of the model (a pipeline unit, a rank's stages): the embedding if
    ``embedding``, the ``layers``, the final norm if ``final_norm`` and the head's matrix if ``head_matrix``."""
    tensors: list[ParamTensor] = []
    if embedding:
        tensors += embedding_tensors(model, tp)
    for i in layers:
        tensors += layer_tensors(model, i, tp, ep)
    if final_norm or head_matrix:
        tensors += head_tensors(model, tp, final_norm=final_norm, matrix=head_matrix)
    return tensors


def total_numel(tensors: Iterable[ParamTensor]) -> int:
    return sum(t.numel for t in tensors)


def shard_numel(tensors: Iterable[ParamTensor], shards: int) -> int:
    """Elements the first of ``shards`` data-parallel ranks holds when every tensor is split by rows."""
    return sum(t.shard_numel(shards) for t in tensors)
