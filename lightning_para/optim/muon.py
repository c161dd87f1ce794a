"""Muon for the hidden matrices and AdamW for the rest, in one optimizer that is exact under every layout.

The Muon update is ``torch.optim.Muon``'s (its momentum, its Newton-Schulz iteration and coefficients, its
shape-dependent learning rate: torch's own functions), and the AdamW update is ``torch.optim.AdamW``'s
(torch's functional ``adam``). What this adds is the layout: a matrix the optimizer steps may be a shard (a
ZeRO-1/2 row shard, a ZeRO-3 or tensor-parallel DTensor shard); the momentum stays elementwise on the shard
(so its state saves and reshards as AdamW's), and each matrix is orthogonalized whole on one owner rank
(:mod:`lightning_para.optim.routing`). ``ns_dtype`` runs the same Newton-Schulz in another dtype than bfloat16.
``docs/optimizers.md`` has the split, the costs and the limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
# private: see docs/architecture.md
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.adam import adam

from lightning_para._dtensor import local_tensor
from lightning_para.optim.routing import MatrixRoute, sharded_mesh_dims

# Module names (any part of a parameter's qualified name) whose matrices AdamW steps: embeddings and heads.
ADAMW_NAMES = frozenset({"embed", "embed_tokens", "embeddings", "wte", "wpe", "lm_head", "head", "output",
                         "classifier", "score"})
_ADAMW_KEYS = ("betas", "eps", "weight_decay")


def uses_muon(name: str, param: Tensor, module: Optional[nn.Module] = None) -> bool:
    """The default split: Muon for matrices (2-D, or stacked 3-D expert weights) of hidden layers; AdamW for
    embeddings (an ``nn.Embedding``'s parameter or a name in :data:`ADAMW_NAMES`), the head, norms and biases."""
    if param.dim() < 2 or isinstance(module, nn.Embedding):
        return False
    return not any(part in ADAMW_NAMES for part in name.split("."))


def split_param_groups(module: nn.Module, is_muon: Callable[[str, Tensor, Optional[nn.Module]], bool] = uses_muon
                       ) -> list[dict[str, Any]]:
    """``module``'s parameters as two groups, ``use_muon`` True and False (``is_muon(name, param, owner)``)."""
    owner = {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}
    muon, other = [], []
    for name, p in module.named_parameters():
        (muon if is_muon(name, p, owner.get(id(p))) else other).append(p)
    return [g for g in ({"params": muon, "use_muon": True}, {"params": other, "use_muon": False}) if g["params"]]


class Muon(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``'s update) for hidden matrices, AdamW for embeddings, head, norms and biases.

    Args:
        params: a module (split by :func:`uses_muon`), or parameter groups each saying ``"use_muon"`` (per-group
            values override the defaults below; a group without ``"use_muon"`` is split by shape: Muon for >= 2-D).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: Muon's, as in
            ``torch.optim.Muon``.
        ns_dtype: the dtype Newton-Schulz runs in (and its pieces travel in): torch's bfloat16 by default;
            ``torch.float32`` where bfloat16 matmuls are slow (CPUs without bfloat16 instructions: about 100x).
        adamw_lr: AdamW's learning rate (default: ``lr``); adamw_betas, adamw_eps, adamw_weight_decay: AdamW's.

    Every matrix is orthogonalized whole, whatever the layout (ZeRO 0-3, HSDP, tensor, pipeline, expert and
    context parallelism); a stacked ``[experts, a, b]`` weight per expert. State: ``momentum_buffer`` for
    Muon's parameters, AdamW's ``step``/``exp_avg``/``exp_avg_sq`` for the rest.
    """

    def __init__(
        self,
        params: Union[nn.Module, Iterable[Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: Optional[float] = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        torch.optim.Muon([nn.Parameter(torch.zeros(1, 1))], lr=lr, weight_decay=weight_decay, momentum=momentum,
                         adjust_lr_fn=adjust_lr_fn)  # torch's own checks of Muon's arguments
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr if adamw_lr is None else adamw_lr,
                          betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"`ns_dtype={ns_dtype!r}`: pass a floating-point torch.dtype (torch.float32, ...).")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        adamw = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                     weight_decay=adamw_weight_decay, amsgrad=False, maximize=False, foreach=None, capturable=False,
                     differentiable=False, fused=None, decoupled_weight_decay=True)
        groups = split_param_groups(params) if isinstance(params, nn.Module) else _groups_of(params)
        super().__init__([g if g["use_muon"] else {**adamw, **g} for g in groups], {**defaults, "use_muon": True})
        self._views: dict[int, DTensor] = {}
        self._routes: dict[tuple[int, ...], MatrixRoute] = {}

    def set_shard_view(self, param: Tensor, view: DTensor) -> None:
        """Say that ``param`` (a tensor this optimizer steps, e.g. a ZeRO-1/2 row shard) holds this rank's
        values of the global ``view``: its matrix is then orthogonalized whole. Data parallelism calls this."""
        self._views[id(param)] = view

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step: Muon on the ``use_muon`` groups, AdamW on the others."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        return loss

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        has_complex = torch.optim.Adam._init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, amsgrad=group["amsgrad"], has_complex=has_complex,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"], decoupled_weight_decay=True)

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p.dim() not in (2, 3):
                raise ValueError(f"Muon steps 2-D matrices (3-D: one per expert); a parameter has shape "
                                 f"{tuple(p.shape)}. Put it in a group with `use_muon=False` (AdamW).")
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        momentum, lr = group["momentum"], group["lr"]
        local = [local_tensor(p) for p in params]
        grads = [local_tensor(p.grad) for p in params]
        bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        views = [self._views.get(id(p), p) for p in params]
        orthogonal = self._orthogonalize(group, views, updates)
        torch._foreach_mul_(local, 1 - lr * group["weight_decay"])
        by_lr: dict[float, list[int]] = {}
        for i, view in enumerate(views):
            by_lr.setdefault(_adjust_lr(lr, group["adjust_lr_fn"], view.shape[-2:]), []).append(i)
        for scaled, index in by_lr.items():
            torch._foreach_add_([local[i] for i in index], [orthogonal[i].view(local[i].shape) for i in index],
                                alpha=-scaled)

    def _orthogonalize(self, group: dict[str, Any], views: list[Tensor], updates: list[Tensor]) -> list[Tensor]:
        """Newton-Schulz of each whole matrix; this rank's pieces of the results (in ``ns_dtype``)."""
        dtype = group.get("ns_dtype", torch.bfloat16)

        def newton_schulz(_: int, matrix: Tensor) -> Tensor:
            if matrix.dim() == 2:
                args = (matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
                return _zeropower_via_newtonschulz(*args) if dtype == torch.bfloat16 else _newton_schulz(*args, dtype)
            return torch.stack([newton_schulz(0, m) for m in matrix]) if len(matrix) else matrix.to(dtype)

        out: list[Optional[Tensor]] = [None] * len(views)
        routed: dict[tuple, list[int]] = {}
        for i, view in enumerate(views):
            dims = sharded_mesh_dims(view)
            if view.dim() == 3 and all(view.placements[d].dim == 0 for d in dims):
                dims = ()  # experts split whole between ranks: each rank's experts are whole matrices
            if not dims:
                out[i] = newton_schulz(i, updates[i])
            else:
                mesh = view.device_mesh
                routed.setdefault((mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()), dims), []).append(i)
        for index in routed.values():
            key = tuple(id(views[i]) for i in index)
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = MatrixRoute([views[i] for i in index])
            pieces = route.apply([updates[i].to(dtype) for i in index], newton_schulz)
            for i, piece in zip(index, pieces):
                out[i] = piece
        return out  # type: ignore[return-value]


def _newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                   dtype: torch.dtype) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` (Muon's quintic iteration) in ``dtype`` instead of bfloat16."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype).T if tall else matrix.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _groups_of(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups from what ``torch.optim`` accepts; groups without ``use_muon`` are split by shape."""
    items = list(params)
    if not items or not isinstance(items[0], Mapping):
        items = [{"params": items}]
    groups = []
    for g in items:
        if "use_muon" in g:
            groups.append(dict(g))
            continue
        ps = list(g["params"])
        for flag in (True, False):
            chosen = [p for p in ps if (p.dim() >= 2) == flag]
            if chosen:
                groups.append({**g, "params": chosen, "use_muon": flag})
    return groups


__all__ = ["ADAMW_NAMES", "Muon", "split_param_groups", "uses_muon"]
