"""Context-parallel adapters: how a third-party model family gets its global positions under cp.

A model that builds positions from the local length (``arange(x.shape[1])``) is wrong on every cp
rank, and so is a model that shifts labels or builds masks inside the local, non-contiguous chunks.
Three ways to make a model right, in the order :func:`~.step.apply_context_parallel` uses them:

* an **adapter** registered here by an integration (generic code never imports an integration):
  ``lightning_para.integrations.transformers`` registers one for every Hugging Face
  ``PreTrainedModel``, whose forward pre-hook fills the global ``position_ids``, an all-ones
  ``attention_mask`` and globally shifted labels;
* a submodule's ``set_context_parallel(shard)`` method, told the rank's
  :class:`~.sharding.ContextParallelShard` at setup;
* the LightningModule's ``context_parallel_batch(batch, shard)`` hook, which builds the rank's batch.

Whatever the way, the first cp training step checks the result against the full sequence
(:mod:`.check`).

This module imports nothing from the rest of ``lightning_para`` outside ``parallel/context``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist
from torch import Tensor, nn

from lightning_para.parallel.context.sharding import ContextParallelShard, unshard_sequence
from lightning_para.spec.plugins import load_plugins

__all__ = [
    "ContextParallelAdapter",
    "ContextParallelRuntime",
    "context_parallel_adapters",
    "register_context_parallel_adapter",
]


class ContextParallelRuntime:
    """What an adapter's hooks see of context parallelism on this rank.

    Attributes:
        shard: this rank's :class:`~.sharding.ContextParallelShard`.
        group: the cp process group.
        key_valid: the whole batch's key padding (``[batch, seq]`` bool, natural order, ``True``
            = a real token) that an adapter found in the last forward's mask; attention applies
            it on top of the causal mask. It stays set after the forward, since activation
            checkpointing recomputes attention during backward; the adapter's next forward
            replaces it. ``None``: no padding.
        document_ids: the whole batch's document ids (``[batch, seq]``, natural order) that an adapter found in
            the last forward's inputs (packed sequences); attention keeps each query inside its document. Kept
            like ``key_valid``. ``None``: one document per sequence.
    """

    def __init__(self, shard: ContextParallelShard, group: Optional[dist.ProcessGroup]) -> None:
        self.shard = shard
        self.group = group
        self.key_valid: Optional[Tensor] = None
        self.document_ids: Optional[Tensor] = None
        self._depth = 0

    @property
    def active(self) -> bool:
        """Inside a cp step: the batch is this rank's chunks and attention runs across the cp group.

        Outside (a callback calling the model on whole sequences, the full-sequence run of the
        first-step check) adapters must leave the model's inputs alone."""
        return self._depth > 0

    def enter(self) -> None:
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1

    def gather(self, local: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence of a tensor split like the batch (one all-gather over cp; not differentiable)."""
        return unshard_sequence(local, self.group, dim=dim, load_balance=self.shard.load_balance)


@dataclass(frozen=True)
class ContextParallelAdapter:
    """What context parallelism needs to know about one family of models.

    Attributes:
        name: the family, e.g. ``"transformers"`` (one adapter per name).
        supports: what the adapter makes right, for messages (e.g. ``"Hugging Face PreTrainedModel"``).
        claims: ``module -> bool``: the adapter takes care of ``module`` and everything inside it.
        attach: ``(module, runtime) -> detach``: install what the module needs (hooks), return
            a function that removes it.
    """

    name: str
    supports: str
    claims: Callable[[nn.Module], bool]
    attach: Callable[[nn.Module, ContextParallelRuntime], Callable[[], None]]


_ADAPTERS: dict[str, ContextParallelAdapter] = {}


def register_context_parallel_adapter(adapter: ContextParallelAdapter) -> None:
    """Add (or replace, by name) an adapter; integrations call it when they are imported."""
    if not isinstance(adapter, ContextParallelAdapter):
        raise TypeError(f"`adapter` must be a ContextParallelAdapter, got {type(adapter).__name__}.")
    _ADAPTERS[adapter.name] = adapter


def context_parallel_adapters() -> tuple[ContextParallelAdapter, ...]:
    """The registered adapters, in registration order."""
    load_plugins()
    return tuple(_ADAPTERS.values())
