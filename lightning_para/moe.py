"""A Mixture-of-Experts feed-forward layer for any transformer block: :class:`MoE`.

``MoE(dim, hidden_dim, num_experts, top_k)`` replaces a block's MLP. Per token it picks
``top_k`` experts with a softmax router (k=1: Switch Transformer; k=2: GShard / Mixtral),
runs them as one batched FFN whose weights are stacked ``[num_experts, ...]`` tensors, and
returns the gate-weighted sum of their outputs (plus an optional always-on shared expert).

Under ``ParaStrategy(ep=e)`` the stacked expert weights are split along dim 0 over the ``ep``
mesh dimension and tokens travel to their experts' ranks with all-to-all (see
:mod:`lightning_para.parallel.expert_parallel`). The same module runs unchanged on one device.

Capacity: dropless by default (every routed token is computed, however uneven the load).
With ``capacity_factor=c`` each expert takes at most ``ceil(tokens / experts * c * k)``
assignments of this forward's tokens (first choices before second choices, then token
order; GShard's priority); the rest are dropped, contribute zero here and pass through the
block's residual connection.

Auxiliary losses (their gradients are applied automatically; see :func:`aux_loss`):

* load balancing ``alpha * E * sum_i f_i * P_i`` (Switch Transformer, Fedus et al. 2021,
  eq. 4-6), ``f_i`` = fraction of the k*T assignments routed to expert i, ``P_i`` = mean
  router probability of expert i. Uniform routing gives exactly ``alpha``.
* router z-loss ``beta * mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al. 2022, eq. 5).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_para.parallel.expert_parallel import ExpertParallelContext, run_experts_parallel

ACTIVATIONS = ("swiglu", "gelu")
BALANCE_SCOPES = ("sequence", "batch")


# ----------------------------------------------------------------------------- routing math
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


def router_z_loss(logits: Tensor) -> Tensor:
    """``mean_t logsumexp(logits_t)^2``: keeps router logits small (ST-MoE eq. 5, unweighted)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


# ----------------------------------------------------------------------------- modules
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
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            return F.linear(tokens.float(), self.weight.float())


class GroupedExperts(nn.Module):
    """``num_experts`` FFNs with stacked weights: ``w1, w3: [E, dim, hidden]``, ``w2: [E, hidden, dim]``.

    Expert parallelism replaces each weight by a DTensor sharded ``Shard(0)`` over the ``ep``
    mesh, so a rank holds ``E / ep`` whole experts and checkpoints see the full stack.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.dim, self.hidden_dim, self.num_experts, self.activation = dim, hidden_dim, num_experts, activation
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
        from torch.distributed.tensor import DTensor

        out: list[Optional[Tensor]] = []
        for w in (self.w1, self.w2, self.w3):
            if w is not None and isinstance(w, DTensor):
                w = w.to_local()
            if w is not None and self.grad_scale != 1.0:
                w = _ScaleGrad.apply(w, self.grad_scale)
            out.append(w)
        return out

    def forward(self, tokens: Tensor, counts: list[int]) -> Tensor:
        """``tokens`` grouped by local expert, ``counts[e]`` rows each; returns the same layout."""
        w1, w2, w3 = self.local_weights()
        outputs = []
        # Every local expert runs, even on zero rows: each weight always gets a gradient.
        for e, chunk in enumerate(tokens.split(counts)):
            h = chunk @ w1[e]
            h = F.silu(h) * (chunk @ w3[e]) if w3 is not None else F.gelu(h)
            outputs.append(h @ w2[e])
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, self.dim)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


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
    ) -> None:
        super().__init__()
        _validate(num_experts, top_k, activation, capacity_factor, balance_loss_weight, z_loss_weight, balance_scope)
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
        self.expert_parallel: Optional[ExpertParallelContext] = None  # set by apply_expert_parallel
        self._recording = True  # see `moe_stats_paused`
        self._reset_stats()

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        num_tokens, k = tokens.shape[0], self.top_k
        logits = self.router(tokens)
        probs = logits.softmax(dim=-1)
        top_probs, indices = probs.topk(k, dim=-1)
        gates = top_probs / top_probs.sum(-1, keepdim=True) if self.normalize_top_k else top_probs

        keep = None
        if self.capacity_factor is not None:
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
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        routed = tokens[assignment // k]

        if self.expert_parallel is not None and self.expert_parallel.size > 1:
            expert_out = run_experts_parallel(self.experts, routed, counts, self.expert_parallel)
        else:
            expert_out = self.experts(routed, counts.tolist())

        slots = expert_out.new_zeros(num_tokens * k, self.dim).index_copy(0, assignment, expert_out)
        out = (slots.view(num_tokens, k, self.dim) * gates.unsqueeze(-1).to(slots.dtype)).sum(1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)

        aux = self._aux_losses(logits, probs, indices, shape)
        if self.training:
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
        if _in_backward() or not self._recording:
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
        self._stat_forwards += 1
        self._aux_value = balance + z if self._aux_value is None else self._aux_value + balance + z
        self._aux_forwards += 1

    def pop_stats(self) -> Optional[dict[str, Any]]:
        """Statistics of the training forwards since the last call (``None`` if there were none).

        ``balance_loss`` and ``z_loss`` (weighted, mean over forwards), ``aux_loss`` (their sum),
        ``dropped_fraction`` (of the k*T assignments), ``tokens_per_expert`` (assignments this
        rank routed to each expert, summed over forwards) and ``load_imbalance`` (max / mean of
        those counts; 1 is perfectly even).
        """
        if self._stat_forwards == 0:
            return None
        n, s = self._stat_forwards, {k: v.cpu() for k, v in self._stats.items()}
        counts = s["tokens_per_expert"]
        stats = {
            "balance_loss": float(s["balance_loss"]) / n,
            "z_loss": float(s["z_loss"]) / n,
            "aux_loss": float(s["balance_loss"] + s["z_loss"]) / n,
            "dropped_fraction": float(s["dropped"] / s["assigned"].clamp_min(1)),
            "tokens_per_expert": counts,
            "load_imbalance": float(counts.max()) / max(float(counts.float().mean()), 1e-12),
        }
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
        ep = self.expert_parallel.size if self.expert_parallel is not None else 1
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


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


# ----------------------------------------------------------------------------- helpers for LightningModules
def moe_layers(module: nn.Module) -> Iterator[tuple[str, MoE]]:
    """``(name, layer)`` for every :class:`MoE` inside ``module``."""
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            yield name, m


def aux_loss(module: nn.Module) -> Tensor:
    """The auxiliary losses of ``module``'s MoE layers in this step's forwards, as a value.

    Its gradient is **already applied**: every :class:`MoE` attaches ``d aux`` to its output's
    backward, so calling ``loss.backward()`` on the task loss trains the routers too (also
    inside pipeline stages, where no single loss sees every layer). Add this value to the loss
    you return so that logs and checkpoint monitors show the whole objective::

        loss = F.cross_entropy(logits, targets) + aux_loss(self)

    It is detached: adding it cannot count the gradient twice. Sums over layers; each layer
    contributes the mean over the forwards since the previous call (microbatches).
    """
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    total = torch.zeros((), device=device)
    for _, layer in moe_layers(module):
        value = layer.pop_aux_loss()
        if value is not None:
            total = total + value.to(device)
    return total


@contextlib.contextmanager
def moe_stats_paused(module: nn.Module) -> Iterator[None]:
    """Forwards inside do not count towards :func:`aux_loss` and the metrics (e.g. a pipeline's shape inference)."""
    layers = [layer for _, layer in moe_layers(module)]
    previous = [layer._recording for layer in layers]
    for layer in layers:
        layer._recording = False
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer._recording = value


def set_aux_loss_grad_scale(module: nn.Module, scale: float) -> None:
    """Set ``d(loss that backward starts from) / d(task loss)`` for the attached aux gradients.

    ``ParaStrategy`` does this before each backward (loss scale of ``16-mixed`` divided by
    ``accumulate_grad_batches``). Call it yourself in a custom loop that scales its loss.
    """
    for _, layer in moe_layers(module):
        layer.aux_loss_grad_scale = float(scale)


class MoEAuxLossScale(Callback):
    """For strategies other than ``ParaStrategy`` (which does this itself): before each backward, set the
    MoE aux-gradient scale the way Lightning scales the loss (``/ accumulate_grad_batches``, times the
    ``16-mixed`` GradScaler's scale), so accumulation and fp16 train the routers correctly."""

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        scale = 1.0 / trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1.0
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale *= float(scaler.get_scale())
        set_aux_loss_grad_scale(pl_module, scale)


class MoEMetrics(Callback):
    """Logs each MoE layer's routing statistics through ``LightningModule.log`` after every training batch.

    Keys: ``moe/<layer>/balance_loss``, ``z_loss``, ``dropped_fraction``, ``load_imbalance`` and,
    with ``per_expert=True``, ``tokens_expert_<i>`` (assignments this rank routed to expert i).
    Values are this rank's; ``sync_dist=True`` averages them over all ranks (one all-reduce each).
    """

    def __init__(self, per_expert: bool = False, sync_dist: bool = False, prefix: str = "moe") -> None:
        self.per_expert, self.sync_dist, self.prefix = per_expert, sync_dist, prefix

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for name, layer in moe_layers(pl_module):
            stats = layer.pop_stats()
            if stats is None:
                continue
            key = f"{self.prefix}/{name}"
            values = {f"{key}/{s}": float(stats[s]) for s in ("balance_loss", "z_loss", "dropped_fraction", "load_imbalance")}
            if self.per_expert:
                values.update({f"{key}/tokens_expert_{i}": float(c) for i, c in enumerate(stats["tokens_per_expert"])})
            pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=self.sync_dist, batch_size=1)


__all__ = [
    "MoE",
    "MoEMetrics",
    "MoEAuxLossScale",
    "TopKRouter",
    "GroupedExperts",
    "FeedForward",
    "aux_loss",
    "moe_layers",
    "moe_stats_paused",
    "set_aux_loss_grad_scale",
    "expert_capacity",
    "capacity_keep_mask",
    "load_balancing_loss",
    "router_z_loss",
]
