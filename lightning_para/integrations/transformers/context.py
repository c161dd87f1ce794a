"""Context parallelism for Hugging Face models, with no hook to write.

Under ``ParaStrategy(cp=c)`` each rank holds ``2`` chunks of every sequence (head and tail) and
calls the model on them as if they were a sequence. A ``PreTrainedModel`` would then number its
tokens ``0 .. S/c - 1`` (RoPE on the wrong positions), read the jumps of head-tail positions as
packed sequences (a block mask) and shift ``labels`` inside the chunks. The adapter registered
here gives every outermost ``PreTrainedModel`` of the LightningModule a forward pre-hook that,
during cp steps only (:attr:`~lightning_para.parallel.context.ContextParallelRuntime.active`):

* fills ``position_ids`` with this rank's global positions when the caller gave none, and splits
  whole-sequence ``position_ids`` like the batch (a caller's local ones are kept; the first-step
  check compares them with the whole sequence);
* fills an all-ones ``attention_mask`` when the caller gave none (transformers then calls SDPA
  with ``is_causal=True``). Without a mask (and without a KV cache: ``use_cache=False``) transformers reads jumps
  in the caller's ``position_ids`` as packed sequences (positions restarting at each document): the whole sequence's positions are gathered (one
  all-gather of ``batch x seq`` integers) and their documents handed to context-parallel attention
  (``runtime.document_ids``), which keeps each query inside its document as transformers' mask does. A 2-D
  padding mask (``0`` = padding) is gathered over cp (one
  all-gather of ``batch x seq`` integers); all ones it is replaced the same way, otherwise its
  key padding is handed to context-parallel attention, which applies it with the causal mask
  exactly as transformers does (``runtime.key_valid``). 4-D masks are refused;
* for causal LMs given ``labels`` (and no ``shift_labels``), shifts the labels over the *whole*
  sequence (one all-gather) and passes this rank's chunks as ``shift_labels`` (``-100`` after the
  last token, transformers' convention), so the model's own loss is one device's.

The hook acts on keyword and positional arguments alike. Nothing here imports transformers: a
model is recognised by its class hierarchy (a class ``PreTrainedModel`` from a ``transformers``
module).
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_para.parallel.context.adapters import (
    ContextParallelAdapter,
    ContextParallelRuntime,
    register_context_parallel_adapter,
)
from lightning_para.parallel.tensor.loss import IGNORE_INDEX  # transformers' ignore_index for labels

# The cp runtime of each model the adapter was attached to (weak: keeps no model alive).
_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, ContextParallelRuntime]" = weakref.WeakKeyDictionary()


def context_parallel_runtime(model: nn.Module) -> Optional[ContextParallelRuntime]:
    """The cp runtime the adapter attached to ``model`` (``None``: not under cp)."""
    return _RUNTIMES.get(model)


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (by class hierarchy, without importing it)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(module).__mro__
    )


def _is_causal_lm(model: nn.Module) -> bool:
    loss_type = getattr(model, "loss_type", None)
    return loss_type == "ForCausalLM" or (loss_type is None and type(model).__name__.endswith("ForCausalLM"))


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """Every argument of the call by name (the ``**kwargs`` of forward flattened in), or ``None``."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None  # positional extras cannot be passed by name
        else:
            named[name] = value
    return named


def _whole(runtime: ContextParallelRuntime, tensor: Tensor, local_len: int, what: str) -> Tensor:
    """The whole sequence of a ``[batch, seq]`` tensor given whole or as this rank's chunks."""
    if tensor.shape[1] == local_len * runtime.shard.cp:
        return tensor
    if tensor.shape[1] == local_len:
        return runtime.gather(tensor)
    raise ValueError(
        f"Under ParaStrategy(cp={runtime.shard.cp}) the model got `{what}` of length {tensor.shape[1]}, but its inputs"
        f" hold {local_len} tokens of a {local_len * runtime.shard.cp}-token sequence. Pass `{what}` for the whole"
        f" sequence ({local_len * runtime.shard.cp}) or split like the inputs ({local_len})."
    )


def _packs(model: nn.Module, named: dict[str, Any]) -> bool:
    """Whether transformers reads the call's ``position_ids`` as packed sequences: only without a KV cache."""
    use_cache = named.get("use_cache")
    use_cache = getattr(model.config, "use_cache", False) if use_cache is None else use_cache
    return not use_cache and named.get("past_key_values") is None and named.get("cache") is None


def _prepare(
    runtime: ContextParallelRuntime, signature: inspect.Signature, causal_lm: bool,
    module: nn.Module, args: tuple, kwargs: dict,
) -> Optional[tuple[tuple, dict]]:
    """The forward pre-hook: the call's arguments with what cp needs filled in (see the module docstring)."""
    if not runtime.active:
        return None
    named = _bind(signature, args, kwargs)
    if named is None:
        return None
    tokens = named.get("input_ids")
    if tokens is None:
        tokens = named.get("inputs_embeds")
    if not isinstance(tokens, Tensor) or tokens.dim() < 2:
        return None
    shard = runtime.shard
    # The padding of this forward, kept after it: activation checkpointing recomputes attention in backward.
    runtime.key_valid = runtime.document_ids = None
    batch, local_len = tokens.shape[0], tokens.shape[1]
    seq_len = local_len * shard.cp
    device = tokens.device

    positions = named.get("position_ids")
    if positions is None:
        named["position_ids"] = shard.position_ids(seq_len, batch_size=batch, device=device)
    elif isinstance(positions, Tensor) and positions.shape[-1] == seq_len:
        named["position_ids"] = shard.split(positions, dim=-1)

    mask = named.get("attention_mask")
    if mask is None:
        named["attention_mask"] = torch.ones(batch, local_len, dtype=torch.long, device=device)
        if isinstance(positions, Tensor) and _packs(module, named):  # a new document where positions jump
            local = named["position_ids"]
            whole = _whole(runtime, (local if local.dim() == 2 else local[None]).expand(batch, -1), local_len, "position_ids")
            runtime.document_ids = (torch.diff(whole, prepend=whole[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    elif isinstance(mask, Tensor) and mask.dim() == 2:
        whole = _whole(runtime, mask, local_len, "attention_mask").bool()
        named["attention_mask"] = torch.ones(batch, local_len, dtype=mask.dtype, device=device)
        if not bool(whole.all()):
            runtime.key_valid = whole  # padding: attention masks these keys, on top of the causal mask
    else:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"Under ParaStrategy(cp={shard.cp}) a transformers model can take a 2-D padding `attention_mask`"
            f" [batch, seq] (or none), but got {shape}: context-parallel attention builds the causal mask"
            " itself and cannot split an explicit mask. Pass a 2-D mask, or set cp=1."
        )

    labels = named.get("labels")
    if causal_lm and isinstance(labels, Tensor) and labels.dim() == 2 and named.get("shift_labels") is None:
        whole = _whole(runtime, labels, local_len, "labels")
        # transformers shifts inside the sequence it sees; here the shift crosses the chunks.
        named["shift_labels"] = shard.split(F.pad(whole[:, 1:], (0, 1), value=IGNORE_INDEX))
        if labels.shape[1] != local_len:
            named["labels"] = shard.split(labels)
    return (), named


def attach(model: nn.Module, runtime: ContextParallelRuntime) -> Callable[[], None]:
    """Install the pre-hook on ``model`` (a ``PreTrainedModel``); return what removes it."""
    signature = inspect.signature(model.forward)
    pre = model.register_forward_pre_hook(
        partial(_prepare, runtime, signature, _is_causal_lm(model)), with_kwargs=True
    )
    _RUNTIMES[model] = runtime

    def detach() -> None:
        pre.remove()
        _RUNTIMES.pop(model, None)

    return detach


ADAPTER = ContextParallelAdapter(
    name="transformers",
    supports="Hugging Face transformers PreTrainedModel (global position_ids, attention_mask, shifted labels)",
    claims=is_pretrained_model,
    attach=attach,
)
register_context_parallel_adapter(ADAPTER)

__all__ = ["ADAPTER", "attach", "context_parallel_runtime", "is_pretrained_model"]
