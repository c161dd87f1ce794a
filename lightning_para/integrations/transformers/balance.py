"""Auxiliary-loss-free balancing (DeepSeek-V3's selection bias) for transformers MoE blocks.

A transformers 5 MoE block calls its router as ``gate(hidden) -> (logits, weights, indices)`` (``router`` in
GPT-OSS and Granite) and hands ``weights``/``indices`` to its experts. :func:`add_transformers_bias` wraps that
call (an instance ``forward``; the router's own code still runs):

* a softmax top-k router (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Jamba, ...): the experts are chosen again as the
  top-k of ``softmax(logits) + expert_bias``; the weights stay the chosen experts' unbiased probabilities,
  renormalised over the k if the router does that;
* a router with its own correction bias buffer (``e_score_correction_bias``: DeepSeek-V3, GLM-4-MoE, dots.llm1,
  ...), which already selects by ``scores + bias`` and weights by the unbiased scores: that buffer is the bias.

Before wrapping, the router runs once on fixed inputs and must give what one of these would (a changed router in
another transformers version, or another kind, is refused with a ``ValueError``); that run also tells whether it
renormalises (on the meta device its ``norm_topk_prob`` flag decides, default yes).

Either way the chosen experts are counted into ``expert_load``, and ``update_expert_bias`` (the one update of
every MoE path) moves the bias after each optimizer step.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.moe.routing import add_expert_bias, record_load, select_experts

ROUTER_NAMES = ("gate", "router")
NATIVE_BIAS = "e_score_correction_bias"


def softmax_top_k(router: nn.Module, logits: Tensor, bias: Optional[Tensor], k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(weights, indices)``: the top-k of ``softmax(logits) + bias``, weighted by the unbiased probabilities
    (renormalised over the k when the router does: ``router.renormalize``)."""
    weights, indices = select_experts(torch.softmax(logits, dim=-1, dtype=torch.float32), bias, k)
    if router.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), indices


def _biased_route(router: nn.Module, route: Callable[..., Any], hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
    logits, weights, indices = route(hidden, *args, **kwargs)
    if router.bias_buffer != NATIVE_BIAS:
        weights, indices = softmax_top_k(router, logits, router.expert_bias, indices.shape[-1], weights.dtype)
    record_load(router, indices)
    return logits, weights, indices


def _native_bias(block_name: str, block: nn.Module, router: nn.Module) -> bool:
    """Whether ``router`` has its own correction bias buffer; one elsewhere in the block (or a parameter) is refused:
    the router would select by it unseen, or an optimizer would own it."""
    own = dict(router.named_buffers(recurse=False)).get(NATIVE_BIAS)
    others = [n for n, t in (*block.named_buffers(), *block.named_parameters()) if n.endswith(NATIVE_BIAS) and t is not own]
    if others:
        raise ValueError(
            f"`balance_experts`: `{f'{block_name}.{others[0]}'.lstrip('.')}` is a correction bias that is not a buffer"
            " of the block's router (not supported: balance this model with its auxiliary loss, or drive that bias"
            " yourself)."
        )
    return own is not None


def _routes_as_softmax_top_k(router: nn.Module, out: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Whether the router's output is the softmax top-k of its logits, renormalised or not (``router.renormalize``)."""
    for renormalize in (True, False):
        router.renormalize = renormalize
        weights, indices = softmax_top_k(router, out[0], None, out[2].shape[-1], out[1].dtype)
        mine, theirs = indices.argsort(-1), out[2].argsort(-1)  # a router may not sort its top-k
        if torch.equal(indices.gather(-1, mine), out[2].gather(-1, theirs)) and torch.allclose(
                weights.gather(-1, mine), out[1].gather(-1, theirs), rtol=1e-4, atol=1e-6):
            return True
    return False


@torch.no_grad()
def _check_router(name: str, router: nn.Module, native: bool) -> None:
    """Run the router once on fixed inputs (no RNG consumed): refuse one whose output is not ``(logits, weights,
    indices)`` or, without a native bias, whose routing is not softmax top-k; set ``router.renormalize``."""
    router.renormalize = bool(getattr(router, "norm_topk_prob", True))
    weight = next((p for p in router.parameters() if p.dim() == 2), None)  # [num_experts, hidden]
    if weight is not None and weight.is_meta:
        return  # no values yet: the flag above decides, unchecked
    out = None
    if weight is not None:
        hidden = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        out = getattr(router, "unbiased_forward", router)(hidden)
    shaped = isinstance(out, tuple) and len(out) == 3 and out[2].dim() == 2 and not out[2].is_floating_point()
    if not shaped or not (native or _routes_as_softmax_top_k(router, out)):
        raise ValueError(
            f"`balance_experts`: the router `{name}` ({type(router).__name__}) does not route as softmax top-k"
            f" returning (logits, weights, indices) and has no `{NATIVE_BIAS}`, so no selection bias can be added to"
            " it (another transformers version or family). Balance this model with its auxiliary loss instead."
        )


def add_transformers_bias(module: nn.Module, bias_update_rate: float, experts: list[tuple[str, nn.Module]]) -> int:
    """Auxiliary-loss-free balancing for the routers of the MoE blocks holding ``experts`` (``(name, experts
    module)`` in ``module``, see module docstring). Returns how many routers it gave a bias."""
    for name, experts_module in experts:
        block_name = name.rpartition(".")[0]
        block = module.get_submodule(block_name)
        router_name = next((n for n in ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
        if router_name is None:
            raise ValueError(f"`balance_experts`: the MoE block `{block_name}` has no router (`gate` or `router`) to bias.")
        router = getattr(block, router_name)
        native = _native_bias(block_name, block, router)
        _check_router(f"{block_name}.{router_name}".lstrip("."), router, native)
        add_expert_bias(router, int(experts_module.num_experts), bias_update_rate, NATIVE_BIAS if native else "expert_bias")
        if bias_update_rate and not hasattr(router, "unbiased_forward"):
            router.unbiased_forward = router.forward
            router.forward = partial(_biased_route, router, router.unbiased_forward)
    return len(experts)


__all__ = ["NATIVE_BIAS", "add_transformers_bias", "softmax_top_k"]
