"""Tensor-parallel adapters: attention modules whose head counts live outside the module.

The automatic plan divides a module's own head attributes (``n_head``, ``n_embd``, ...) by tp
(:class:`~.styles.SublayerInput`). Some model families read them from a *shared* config object
instead (LitGPT's ``CausalSelfAttention`` reads ``self.config.n_head`` and ``n_query_groups``,
one ``Config`` for every block and for the model itself). Dividing the shared object would change
what every other reader sees (the planner, checkpoint export, a block not on this pipeline stage),
so an integration registers an adapter here that knows the family:

* ``plan(attention)``: the styles of the module's projections (e.g. a fused ``qkv`` with its
  explicit grouped-query block sizes, :class:`~.columns.FusedBlocksColwise`);
* ``head_counts(attention)``: the counts tp must divide (checked before anything is sharded);
* ``adapt(attention, tp)``: called once the module is sharded: gives *this module* what it reads
  for its ``1/tp`` of the heads (LitGPT: its own copy of the config with the per-rank counts).

Generic code never imports an integration; integrations fill this registry when imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from lightning_para.spec.plugins import load_plugins


@dataclass(frozen=True)
class TensorParallelAdapter:
    """What tensor parallelism needs to know about one family's attention modules.

    Attributes:
        name: the family, e.g. ``"litgpt"`` (one adapter per name).
        claims: ``module -> bool``: ``module`` is an attention module of this family.
        plan: ``attention -> {child name: style}``: the styles of its children (the attention
            module itself is planned ``"attention"``).
        head_counts: ``attention -> {what: count}``: counts that tp must divide.
        adapt: ``(attention, tp) -> None``: make the sharded module compute its ``1/tp`` of the heads.
    """

    name: str
    claims: Callable[[nn.Module], bool]
    plan: Callable[[nn.Module], dict[str, Any]]
    head_counts: Callable[[nn.Module], dict[str, int]]
    adapt: Callable[[nn.Module, int], None]


_ADAPTERS: dict[str, TensorParallelAdapter] = {}


def register_tensor_parallel_adapter(adapter: TensorParallelAdapter) -> None:
    """Add (or replace, by name) an adapter; integrations call it when they are imported."""
    if not isinstance(adapter, TensorParallelAdapter):
        raise TypeError(f"`adapter` must be a TensorParallelAdapter, got {type(adapter).__name__}.")
    _ADAPTERS[adapter.name] = adapter


def tensor_parallel_adapter(module: nn.Module) -> Optional[TensorParallelAdapter]:
    """The registered adapter that claims ``module``, if any."""
    load_plugins()
    for adapter in _ADAPTERS.values():
        if adapter.claims(module):
            return adapter
    return None


def adapted_fused_projections(root: nn.Module) -> dict[str, str]:
    """``{name: why}`` of the projections registered adapters plan with a style instance (a fused projection
    with explicit block sizes): float8 training keeps them in high precision under tp."""
    found = {}
    for name, module in root.named_modules():
        adapter = tensor_parallel_adapter(module)
        if adapter is None:
            continue
        for child, style in adapter.plan(module).items():
            if not isinstance(style, str):
                found[f"{name}.{child}" if name else child] = (
                    f"a fused projection ({type(style).__name__}) under tp: torchao's float8 styles are column-/row-wise only"
                )
    return found


__all__ = ["TensorParallelAdapter", "adapted_fused_projections", "register_tensor_parallel_adapter", "tensor_parallel_adapter"]
