"""Expert-parallel adapters: how :func:`~lightning_para.parallel.expert.apply_expert_parallel` shards
a third-party family of Mixture-of-Experts blocks without knowing the library they come from.

Generic code never imports an integration (``docs/architecture.md``, "Layers"), so an integration
registers what expert parallelism needs from its models: ``lightning_para.integrations.transformers``
registers transformers 5's experts interface when it is imported (``import lightning_para`` imports
it). ``lightning_para.moe.MoE`` needs no adapter: it takes a dispatcher itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from lightning_para.moe import MoE
from lightning_para.moe.routing import add_expert_bias
from lightning_para.parallel.expert.dispatch import AllToAllDispatcher
from lightning_para.spec.plugins import load_plugins


@dataclass(frozen=True)
class ExpertAdapter:
    """What expert parallelism needs to know about one family of experts modules.

    Attributes:
        name: the family, e.g. ``"transformers"`` (one adapter per name).
        interface: what a supported experts module looks like, for error messages.
        find: ``module -> [(name, experts module)]`` inside ``module``; each experts module has
            ``num_experts`` and expert-major parameters ``[num_experts, ...]``.
        shard: ``(experts, dispatcher, shard_parameters)``: make ``experts`` expert-parallel;
            ``shard_parameters(experts)`` splits its parameters over ``ep`` (``Shard(0)``).
        count_field: ``experts -> "config.num_local_experts"``: the setting that gives the number
            of experts, named in errors.
        unsupported: ``(module, known) -> [line]``: blocks that look like MoE but cannot be sharded
            (``known`` marks supported blocks); sharding some experts and not others is refused.
        attach_global_loss: ``(module, dp_group, dp_size)``: make the family's auxiliary loss the
            one-device value over data-parallel ranks, or ``None``.
        add_bias: ``(module, bias_update_rate) -> blocks``: give the family's routers in ``module``
            auxiliary-loss-free balancing (:func:`balance_experts`), or ``None``.
    """

    name: str
    interface: str
    find: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    shard: Callable[[nn.Module, AllToAllDispatcher, Callable[[nn.Module], None]], None]
    count_field: Callable[[nn.Module], str]
    unsupported: Callable[[nn.Module, Callable[[nn.Module], bool]], list[str]]
    attach_global_loss: Optional[Callable[[nn.Module, Any, int], Any]] = None
    add_bias: Optional[Callable[[nn.Module, float], int]] = None


_ADAPTERS: dict[str, ExpertAdapter] = {}


def register_expert_adapter(adapter: ExpertAdapter) -> None:
    """Add (or replace, by name) an adapter; integrations call it when they are imported."""
    if not isinstance(adapter, ExpertAdapter):
        raise TypeError(f"`adapter` must be an ExpertAdapter, got {type(adapter).__name__}.")
    _ADAPTERS[adapter.name] = adapter


def expert_adapters() -> tuple[ExpertAdapter, ...]:
    """The registered adapters, in registration order."""
    load_plugins()
    return tuple(_ADAPTERS.values())


def balance_experts(module: nn.Module, bias_update_rate: float = 0.001) -> int:
    """Auxiliary-loss-free balancing (DeepSeek-V3's selection bias, see ``lightning_para.moe.MoE``'s
    ``bias_update_rate``) for every MoE block of ``module``: ``lightning_para.moe.MoE`` layers and those of the
    registered families that support it (LitGPT's ``LLaMAMoE``, transformers' softmax top-k routers and those with
    an ``e_score_correction_bias``). Call it before training; ``ParaStrategy``
    then updates the biases after each optimizer step. Returns how many blocks it gave a bias."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for layer in layers:
        add_expert_bias(layer, layer.num_experts, bias_update_rate)
    count = len(layers) + sum(a.add_bias(module, bias_update_rate) for a in expert_adapters() if a.add_bias)
    if not count:
        raise ValueError(
            f"`balance_experts(bias_update_rate={bias_update_rate})` found no MoE block it can balance in"
            f" {type(module).__name__}: it supports `lightning_para.moe.MoE`"
            + "".join(f", {a.interface}" for a in expert_adapters() if a.add_bias) + "."
        )
    return count


__all__ = ["ExpertAdapter", "balance_experts", "expert_adapters", "register_expert_adapter"]
