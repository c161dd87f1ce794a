"""LitGPT attention under tensor parallelism: per-module head counts and the fused ``qkv``.

LitGPT's ``CausalSelfAttention`` reads ``self.config.n_head`` and ``self.config.n_query_groups``
from the one ``Config`` that every block and the ``GPT`` share, and splits its fused projection
with them: ``qkv.split((n_head * head_size, n_query_groups * head_size, n_query_groups * head_size))``.
Under tp each rank computes ``n_head / tp`` query heads and ``n_query_groups / tp`` key/value
groups, so:

* the projection's styles: ``qkv`` is a :class:`~lightning_para.parallel.tensor.columns.FusedBlocksColwise`
  with the grouped-query block sizes. litgpt >= 0.5 stores it **contiguous** (``[q | k | v]``, checked
  against the source of ``CausalSelfAttention.forward``); the legacy fused ``attn`` of older litgpt
  is **interleaved** per query group (``[q of the group | k | v]`` x ``n_query_groups``). ``proj`` is
  row-parallel; q/k norms over ``head_size`` run on this rank's heads;
* the head counts: each attention module gets **its own copy** of the config with the per-rank
  counts (``module.config``); the shared ``Config`` -- what the ``GPT``, the planner and checkpoint
  export read -- is never changed.

litgpt itself is never imported here: modules are recognised by their class's module name.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from lightning_para.parallel.tensor.adapters import TensorParallelAdapter
from lightning_para.parallel.tensor.columns import FusedBlocksColwise


def is_litgpt_module(module: Any, class_name: str) -> bool:
    """``module`` is an instance of litgpt's ``class_name`` (or a subclass of it), without importing litgpt."""
    return any(
        c.__name__ == class_name and c.__module__.split(".")[0] == "litgpt" for c in type(module).__mro__
    )


def is_litgpt_attention(module: nn.Module) -> bool:
    """LitGPT's grouped-query ``CausalSelfAttention`` (multi-head latent attention is not supported)."""
    return is_litgpt_module(module, "CausalSelfAttention") and hasattr(module, "config")


def _counts(attention: nn.Module) -> tuple[int, int, int]:
    config = attention.config
    return int(config.n_head), int(config.n_query_groups), int(config.head_size)


def attention_plan(attention: nn.Module) -> dict[str, Any]:
    """The styles of one LitGPT attention module's children (names relative to it)."""
    n_head, n_groups, head_size = _counts(attention)
    plan: dict[str, Any] = {"proj": "rowwise"}
    if isinstance(getattr(attention, "qkv", None), nn.Linear):
        # litgpt >= 0.5: [q (n_head heads) | k (n_groups) | v (n_groups)], side by side.
        blocks = (n_head * head_size, n_groups * head_size, n_groups * head_size)
        plan["qkv"] = FusedBlocksColwise(blocks, layout="contiguous", unit=head_size)
    elif isinstance(getattr(attention, "attn", None), nn.Linear):
        # Older litgpt: per query group [q heads of the group | k | v], n_groups times.
        per_group = (n_head // n_groups * head_size, head_size, head_size)
        plan["attn"] = FusedBlocksColwise(per_group, layout="interleaved", groups=n_groups, unit=head_size)
    config = attention.config
    if getattr(config, "norm_qk", False) and getattr(attention, "norm_q", None) is not None:
        if getattr(config, "norm_qk_type", "default") == "default":  # over head_size: this rank's heads
            plan["norm_q"] = plan["norm_k"] = "head_norm"
    return plan


def attention_head_counts(attention: nn.Module) -> dict[str, int]:
    n_head, n_groups, _ = _counts(attention)
    return {"config.n_head": n_head, "config.n_query_groups": n_groups}


def adapt_attention(attention: nn.Module, tp: int) -> None:
    """Give ``attention`` its own config with this rank's head counts (the shared one stays whole)."""
    own = copy.copy(attention.config)  # a shallow copy: no __post_init__ runs, head_size stays the model's
    own.n_head = attention.config.n_head // tp
    own.n_query_groups = attention.config.n_query_groups // tp
    attention.config = own


ADAPTER = TensorParallelAdapter(
    name="litgpt", claims=is_litgpt_attention, plan=attention_plan, head_counts=attention_head_counts,
    adapt=adapt_attention,
)

__all__ = ["ADAPTER", "adapt_attention", "attention_plan", "is_litgpt_attention", "is_litgpt_module"]
