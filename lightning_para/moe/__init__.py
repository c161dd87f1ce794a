"""A Mixture-of-Experts feed-forward layer for any transformer block: :class:`MoE`.

``MoE(dim, hidden_dim, num_experts, top_k)`` replaces a block's MLP. Per token it picks
``top_k`` experts with a softmax router (k=1: Switch Transformer; k=2: GShard / Mixtral),
runs them as one batched FFN whose weights are stacked ``[num_experts, ...]`` tensors, and
returns the gate-weighted sum of their outputs (plus an optional always-on shared expert).

Under ``ParaStrategy(ep=e)`` the stacked expert weights are split along dim 0 over the ``ep``
mesh dimension and tokens travel to their experts' ranks with all-to-all (see
:mod:`lightning_para.parallel.expert`). The same module runs unchanged on one device.

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

Auxiliary-loss-free balancing (DeepSeek-V3), beside them or instead: ``bias_update_rate`` (see
:func:`update_expert_bias`).
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".helpers": ("MoEAuxLossScale", "MoEBiasUpdate", "MoEMetrics", "aux_loss", "balanced_routing", "biased_routers",
        "keep_expert_biases_fp32",
        "moe_layers", "aux_loss_grad_scale", "moe_stats_paused", "set_aux_loss_grad_scale", "update_expert_bias"),
    ".layer": ("MoE", "FeedForward", "GroupedExperts", "MoEStats", "TopKRouter"),
    ".routing": ("balanced_assignment", "capacity_keep_mask", "expert_capacity", "load_balancing_loss",
        "router_z_loss"),
})
