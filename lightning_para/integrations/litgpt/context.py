"""Context parallelism for LitGPT models, with no hook to write.

Under ``ParaStrategy(cp=c)`` each rank holds 2 chunks of every sequence (head and tail) and calls
the model on them as if they were one sequence. ``GPT.forward`` slices its RoPE tables as
``cos[:T]`` with the *local* ``T``: positions ``0 .. S/c - 1`` on every rank, wrong everywhere but
the first chunk. The adapter registered here gives every block of a ``GPT`` a forward pre-hook
that, during cp steps only (:attr:`~lightning_para.parallel.context.ContextParallelRuntime.active`),
passes the tables indexed by this rank's *global* positions (``cos[positions]``); tables passed by keyword
(``forward_with_documents``' restarting positions, already split like the tokens) stay. Attention is
LitGPT's own ``F.scaled_dot_product_attention(..., is_causal=True)``, which context-parallel
attention runs across the cp group. LitGPT batches carry shifted targets (``data[:, 1:]``), which
are split like the inputs, so the loss needs nothing.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Optional

from torch import nn

from lightning_para.integrations.litgpt.tensor import is_litgpt_module
from lightning_para.parallel.context.adapters import (
    ContextParallelAdapter,
    ContextParallelRuntime,
    register_context_parallel_adapter,
)


def _global_rope(
    runtime: ContextParallelRuntime, gpt_ref: Callable[[], Any], block: nn.Module, args: tuple, kwargs: dict
) -> Optional[tuple[tuple, dict]]:
    if not runtime.active or not args:
        return None
    if "cos" in kwargs:
        return None  # forward_with_documents' tables at the batch's own positions (split like the tokens)
    gpt = gpt_ref()
    x = args[0]
    positions = runtime.shard.local_positions(x.shape[1], device=gpt.cos.device)
    cos = gpt.cos.index_select(0, positions).unsqueeze(0).to(x.device)
    sin = gpt.sin.index_select(0, positions).unsqueeze(0).to(x.device)
    return (x, cos, sin, *args[3:]), kwargs


def attach(model: nn.Module, runtime: ContextParallelRuntime) -> Callable[[], None]:
    """Install the pre-hooks on the blocks of ``model`` (a LitGPT ``GPT``); return what removes them."""
    if getattr(model.config, "rope_indices", None) is not None:
        raise ValueError("Under cp, LitGPT configs with per-block `rope_indices` are not supported; set cp=1.")
    ref = weakref.ref(model)
    # Before or after the pipeline's hook (pipeline_spec), either order gives the block the global tables.
    handles = [
        block.register_forward_pre_hook(partial(_global_rope, runtime, ref), with_kwargs=True)
        for block in model.transformer.h
    ]

    def detach() -> None:
        for handle in handles:
            handle.remove()

    return detach


ADAPTER = ContextParallelAdapter(
    name="litgpt",
    supports="LitGPT GPT (RoPE tables indexed by global positions)",
    claims=lambda module: is_litgpt_module(module, "GPT"),
    attach=attach,
)
register_context_parallel_adapter(ADAPTER)

__all__ = ["ADAPTER", "attach"]
