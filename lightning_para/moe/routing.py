"""Routing math of the MoE layer (no communication): expert selection and its bias, capacity, auxiliary losses, the dry
run's balanced assignment."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, top_k: int) -> int:
    """Assignments one expert may take: ``ceil(tokens / experts * factor * k)`` (Switch eq. 3, times k)."""
    return int(math.ceil(num_tokens / num_experts * capacity_factor * top_k))


def capacity_keep_mask(indices: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Which of the ``[T, k]`` assignments fit: per expert, k-slot 0 of all tokens first, then slot 1, ..."""
    k = indices.shape[1]
    slot_major = indices.t().reshape(-1)  # priority order: (slot, token)
    one_hot = F.one_hot(slot_major, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # 0-based position inside its expert
    return (position < capacity).view(k, -1).t()


def load_balancing_loss(probs: Tensor, indices: Tensor, num_experts: int, groups: int = 1) -> Tensor:
    """``E * sum_i f_i * P_i`` averaged over ``groups`` equal runs of tokens (unweighted by alpha).

    ``probs``: ``[T, E]`` router probabilities; ``indices``: ``[T, k]`` chosen experts. Each
    group (a sequence, by default) gets its own ``f`` and ``P``; balanced routing gives 1.
    """
    tokens, k = indices.shape
    per_group = tokens // groups
    counts = F.one_hot(indices, num_experts).view(groups, per_group * k, num_experts).sum(1)
    f = counts.to(probs.dtype) / (per_group * k)
    p = probs.view(groups, per_group, num_experts).mean(1)
    return num_experts * (f * p).sum(-1).mean()


def balanced_assignment(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> tuple[Tensor, list[int]]:
    """The dry run's routing: token ``t``'s ``j``-th choice is expert ``(t * top_k + j) mod E``.

    Returns the ``[T, k]`` expert indices and the rows per expert as host integers
    (``ceil`` or ``floor`` of ``T k / E``: perfectly balanced, the load the planner prices).
    Computed from shapes only, so it works on the meta device, where routing cannot read values.
    """
    rows = num_tokens * top_k
    indices = (torch.arange(rows, device=device) % num_experts).view(num_tokens, top_k)
    base, extra = divmod(rows, num_experts)
    return indices, [base + (1 if e < extra else 0) for e in range(num_experts)]


def rows_per_expert(expert_of: Tensor, num_experts: int) -> Tensor:
    """How many routed rows each expert gets, ``[num_experts]`` (``expert_of``: each row's expert). A static shape:
    ``bincount``'s length depends on the data, which breaks a compiled graph, and it has no meta kernel (dry run)."""
    return torch.zeros(num_experts, dtype=torch.long, device=expert_of.device).index_add_(
        0, expert_of, torch.ones_like(expert_of)
    )


def select_experts(probs: Tensor, expert_bias: Optional[Tensor], top_k: int) -> tuple[Tensor, Tensor]:
    """``(gates, experts)``, each ``[T, k]``: the top-k of ``probs + expert_bias``; the bias steers the selection
    only, the gates stay the chosen experts' unbiased ``probs``."""
    if expert_bias is None:
        return probs.topk(top_k, dim=-1)
    indices = (probs + expert_bias).topk(top_k, dim=-1).indices
    return probs.gather(-1, indices), indices


def add_expert_bias(router: nn.Module, num_experts: int, bias_update_rate: float, bias_buffer: str = "expert_bias") -> None:
    """Give ``router`` auxiliary-loss-free balancing: ``bias_update_rate`` and, when it is > 0, the buffers
    ``expert_bias`` (fp32, in checkpoints) and ``expert_load`` (the assignments per expert since the last
    update; its owner adds to it in training forwards). ``bias_buffer``: the name of the bias; another name
    than ``expert_bias`` is a buffer the router already has (a model's own correction bias), updated in place."""
    if isinstance(bias_update_rate, bool) or not isinstance(bias_update_rate, (int, float)) or bias_update_rate < 0:
        raise ValueError(
            f"`bias_update_rate={bias_update_rate!r}` must be a number >= 0 (DeepSeek-V3 uses 0.001; 0 disables the bias)."
        )
    router.bias_update_rate, router.bias_buffer = float(bias_update_rate), bias_buffer
    router.counting_load = True  # off inside `moe_stats_paused`
    if bias_update_rate:
        device = next(iter(router.parameters()), torch.empty(0)).device
        if bias_buffer == "expert_bias":
            router.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
        router.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.long, device=device), persistent=False)


def record_load(router: nn.Module, indices: Tensor) -> None:
    """Add the assignments ``indices`` (``[T, k]``) to ``router.expert_load`` in a training forward (not in eval,
    not in an activation-checkpoint recomputation, which would count them twice, nor inside ``moe_stats_paused``)."""
    if router.training and router.counting_load and not in_backward():
        router.expert_load += rows_per_expert(indices.reshape(-1).detach(), router.expert_load.numel())


def in_backward() -> bool:
    """Whether autograd is running a backward now (activation checkpointing recomputes forwards there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)  # private: see docs/architecture.md
    return current is not None and current() != -1


def router_z_loss(logits: Tensor) -> Tensor:
    """``mean_t logsumexp(logits_t)^2``: keeps router logits small (ST-MoE eq. 5, unweighted)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


__all__ = ["add_expert_bias", "balanced_assignment", "expert_capacity", "capacity_keep_mask", "in_backward",
           "load_balancing_loss", "record_load", "router_z_loss", "rows_per_expert", "select_experts"]
