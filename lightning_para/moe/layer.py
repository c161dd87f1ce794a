"""The MoE modules: router, stacked experts, shared expert, and the layer that ties them together."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_para._dtensor import scale_grad
from lightning_para.moe.grouped import IMPLEMENTATIONS, grouped_linear
from lightning_para.moe.routing import (
    add_expert_bias, balanced_assignment, capacity_keep_mask, expert_capacity, in_backward, load_balancing_loss,
    router_z_loss, rows_per_expert, select_experts,
)

ACTIVATIONS = ("swiglu", "gelu")
BALANCE_SCOPES = ("sequence", "batch")



@dataclass(frozen=True)
class MoEStats:
    """One MoE layer's routing statistics over the training forwards since the last :meth:`MoE.pop_stats`.

    ``balance_loss`` and ``z_loss`` (weighted, mean over forwards), ``aux_loss`` (their sum),
    ``dropped_fraction`` (of the k*T assignments), ``tokens_per_expert`` (assignments this rank
    routed to each expert, summed over forwards) and ``load_imbalance`` (max / mean of those
    counts; 1 is perfectly even).
    """

    balance_loss: float
    z_loss: float
    aux_loss: float
    dropped_fraction: float
    tokens_per_expert: list[int]
    load_imbalance: float

class ExpertDispatcher(Protocol):
    """Runs routed tokens on experts that live elsewhere (expert parallelism hands one to the layer).

    Called as ``dispatcher(experts, routed, counts)``: ``routed`` holds the token rows sorted by
    global expert id, ``counts[e]`` rows for expert ``e``; it returns each row's expert output in
    the same order. ``experts(rows, rows_per_local_expert)`` runs this rank's experts.
    """

    size: int  # ranks the experts are spread over

    def __call__(
        self, experts: Callable[[Tensor, list[int]], Tensor], routed: Tensor, counts: Tensor,
        balanced_counts: Optional[list[int]] = None,
    ) -> Tensor: ...


class TopKRouter(nn.Module):
    """Token -> expert logits (``[T, E]``, fp32). Not an ``nn.Linear`` on purpose: tensor
    parallel plans shard linears, and the router must stay whole on every rank."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default

    def forward(self, tokens: Tensor) -> Tensor:
        # Selective precision (Switch Transformer Sec. 2.4): routing in fp32 even under autocast.
        if not torch.amp.is_autocast_available(tokens.device.type):  # the dry run's meta tensors
            return F.linear(tokens.float(), self.weight.float())
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            return F.linear(tokens.float(), self.weight.float())


class GroupedExperts(nn.Module):
    """``num_experts`` FFNs with stacked weights: ``w1, w3: [E, dim, hidden]``, ``w2: [E, hidden, dim]``.

    The local experts run as grouped matrix products, one kernel per weight
    (:mod:`lightning_para.moe.grouped`; ``implementation="loop"`` runs one matmul per expert).
    Expert parallelism replaces each weight by a DTensor sharded ``Shard(0)`` over the ``ep``
    mesh, so a rank holds ``E / ep`` whole experts and checkpoints see the full stack.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, activation: str = "swiglu", implementation: str = "auto"
    ) -> None:
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"`implementation={implementation!r}` is unknown. Choose one of {IMPLEMENTATIONS}.")
        self.dim, self.hidden_dim, self.num_experts, self.activation = dim, hidden_dim, num_experts, activation
        self.implementation = implementation
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        # Set by expert parallelism: expert gradients sum the tokens of all `ep` ranks' losses.
        self.grad_scale = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Each expert initialised like nn.Linear (U(-1/sqrt(fan_in), 1/sqrt(fan_in))).
        for w, fan_in in ((self.w1, self.dim), (self.w2, self.hidden_dim), (self.w3, self.dim)):
            if w is not None:
                nn.init.uniform_(w, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))

    def local_weights(self) -> list[Optional[Tensor]]:
        """This rank's expert weights as plain tensors (DTensor shards unwrapped)."""
        out: list[Optional[Tensor]] = []
        for w in (self.w1, self.w2, self.w3):
            if w is not None and isinstance(w, DTensor):
                w = w.to_local()
            if w is not None and self.grad_scale != 1.0:
                w = scale_grad(w, self.grad_scale)
            out.append(w)
        return out

    def forward(self, tokens: Tensor, counts: list[int]) -> Tensor:
        """``tokens`` grouped by local expert, ``counts[e]`` rows each; returns the same layout."""
        w1, w2, w3 = self.local_weights()
        # Experts with zero rows still get a (zero) gradient: each weight is one tensor.
        h = grouped_linear(tokens, w1, counts, self.implementation)
        h = F.silu(h) * grouped_linear(tokens, w3, counts, self.implementation) if w3 is not None else F.gelu(h)
        return grouped_linear(h, w2, counts, self.implementation)


class FeedForward(nn.Module):
    """A dense FFN (the shared expert): ``w2(act(w1 x) [* w3 x])`` with ``nn.Linear`` weights."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if activation == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.w1(x)
        h = F.silu(h) * self.w3(x) if self.w3 is not None else F.gelu(h)
        return self.w2(h)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in backward also feeds ``d aux = scale`` (Megatron-LM's auto-scaler idea).

    So the aux loss trains the router wherever the layer sits (inside a pipeline stage too)
    without the LightningModule adding it to its loss.
    """

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, layer: "MoE") -> Tensor:
        ctx.layer = layer
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        scale = ctx.layer.aux_loss_grad_scale
        return grad, torch.full(ctx.aux_shape, scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoE(nn.Module):
    """Top-k routed Mixture-of-Experts FFN; input ``[..., dim]``, output the same shape.

    Args:
        dim: model width.
        hidden_dim: hidden width of each expert.
        num_experts: number of routed experts ``E``.
        top_k: experts per token (1: Switch, 2: GShard/Mixtral); ``<= num_experts``.
        activation: ``"swiglu"`` (Mixtral, DeepSeek) or ``"gelu"`` (Switch, GShard).
        shared_hidden_dim: hidden width of an always-on shared expert (DeepSeekMoE); ``None``: none.
        capacity_factor: ``None`` for dropless routing (default), else ``> 0``.
        balance_loss_weight: ``alpha`` of the load-balancing loss (Switch uses 0.01).
        z_loss_weight: ``beta`` of the router z-loss (ST-MoE uses 0.001); 0 disables it.
        balance_scope: ``"sequence"`` (default): ``f`` and ``P`` per sequence of a
            ``[batch, seq, dim]`` input, then averaged, so the loss is the same however the batch
            is split over data-parallel ranks, pipeline microbatches or accumulation steps;
            ``"batch"``: over all tokens of this forward (Switch's batch statistic; it then
            depends on the per-rank batch size).
        normalize_top_k: rescale the k gates to sum to 1 (default: ``top_k > 1``, as Mixtral;
            Switch's k=1 gate is the raw probability).
        bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias (buffer
            ``expert_bias``) added to the probabilities for the top-k *selection* only, moved by this
            much towards the mean load after each optimizer step (:func:`~lightning_para.moe.update_expert_bias`);
            0 (default) disables it. Beside the auxiliary losses or instead of them (``balance_loss_weight=0``).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: str = "swiglu",
        shared_hidden_dim: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        balance_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        balance_scope: str = "sequence",
        normalize_top_k: Optional[bool] = None,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        _validate(num_experts, top_k, activation, capacity_factor, balance_loss_weight, z_loss_weight, balance_scope)
        add_expert_bias(self, num_experts, bias_update_rate)
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.balance_loss_weight, self.z_loss_weight = float(balance_loss_weight), float(z_loss_weight)
        self.balance_scope = balance_scope
        self.normalize_top_k = top_k > 1 if normalize_top_k is None else normalize_top_k
        self.router = TopKRouter(dim, num_experts)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, activation)
        self.shared_expert = FeedForward(dim, shared_hidden_dim, activation) if shared_hidden_dim else None
        # d(training loss)/d(aux loss) in backward; ParaStrategy sets it (loss scale / accumulation).
        self.aux_loss_grad_scale = 1.0
        self.dispatcher: Optional[ExpertDispatcher] = None  # see `set_dispatcher`
        # The dry run's balanced routing (`lightning_para.moe.balanced_routing`); never set in training.
        self.balanced_routing = False
        self._recording = True  # see `moe_stats_paused`
        self._reset_stats()

    def reset_parameters(self) -> None:
        """Zero the balancing bias and load (an ``empty_init`` model's materialisation); submodules reset their weights."""
        for buffer in self.buffers(recurse=False):
            buffer.zero_()

    def set_recording(self, recording: bool) -> bool:
        """Whether training forwards count towards :meth:`pop_stats` and :meth:`pop_aux_loss`; returns the
        previous setting (see :func:`~lightning_para.moe.moe_stats_paused`)."""
        previous, self._recording = self._recording, recording
        return previous

    def set_dispatcher(self, dispatcher: Optional[ExpertDispatcher]) -> None:
        """Run the experts through ``dispatcher`` (expert parallelism), or locally with ``None``."""
        self.dispatcher = dispatcher

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        num_tokens, k = tokens.shape[0], self.top_k
        logits = self.router(tokens)
        probs = logits.softmax(dim=-1)
        balanced_counts: Optional[list[int]] = None
        if self.balanced_routing:
            # Dry run on meta tensors (no values): a fixed, perfectly balanced assignment whose rows
            # per expert are host integers; the gates stay the router's probabilities of those experts.
            indices, balanced_counts = balanced_assignment(num_tokens, k, self.num_experts, tokens.device)
            top_probs = probs.gather(-1, indices)
        else:
            top_probs, indices = select_experts(probs, getattr(self, "expert_bias", None), k)
        gates = top_probs / top_probs.sum(-1, keepdim=True) if self.normalize_top_k else top_probs

        keep = None
        if self.capacity_factor is not None and balanced_counts is not None:
            if max(balanced_counts) > expert_capacity(num_tokens, self.num_experts, self.capacity_factor, k):
                raise ValueError(
                    f"`capacity_factor={self.capacity_factor}` drops tokens even under balanced routing; the dry run"
                    " runs capacity factors >= 1 (nothing dropped) or dropless routing (None)."
                )
        elif self.capacity_factor is not None:
            capacity = expert_capacity(num_tokens, self.num_experts, self.capacity_factor, k)
            keep = capacity_keep_mask(indices, self.num_experts, capacity)
            gates = gates * keep
        # Assignments (token t, slot j) -> row t*k+j, sorted by expert (stable: token order within).
        assignment = torch.arange(num_tokens * k, device=tokens.device)
        if keep is not None:
            assignment = assignment[keep.reshape(-1)]
        expert_of = indices.reshape(-1)[assignment]
        order = torch.argsort(expert_of, stable=True)
        assignment = assignment[order]
        counts = rows_per_expert(expert_of, self.num_experts)
        routed = tokens[assignment // k]

        expert_out = self._run_experts(routed, counts, balanced_counts)
        slots = expert_out.new_zeros(num_tokens * k, self.dim).index_copy(0, assignment, expert_out)
        out = (slots.view(num_tokens, k, self.dim) * gates.unsqueeze(-1).to(slots.dtype)).sum(1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)

        aux = self._aux_losses(logits, probs, indices, shape)
        return self._attach_aux(out, aux, indices, keep, shape)

    # Eager under torch.compile; the rest of the layer (router, top-k, sort, combine, aux losses) is
    # compiled around it. The rows per expert are host integers that change every step (a traced
    # call would recompile for each new set of counts), and torch's fake-tensor kernel of
    # `_grouped_mm` accepts only bf16, so fp32 grouped experts cannot be traced at all.
    @torch.compiler.disable(reason="MoE experts: data-dependent rows per expert")
    def _run_experts(self, routed: Tensor, counts: Tensor, balanced_counts: Optional[list[int]] = None) -> Tensor:
        if self.dispatcher is not None and self.dispatcher.size > 1:
            if balanced_counts is not None:
                return self.dispatcher(self.experts, routed, counts, balanced_counts=balanced_counts)
            return self.dispatcher(self.experts, routed, counts)
        return self.experts(routed, balanced_counts if balanced_counts is not None else counts.tolist())

    # Eager under torch.compile: the statistics are Python state (counters a trace would guard on and
    # recompile for), and the aux loss's gradient scale is read when backward runs, not when traced.
    @torch.compiler.disable(reason="MoE statistics and aux-loss gradient: Python state")
    def _attach_aux(
        self, out: Tensor, aux: tuple[Tensor, Tensor], indices: Tensor, keep: Optional[Tensor], shape: torch.Size
    ) -> Tensor:
        if self.training and not self.balanced_routing:  # a dry run's fixed routing is no statistic
            self._record(aux, indices, keep)
        total_aux = aux[0] + aux[1]
        if torch.is_grad_enabled() and total_aux.requires_grad:
            out = _AttachAuxLoss.apply(out, total_aux, self)
        return out.view(shape)

    def _aux_losses(self, logits: Tensor, probs: Tensor, indices: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
        zero = logits.new_zeros(())
        groups = 1
        if self.balance_scope == "sequence" and len(shape) >= 3:
            groups = math.prod(shape[:-2])
        balance = zero
        if self.balance_loss_weight:
            balance = self.balance_loss_weight * load_balancing_loss(probs, indices, self.num_experts, groups)
        z = self.z_loss_weight * router_z_loss(logits) if self.z_loss_weight else zero
        return balance, z

    # ------------------------------------------------------------------ statistics
    def _reset_stats(self) -> None:
        # Detached device tensors: recording a step costs no host synchronisation.
        self._stats: dict[str, Tensor] = {}
        self._stat_forwards = 0
        self._aux_value: Optional[Tensor] = None  # for `aux_loss()`, consumed separately
        self._aux_forwards = 0

    @torch.no_grad()
    def _record(self, aux: tuple[Tensor, Tensor], indices: Tensor, keep: Optional[Tensor]) -> None:
        if in_backward() or not self._recording:
            return  # activation-checkpoint recomputation (already counted), or a forward that is not a step
        balance, z = aux[0].detach().float(), aux[1].detach().float()
        new = {
            "balance_loss": balance,
            "z_loss": z,
            "assigned": torch.tensor(float(indices.numel()), device=indices.device),
            "dropped": (~keep).sum().float() if keep is not None else torch.zeros((), device=indices.device),
            "tokens_per_expert": torch.bincount(indices.reshape(-1), minlength=self.num_experts),
        }
        self._stats = {k: v + self._stats[k] if k in self._stats else v for k, v in new.items()}
        if self.bias_update_rate:
            self.expert_load += new["tokens_per_expert"]
        self._stat_forwards += 1
        self._aux_value = balance + z if self._aux_value is None else self._aux_value + balance + z
        self._aux_forwards += 1

    def pop_stats(self) -> Optional[MoEStats]:
        """Statistics of the training forwards since the last call (:class:`MoEStats`; ``None`` if there were none)."""
        if self._stat_forwards == 0:
            return None
        n, s = self._stat_forwards, {k: v.cpu() for k, v in self._stats.items()}
        counts = s["tokens_per_expert"]
        stats = MoEStats(
            balance_loss=float(s["balance_loss"]) / n,
            z_loss=float(s["z_loss"]) / n,
            aux_loss=float(s["balance_loss"] + s["z_loss"]) / n,
            dropped_fraction=float(s["dropped"] / s["assigned"].clamp_min(1)),
            tokens_per_expert=[int(c) for c in counts.tolist()],
            load_imbalance=float(counts.max()) / max(float(counts.float().mean()), 1e-12),
        )
        self._stats, self._stat_forwards = {}, 0
        return stats

    def pop_aux_loss(self) -> Optional[Tensor]:
        """Mean aux loss (weighted balance + z) over the training forwards since the last call."""
        if self._aux_forwards == 0:
            return None
        value = self._aux_value / self._aux_forwards
        self._aux_value, self._aux_forwards = None, 0
        return value

    def extra_repr(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        ep = self.dispatcher.size if self.dispatcher is not None else 1
        return f"num_experts={self.num_experts}, top_k={self.top_k}, {cap}, ep={ep}"


def _validate(num_experts, top_k, activation, capacity_factor, balance_loss_weight, z_loss_weight, balance_scope) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"`num_experts={num_experts!r}` must be a positive integer.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"`top_k={top_k!r}` must be between 1 and num_experts={num_experts}: a token cannot use more experts"
            f" than exist. Choose top_k in 1..{num_experts} (1: Switch, 2: GShard/Mixtral)."
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation={activation!r}` is unknown. Choose one of {ACTIVATIONS}.")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(
            f"`capacity_factor={capacity_factor!r}` must be > 0 (1.0-1.25 is usual); use `capacity_factor=None`"
            " for dropless routing."
        )
    for name, value in (("balance_loss_weight", balance_loss_weight), ("z_loss_weight", z_loss_weight)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"`{name}={value!r}` must be a number >= 0 (0 disables that loss).")
    if balance_scope not in BALANCE_SCOPES:
        raise ValueError(f"`balance_scope={balance_scope!r}` is unknown. Choose one of {BALANCE_SCOPES}.")


__all__ = ["ExpertDispatcher", "MoE", "MoEStats", "TopKRouter", "GroupedExperts", "FeedForward", "ACTIVATIONS", "BALANCE_SCOPES"]
