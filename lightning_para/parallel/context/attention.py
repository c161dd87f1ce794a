"""One entry point for context-parallel attention, and a mode that routes SDPA calls through it.

:func:`context_parallel_attention` picks ring attention or Ulysses. :class:`ContextParallelSDPA`
is a ``TorchFunctionMode`` that intercepts ``torch.nn.functional.scaled_dot_product_attention``
inside its ``with`` block, so a model that calls SDPA (the GPT recipe, the HF Llama family with
``attn_implementation="sdpa"``) runs context-parallel without code changes, provided its inputs
are already sequence-sharded and its position ids are global
(:func:`~lightning_para.parallel.context.sharding.position_ids_for_rank`). HF models also need
an all-ones 2-D ``attention_mask``: without one, transformers reads the jumps in head-tail
position ids as packed sequences and passes SDPA an explicit mask, which this mode rejects.
Document masks reach it as :func:`~.documents.document_attention` calls (their local document ids are
gathered into the whole sequence's) or, for SDPA calls, as ``document_ids()`` (an adapter found them).

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_para.parallel.context.documents import check_document_ids, document_attention
from lightning_para.parallel.context.ring import ring_attention
from lightning_para.parallel.context.sharding import unshard_sequence
from lightning_para.parallel.context.ulysses import ulysses_attention
from lightning_para.spec.options import CP_METHODS as _NAMES

__all__ = ["CP_METHODS", "ContextParallelSDPA", "context_parallel_attention", "context_parallel_sdpa"]

# The methods by their declared names (lightning_para.spec.options.CP_METHODS).
CP_METHODS: dict[str, Callable[..., torch.Tensor]] = dict(zip(_NAMES, (ring_attention, ulysses_attention)))

_SDPA = F.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
        )
    ]
    + [inspect.Parameter("enable_gqa", inspect.Parameter.KEYWORD_ONLY, default=False)]
)

_DOCUMENT_SIGNATURE = inspect.signature(document_attention)

SDPA_CONTRACT = (
    "context-parallel attention replaces F.scaled_dot_product_attention only for self-attention with "
    "attn_mask=None (use is_causal=True for causal masking, and lightning_para.parallel.context.documents."
    "document_attention for document masks), dropout_p=0.0, and 4-D "
    "[batch, heads, local_seq, head_dim] query/key/value shards of equal length"
)


def _check_method(method: str) -> None:
    if method not in CP_METHODS:
        raise ValueError(
            f"method={method!r} is not a context-parallel attention method; choose one of {sorted(CP_METHODS)}"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    method: str = "ring",
    is_causal: bool = False,
    scale: Optional[float] = None,
    load_balance: bool = True,
    key_valid: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across the cp ``group``; SDPA's layout and semantics.

    Args:
        q, k, v: local shards ``[batch, heads | kv_heads, local_seq, head_dim]``, sharded with
            :func:`~lightning_para.parallel.context.sharding.shard_sequence` (``dim=2``).
        group: the cp process group (``None``: the default group).
        method: ``"ring"`` (K/V blocks around the ring: ``2(c-1)`` p2p receives forward) or
            ``"all_to_all"`` (DeepSpeed-Ulysses: 4 all-to-alls forward; heads divisible by ``c``).
        is_causal: causal mask over global positions.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
        load_balance: the inputs use the head-tail layout (must match the sharding).
        key_valid: key padding of the whole sequence, ``[batch, seq]`` bool in natural order
            (``False``: padding, seen by no query), the same on every rank; ``None``: none.
        document_ids: the whole sequence's document ids, ``[batch, seq]`` in natural order, the same on every
            rank: a query sees only keys of its own document; ``None``: one document.

    Returns:
        This rank's output shard, equal to the matching rows of full-sequence SDPA.
    """
    _check_method(method)
    return CP_METHODS[method](
        q, k, v, group=group, is_causal=is_causal, scale=scale, load_balance=load_balance, key_valid=key_valid,
        document_ids=document_ids,
    )


class ContextParallelSDPA(TorchFunctionMode):
    """Route every ``F.scaled_dot_product_attention`` call inside the mode to context-parallel attention.

    Example::

        with ContextParallelSDPA(cp_group, method="ring"):
            logits = model(shard_sequence(tokens, cp_rank, cp))  # model calls F.scaled_dot_product_attention

    Calls outside :data:`SDPA_CONTRACT` (an explicit ``attn_mask``, dropout, non-4-D inputs)
    raise ``ValueError`` rather than silently attending within the local shard only. Other
    torch functions pass through untouched. The backward pass needs no mode: the attention
    functions carry their own autograd.
    """

    def __init__(
        self, group: Optional[dist.ProcessGroup] = None, *, method: str = "ring", load_balance: bool = True
    ) -> None:
        super().__init__()
        _check_method(method)
        self.group = group
        self.method = method
        self.load_balance = load_balance
        self.calls = 0  # SDPA calls routed, e.g. to check that a model's attention was reached
        self.recorded: Optional[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None  # set: keep q, k, v
        self._documents: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (local, whole) of the last call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is document_attention:
            return self._document_attention(args, kwargs)
        if func is not _SDPA:
            return func(*args, **kwargs)
        try:
            bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
        except TypeError as err:
            raise ValueError(f"{SDPA_CONTRACT}; could not read the call's arguments: {err}") from err
        bound.apply_defaults()
        a = bound.arguments
        if a["attn_mask"] is not None:
            raise ValueError(f"{SDPA_CONTRACT}; got an explicit attn_mask of shape {tuple(a['attn_mask'].shape)}")
        return self._attention(a["query"], a["key"], a["value"], a, a["is_causal"], self.document_ids())

    def _document_attention(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``document_attention`` (causal, within documents): the local document ids gathered into the whole
        sequence's (one all-gather of ``batch x seq`` integers per forward: layers share the tensor)."""
        a = _DOCUMENT_SIGNATURE.bind(*args, **kwargs)
        a.apply_defaults()
        local = a.arguments["document_ids"]
        if self._documents is None or self._documents[0] is not local:
            q = a.arguments["query"]
            check_document_ids(local, q.shape[0], q.shape[2])
            self._documents = (local, unshard_sequence(local, self.group, dim=1, load_balance=self.load_balance))
        args = a.arguments
        return self._attention(args["query"], args["key"], args["value"], args, True, self._documents[1])

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: dict, is_causal: bool,
        document_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        if a["dropout_p"] != 0.0:
            raise ValueError(f"{SDPA_CONTRACT}; got dropout_p={a['dropout_p']} (set the attention dropout to 0)")
        if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] and not a["enable_gqa"]:
            raise ValueError(
                f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True for grouped-query "
                f"attention (as F.scaled_dot_product_attention requires)"
            )
        self.calls += 1
        if self.recorded is not None:  # the first-step position check (.check) compares them
            self.recorded.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return context_parallel_attention(
            q, k, v, group=self.group, method=self.method, is_causal=is_causal, scale=a["scale"],
            load_balance=self.load_balance, key_valid=self.key_valid(), document_ids=document_ids,
        )

    def key_valid(self) -> Optional[torch.Tensor]:
        """Key padding of the current forward (``[batch, seq]``, natural order), or ``None``."""
        return None

    def document_ids(self) -> Optional[torch.Tensor]:
        """Document ids of the current forward's SDPA calls (``[batch, seq]``, natural order), or ``None``."""
        return None


def context_parallel_sdpa(
    group: Optional[dist.ProcessGroup] = None, *, method: str = "ring", load_balance: bool = True
) -> ContextParallelSDPA:
    """The :class:`ContextParallelSDPA` mode, to use as ``with context_parallel_sdpa(group): ...``."""
    return ContextParallelSDPA(group, method=method, load_balance=load_balance)
