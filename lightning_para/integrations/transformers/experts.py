"""Expert parallelism and the router auxiliary loss for transformers Mixture-of-Experts blocks.

transformers 5 gives its MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) one experts
interface: the block's router picks ``top_k_index``/``top_k_weights`` per token and calls an
``experts`` module as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``, whose
parameters are expert-major: ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` shaped
``[num_experts, ...]`` (optionally transposed, with biases). This module recognises that
interface by structure (nothing here imports transformers) and registers it with generic expert
parallelism as an :class:`~lightning_para.parallel.expert.ExpertAdapter` (:data:`ADAPTER`; generic
code never imports an integration): expert parallelism finds the experts through it and hands
them a dispatcher.

* :func:`shard_transformers_experts` keeps this rank's ``num_experts / ep`` experts (the
  parameters become ``Shard(0)`` DTensors, so checkpoints keep the full stacks and the
  ``save_pretrained`` names) and replaces the module's forward by one that sorts the routed rows
  by expert, sends them to the experts' ranks with the dispatcher's all-to-all (the one
  ``lightning_para.moe.MoE`` uses), runs the local experts with the model's own gate function,
  brings the rows back and combines them with ``top_k_weights``.
* :func:`attach_global_router_loss`: a transformers MoE causal LM called with
  ``output_router_logits=True`` adds ``router_aux_loss_coef * aux`` to its loss, where ``aux`` is
  Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4-6) over *all* the tokens and
  layers of its batch. Data parallelism gives each rank a part of the batch, and the loss is not a
  mean over tokens, so the per-rank values do not average to the one-device value. The hook
  recomputes ``aux`` from the batch statistics summed over the data-parallel group (one
  all-reduce of ``2E + 1`` numbers per forward that computes a loss, i.e. is given labels: every
  data-parallel rank must run those forwards, as Lightning's loops do), with the gradient a
  single device would give.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_para._dtensor import scale_grad
from lightning_para.integrations.transformers.balance import add_transformers_bias
from lightning_para.moe.routing import balanced_assignment, rows_per_expert
from lightning_para.parallel.expert.adapters import ExpertAdapter, register_expert_adapter

_MOE_CLASS = re.compile(r"moe|mixtureofexperts", re.IGNORECASE)
# Config fields that hold the number of routed experts, by family (Mixtral, Qwen-MoE/OLMoE, DeepSeek).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
INTERFACE = (
    "the transformers experts interface: an `experts` module called as experts(hidden, top_k_index, top_k_weights)"
    " whose parameters are expert-major (`gate_up_proj` or `up_proj`, and `down_proj`, shaped [num_experts, ...])"
)


class Dispatcher(Protocol):
    """What expert parallelism hands over (``AllToAllDispatcher``): run routed rows on every rank's experts."""

    size: int

    def __call__(self, experts: Callable[[Tensor, list[int]], Tensor], routed: Tensor, counts: Tensor) -> Tensor: ...


# ----------------------------------------------------------------------------- recognition
def _expert_major(module: nn.Module, name: str, num_experts: int) -> bool:
    value = getattr(module, name, None)
    return isinstance(value, nn.Parameter) and value.dim() == 3 and value.shape[0] == num_experts


# Set on every experts class by transformers' `use_experts_implementation` decorator (transformers >= 5).
_INTERFACE_FLAGS = ("has_gate", "has_bias", "is_transposed")


def _called_with_routing(module: nn.Module) -> bool:
    """``forward(hidden, top_k_index, top_k_weights)``: three positional inputs (GPT-OSS names them
    ``router_indices, routing_weights``; the block passes them by position)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def is_transformers_experts(module: nn.Module) -> bool:
    """Whether ``module`` implements the transformers 5 experts interface (see module docstring)."""
    num_experts = getattr(module, "num_experts", None)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        return False
    if not all(isinstance(getattr(module, flag, None), bool) for flag in _INTERFACE_FLAGS):
        return False
    up = "gate_up_proj" if module.has_gate else "up_proj"
    return (
        _expert_major(module, up, num_experts)
        and _expert_major(module, "down_proj", num_experts)
        and _called_with_routing(module)
    )


def transformers_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, experts module)`` for every transformers experts module inside ``module``."""
    return [(name, m) for name, m in module.named_modules() if is_transformers_experts(m)]


def unsupported_moe_blocks(module: nn.Module, known: Callable[[nn.Module], bool]) -> list[str]:
    """MoE-looking blocks (class name says MoE) with no experts that expert parallelism can shard:
    one line each, naming the class and what is missing. ``known`` marks supported blocks."""
    lines = []
    names = [(n, m) for n, m in module.named_modules() if n and _MOE_CLASS.search(type(m).__name__)]
    for name, block in names:
        if known(block) or any(known(m) or is_transformers_experts(m) for m in block.modules()):
            continue
        if any(name.startswith(other + ".") for other, _ in names if other != name):
            continue  # reported through its enclosing block
        experts = getattr(block, "experts", None)
        if experts is None:
            missing = "no `experts` submodule"
        elif isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            missing = f"`experts` is an nn.{type(experts).__name__} of per-expert modules (transformers 4 layout)"
        elif not all(hasattr(experts, flag) for flag in _INTERFACE_FLAGS):
            missing = (
                f"`experts` ({type(experts).__name__}) is not a transformers experts class (no `has_gate`/`has_bias`/"
                "`is_transposed` from transformers' `use_experts_implementation`)"
            )
        elif not _called_with_routing(experts):
            missing = f"`experts` ({type(experts).__name__}) is not called as experts(hidden, top_k_index, top_k_weights)"
        else:
            missing = f"`experts` ({type(experts).__name__}) has no expert-major `gate_up_proj`/`up_proj` and `down_proj`"
        lines.append(f"`{name}` ({type(block).__name__}): {missing}")
    return lines


def expert_count_field(experts: nn.Module) -> str:
    """The config field that sets ``experts.num_experts`` (for error messages)."""
    config = getattr(experts, "config", None)
    for field in EXPERT_COUNT_FIELDS:
        if getattr(config, field, None) == experts.num_experts:
            return f"config.{field}"
    return "num_experts"


# ----------------------------------------------------------------------------- expert parallel forward
@dataclass
class _Layout:
    """How one experts module stores its weights (the flags transformers' decorator sets)."""

    up: str  # "gate_up_proj" or "up_proj"
    has_gate: bool
    has_bias: bool
    transposed: bool
    post_norm: bool


def _layout(experts: nn.Module) -> _Layout:
    has_gate = bool(getattr(experts, "has_gate", True))
    return _Layout(
        up="gate_up_proj" if has_gate else "up_proj", has_gate=has_gate,
        has_bias=bool(getattr(experts, "has_bias", False)), transposed=bool(getattr(experts, "is_transposed", False)),
        post_norm=bool(getattr(experts, "has_post_expert_norm", False)),
    )


def _local(experts: nn.Module, name: str, grad_scale: float) -> Tensor:
    w = getattr(experts, name)
    w = w.to_local() if isinstance(w, DTensor) else w
    return scale_grad(w, grad_scale) if grad_scale != 1.0 else w


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    return out + bias if bias is not None else out


def run_local_experts(experts: nn.Module, rows: Tensor, counts: list[int], grad_scale: float = 1.0) -> Tensor:
    """This rank's experts on ``rows`` grouped by local expert (``counts[e]`` rows each), in the
    model's own math: up (or gate|up) projection, its ``_apply_gate``/activation, down projection."""
    layout = _layout(experts)
    up, down = _local(experts, layout.up, grad_scale), _local(experts, "down_proj", grad_scale)
    up_bias = _local(experts, f"{layout.up}_bias", grad_scale) if layout.has_bias else None
    down_bias = _local(experts, "down_proj_bias", grad_scale) if layout.has_bias else None
    outputs = []
    # Every local expert runs, even on zero rows, so each weight always gets a gradient.
    for e, chunk in enumerate(rows.split(counts)):
        h = _linear(chunk, up[e], up_bias[e] if up_bias is not None else None, layout.transposed)
        h = experts._apply_gate(h) if layout.has_gate else experts.act_fn(h)
        h = _linear(h, down[e], down_bias[e] if down_bias is not None else None, layout.transposed)
        if layout.post_norm:
            h = experts.post_expert_norm(h)
        outputs.append(h)
    return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[-1])


def _expert_parallel_forward(
    experts: nn.Module, dispatcher: Dispatcher, grad_scale: float, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    num_tokens, k = top_k_index.shape
    balanced_counts: Optional[list[int]] = None
    if getattr(experts, "balanced_routing", False):
        # The dry run on meta tensors (`lightning_para.moe.balanced_routing`): the fixed, balanced assignment
        # whose rows per expert are host integers; the weights stay the router's (shapes only on meta).
        top_k_index, balanced_counts = balanced_assignment(num_tokens, k, experts.num_experts, hidden.device)
    expert_of = top_k_index.reshape(-1)
    # Assignments (token t, slot j) -> row t*k+j, sorted by expert (stable: token order within one).
    order = torch.argsort(expert_of, stable=True)
    counts = rows_per_expert(expert_of, experts.num_experts)
    routed = hidden[order // k]
    run = partial(run_local_experts, experts, grad_scale=grad_scale)
    dispatch = partial(dispatcher, balanced_counts=balanced_counts) if balanced_counts is not None else dispatcher
    expert_out = dispatch(lambda rows, local_counts: run(rows, local_counts), routed, counts)
    slots = expert_out.new_zeros(num_tokens * k, expert_out.shape[-1]).index_copy(0, order, expert_out)
    out = (slots.view(num_tokens, k, -1) * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(1)
    return out.to(hidden.dtype)


def shard_transformers_experts(experts: nn.Module, dispatcher: Dispatcher, shard: Callable[[nn.Module], None]) -> None:
    """Make ``experts`` expert-parallel: ``shard(experts)`` splits its parameters over ``ep`` (``Shard(0)``),
    and its forward runs the routed rows through ``dispatcher``. Expert gradients are scaled by
    ``1/ep`` (they sum the tokens of all ``ep`` ranks, and data parallelism averages over ``edp``)."""
    shard(experts)
    # Instance attributes: module and parameter names stay those of the model.
    experts.forward = partial(_expert_parallel_forward, experts, dispatcher, 1.0 / dispatcher.size)
    experts.balanced_routing = False  # the dry run's switch (`lightning_para.moe.balanced_routing`)


# ----------------------------------------------------------------------------- router auxiliary loss
def router_statistics(
    router_logits: tuple[Tensor, ...], num_experts: int, top_k: int, attention_mask: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Sums over layers and (unmasked) rows of transformers' ``load_balancing_loss_func``: top-k
    assignments per expert, router probabilities per expert (differentiable) and the row count."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = attention_mask.reshape(-1).to(device=device, dtype=torch.float32) if attention_mask is not None else None
    for logits in router_logits:
        p = torch.softmax(logits.to(device).float(), dim=-1)
        selected = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        w = weight if weight is not None else torch.ones(p.shape[0], dtype=torch.float32, device=device)
        counts = counts + torch.zeros_like(counts).scatter_add(0, selected, w.repeat_interleave(top_k))
        probs = probs + (p * w.unsqueeze(-1)).sum(0)
        rows = rows + w.sum()
    return counts, probs, rows


def balancing_loss(counts: Tensor, probs: Tensor, rows: Tensor, num_experts: int) -> Tensor:
    """``E * sum_e f_e P_e`` with ``f = counts / rows`` and ``P = probs / rows`` (Switch, eq. 4)."""
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def global_balancing_loss(
    counts: Tensor, probs: Tensor, rows: Tensor, num_experts: int, group: Any, group_size: int
) -> Tensor:
    """The one-device value of the balancing loss over the data-parallel group's whole batch.

    Value: from the statistics summed over the group. Gradient: ``d aux / d probs_r = E f_e / N``
    of the whole batch, times ``group_size`` because data parallelism then averages the ranks'
    gradients. One all-reduce of ``2E + 1`` numbers.
    """
    stacked = torch.cat([counts.detach(), probs.detach(), rows.detach().reshape(1)])
    dist.all_reduce(stacked, group=group)
    total_counts, total_probs, total_rows = stacked[:num_experts], stacked[num_experts:-1], stacked[-1]
    probs_with_grad = total_probs + group_size * (probs - probs.detach())
    return balancing_loss(total_counts, probs_with_grad, total_rows, num_experts)


def is_transformers_moe_lm(module: nn.Module) -> bool:
    """A transformers MoE causal LM that can add the router loss (Mixtral, Qwen-MoE, OLMoE, ...)."""
    return all(isinstance(getattr(module, a, None), (int, float)) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")) and hasattr(module, "config")


def _global_router_loss_hook(group: Any, group_size: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    aux_local = getattr(output, "aux_loss", None)
    router_logits = getattr(output, "router_logits", None)
    if not isinstance(aux_local, Tensor) or not router_logits or getattr(output, "loss", None) is None:
        # No router loss requested, a tuple output, or no loss computed (no labels: generation, which
        # may run on one rank only, must not wait in a collective).
        return output
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    num_experts, top_k = int(module.num_experts), int(module.num_experts_per_tok)
    counts, probs, rows = router_statistics(tuple(router_logits), num_experts, top_k, mask)
    mine = balancing_loss(counts, probs, rows, num_experts)
    if not torch.allclose(mine.detach().float(), aux_local.detach().float().to(mine.device), rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"`{type(module).__name__}` returned aux_loss={float(aux_local):.6g}, but its router logits give"
            f" {float(mine):.6g} by transformers' load_balancing_loss_func: this model computes its router loss"
            " differently, so lightning-para cannot make it the one-device value over data-parallel ranks."
            " Set config.output_router_logits=False, or train it with dp=1."
        )
    aux_global = global_balancing_loss(counts, probs, rows, num_experts, group, group_size)
    coef = float(module.router_aux_loss_coef)
    output.loss = output.loss + coef * (aux_global - aux_local.to(aux_global.device))
    output.aux_loss = aux_global
    return output


def attach_global_router_loss(module: nn.Module, group: Any, group_size: int) -> list[nn.Module]:
    """Make every transformers MoE causal LM in ``module`` report the data-parallel group's one-device
    router loss (see module docstring). Returns the models it hooked."""
    models = [m for m in module.modules() if is_transformers_moe_lm(m)]
    for m in models:
        m.register_forward_hook(partial(_global_router_loss_hook, group, group_size), with_kwargs=True)
    return models


def add_router_bias(module: nn.Module, bias_update_rate: float) -> int:
    """``balance_experts`` for transformers models: a selection bias on the routers of the blocks whose experts
    expert parallelism shards (:mod:`~lightning_para.integrations.transformers.balance`)."""
    return add_transformers_bias(module, bias_update_rate, transformers_experts(module))


# What `apply_expert_parallel` / `check_expert_layout` use for transformers models; registered on import.
ADAPTER = ExpertAdapter(
    name="transformers",
    interface=INTERFACE,
    find=transformers_experts,
    shard=shard_transformers_experts,
    count_field=expert_count_field,
    unsupported=unsupported_moe_blocks,
    attach_global_loss=attach_global_router_loss,
    add_bias=add_router_bias,
)
register_expert_adapter(ADAPTER)


__all__ = [
    "ADAPTER", "EXPERT_COUNT_FIELDS", "INTERFACE", "add_router_bias", "attach_global_router_loss", "balancing_loss", "expert_count_field",
    "global_balancing_loss", "is_transformers_experts", "is_transformers_moe_lm",
    "router_statistics", "run_local_experts", "shard_transformers_experts", "transformers_experts",
    "unsupported_moe_blocks",
]
