"""The GPT decoder of :mod:`lightning_para.recipes.gpt` with Mixture-of-Experts feed-forward layers.

Every ``moe_every``-th block (1: all, 2: every other, starting with the second, as in
GShard/Switch) replaces its MLP with :class:`lightning_para.moe.MoE`: ``num_experts``
experts, ``top_k`` per token, optional ``capacity_factor`` (``None``: dropless) and an
optional shared expert. Under ``ParaStrategy(ep=e)`` the experts are split over ``e`` ranks
and tokens travel by all-to-all; everything else (TP plan, pipeline contract, generation)
is inherited (each :class:`~lightning_para.recipes.gpt.Block` declares ``gather_sequence`` for an MoE
feed-forward: it runs whole on every tp rank and expert parallelism splits its experts).

The routers' auxiliary losses train through the MoE layers' own backward hook
(:func:`lightning_para.moe.aux_loss`); ``train_loss`` stays the language-model loss, so it
compares with the dense model, and ``train_aux_loss`` shows the rest. The routing statistics
(balance loss, load imbalance, dropped fraction per layer) reach TensorBoard through
:class:`lightning_para.profiling.ParaProfiler` (``moe/...``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn

from lightning_para.moe import MoE, aux_loss, moe_layers
from lightning_para.recipes.gpt import GPT


@dataclass
class MoEOptions:
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: Optional[float] = None
    moe_every: int = 1
    first_k_dense: int = 0  # the first blocks keep the dense MLP (DeepSeek-V3: 3)
    expert_hidden: Optional[int] = None  # default: the dense MLP width
    shared_expert_hidden: Optional[int] = None
    balance_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) or self.moe_every < 1:
            raise ValueError(f"`moe_every={self.moe_every!r}` must be a positive integer (1: every block, 2: every other).")
        if isinstance(self.first_k_dense, bool) or not isinstance(self.first_k_dense, int) or self.first_k_dense < 0:
            raise ValueError(f"`first_k_dense={self.first_k_dense!r}` must be an integer >= 0 (dense blocks before the first MoE one).")


class MoEGPT(GPT):
    """:class:`lightning_para.recipes.gpt.GPT` with MoE feed-forward layers.

    Args:
        num_experts, top_k, capacity_factor: routing (see :class:`lightning_para.moe.MoE`).
        moe_every: put an MoE layer in every n-th block (the others keep the dense MLP).
        first_k_dense: the first blocks keep the dense MLP; ``moe_every`` counts from the next one
            (DeepSeek-V3: 3; the planner's ``ModelDesc.first_k_dense``).
        expert_hidden: hidden width of each expert (default: the dense MLP's).
        shared_expert_hidden: width of an always-on shared expert (``None``: none).
        balance_loss_weight, z_loss_weight: auxiliary loss weights (Switch 0.01; ST-MoE 0.001).
        bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3: 0.001; 0: off), beside or instead of them.
        **kwargs: everything :class:`~lightning_para.recipes.gpt.GPT` takes (``preset``, ``n_layer``, ``lr``, ...).
    """

    def __init__(
        self,
        num_experts: int = 4,
        top_k: int = 2,
        capacity_factor: Optional[float] = None,
        moe_every: int = 1,
        expert_hidden: Optional[int] = None,
        shared_expert_hidden: Optional[int] = None,
        balance_loss_weight: float = 0.01,
        z_loss_weight: float = 0.001,
        first_k_dense: int = 0,
        bias_update_rate: float = 0.0,
        **kwargs: Any,
    ) -> None:
        # Read by `make_mlp`, which GPT.__init__ calls while building the blocks.
        self.moe_options = MoEOptions(
            num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor, moe_every=moe_every,
            first_k_dense=first_k_dense, expert_hidden=expert_hidden, shared_expert_hidden=shared_expert_hidden,
            balance_loss_weight=balance_loss_weight, z_loss_weight=z_loss_weight, bias_update_rate=bias_update_rate,
        )
        super().__init__(**kwargs)

    def is_moe_block(self, layer_index: int) -> bool:
        every, dense = self.moe_options.moe_every, self.moe_options.first_k_dense
        return layer_index >= dense and (layer_index - dense) % every == every - 1

    def make_mlp(self, layer_index: int) -> Optional[nn.Module]:
        if not self.is_moe_block(layer_index):
            return None
        o, config = self.moe_options, self.config
        return MoE(
            config.n_embd, o.expert_hidden or config.mlp_hidden, o.num_experts, o.top_k,
            activation=config.mlp, shared_hidden_dim=o.shared_expert_hidden, capacity_factor=o.capacity_factor,
            balance_loss_weight=o.balance_loss_weight, z_loss_weight=o.z_loss_weight, bias_update_rate=o.bias_update_rate,
        )

    def num_params(self, matmul_only: bool = False, active: bool = False) -> int:
        """As :meth:`GPT.num_params`; with ``active`` the experts count ``top_k / num_experts`` of
        their weights, so ``flops_per_token`` is 6 N_active + 12 L d T."""
        total = super().num_params(matmul_only)
        if active:
            o = self.moe_options
            for _, layer in moe_layers(self):
                expert_params = sum(p.numel() for p in layer.experts.parameters())
                total -= expert_params - expert_params * o.top_k // o.num_experts
        return total

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        # The aux gradients are already attached inside each MoE layer; this is the value, for the logs
        # (the mean over dp, as `train_loss`; the pipeline runner logs the same name under pp > 1).
        self.log("train_aux_loss", aux_loss(self), sync_dist=True)
        return loss
