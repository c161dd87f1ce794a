"""Expert parallelism: shard MoE experts over the ``ep`` mesh dim (the entry point).

Layout (see :mod:`lightning_para.mesh`): ``ep`` is the inner part of ``dp``. Each of the ``ep``
ranks of a group holds ``E / ep`` whole experts and its own batch of tokens. The ``edp = dp / ep``
ranks that hold the *same* experts form the expert-data-parallel group.

:func:`apply_expert_parallel` slices each :class:`~lightning_para.moe.MoE` layer's stacked
``[E, ...]`` expert weights into DTensors ``Shard(0)`` over ``ep`` and hands the layer an
:class:`~.dispatch.AllToAllDispatcher`. It returns an :class:`ExpertParallelInfo` naming the
expert modules, from which the other dimensions learn which parameters are experts: ZeRO-0/1/2
reduce them over ``edp`` only, FSDP2 (ZeRO-3) shards them in units of their own over ``edp``,
checkpoints store the full ``[E, ...]`` stack, and the global grad norm counts each expert once.

Experts of other libraries are sharded the same way, with the same dispatcher, through the
:class:`~.adapters.ExpertAdapter` their integration registers (:mod:`.adapters`): transformers
Mixture-of-Experts blocks (Mixtral, Qwen-MoE, OLMoE, ...: a router and an ``experts`` module with
expert-major ``gate_up_proj``/``down_proj``) by :mod:`lightning_para.integrations.transformers`;
no conversion is needed. There, data parallelism also makes the model's router auxiliary loss
the one-device value (an all-reduce of the routing statistics over ``dp``).

Gradients (why ``grad_scale = 1/ep``): dense parameters average ``dL_r/dtheta`` over the
``dp`` ranks. An expert's gradient already *sums* the contributions of the tokens of all ``ep``
ranks of its group (the backward all-to-all brings them home), and data parallelism then
averages it over ``edp`` only, so each expert's weight gradient is scaled by ``1/ep`` in
backward: ``(1/edp) * sum_edp (1/ep) * sum_ep dL_r/dW = (1/dp) * sum_dp dL_r/dW``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_para.spec.dims import divisors
from lightning_para.moe import MoE, moe_layers
from lightning_para.parallel.expert.adapters import ExpertAdapter, expert_adapters
from lightning_para.parallel.expert.dispatch import AllToAllDispatcher


@dataclass
class ExpertParallelInfo:
    """What :func:`apply_expert_parallel` found and did in one module (the model or a pipeline stage)."""

    ep: int
    layers: list[MoE] = field(default_factory=list)
    expert_modules: list[nn.Module] = field(default_factory=list)  # their parameters are experts

    def expert_parameters(self) -> Iterable[Tensor]:
        """The expert parameters as they are now (FSDP2 replaces parameter objects, not modules)."""
        for module in self.expert_modules:
            yield from module.parameters()


def apply_expert_parallel(
    module: nn.Module, ep_mesh: Optional[DeviceMesh], dp_mesh: Optional[DeviceMesh] = None
) -> ExpertParallelInfo:
    """Shard every MoE layer of ``module`` over the 1-D ``ep_mesh`` (``None``: ep=1, nothing is sharded).

    Keeps experts ``[r*E/ep, (r+1)*E/ep)`` on ep rank ``r``, sliced locally from the full,
    already initialised stack (no communication, so a single-device run with the same seed has
    the same experts), and gives each layer an all-to-all dispatcher over ``ep``. Call
    :func:`check_expert_layout` on the whole model first: it raises on every rank alike.
    ``dp_mesh`` (the flattened data-parallel mesh): models whose adapter has a global auxiliary
    loss (transformers MoE models: the router loss) compute it over the whole data-parallel batch.
    """
    layers = [layer for _, layer in moe_layers(module)]
    found = _adapted_experts(module)
    if ep_mesh is not None and ep_mesh.size() > 1:
        for layer in layers:
            shard_experts(layer.experts, ep_mesh)
            layer.set_dispatcher(AllToAllDispatcher(ep_mesh))
        for adapter, _, experts in found:
            adapter.shard(experts, AllToAllDispatcher(ep_mesh), partial(shard_experts, ep_mesh=ep_mesh))
    if dp_mesh is not None and dp_mesh.size() > 1:
        for adapter in dict.fromkeys(adapter for adapter, _, _ in found):
            if adapter.attach_global_loss is not None:
                adapter.attach_global_loss(module, dp_mesh.get_group(), dp_mesh.size())
    ep = ep_mesh.size() if ep_mesh is not None else 1
    adapted = [experts for _, _, experts in found]
    return ExpertParallelInfo(ep=ep, layers=layers, expert_modules=[layer.experts for layer in layers] + adapted)


def _adapted_experts(module: nn.Module) -> list[tuple[ExpertAdapter, str, nn.Module]]:
    """``(adapter, name, experts module)`` for the experts of every registered adapter in ``module``."""
    return [(adapter, name, experts) for adapter in expert_adapters() for name, experts in adapter.find(module)]


def _interfaces(prefix: str = " or ") -> str:
    """The registered adapters' interfaces for an error message, each after ``prefix``."""
    return "".join(f"{prefix}{adapter.interface}" for adapter in expert_adapters())


def check_expert_layout(module: nn.Module, ep: int, dp: int) -> None:
    """Raise ``ValueError`` (identically on every rank, no communication) if ``module`` cannot be
    expert-parallel over ``ep`` ranks inside ``dp``. Call it on the whole model, before any split."""
    layers = [layer for _, layer in moe_layers(module)]
    found = _adapted_experts(module)
    if ep > 1:
        # Experts another adapter found are known to every adapter (one family's check must not refuse another's).
        found_ids = {id(experts) for _, _, experts in found}
        unsupported = [
            line for adapter in expert_adapters()
            for line in adapter.unsupported(module, lambda m: isinstance(m, MoE) or id(m) in found_ids)
        ]
        listed = "\n  " + "\n  ".join(unsupported) if unsupported else ""
        if not layers and not found:
            raise ValueError(
                f"`ep={ep}` shards Mixture-of-Experts layers, but the model has no `lightning_para.moe.MoE` module"
                f"{_interfaces(' and no module with ')}. Build its MoE blocks from `lightning_para.moe.MoE`,"
                f"{_interfaces(' use a model with ')}, or set ep=1."
                + (f" Blocks that look like MoE but cannot be sharded:{listed}" if unsupported else "")
            )
        if unsupported:  # sharding some experts and not others would train the rest on 1/ep of the tokens
            raise ValueError(
                f"`ep={ep}` cannot shard these Mixture-of-Experts blocks:{listed}\nExpert parallelism supports"
                f" `lightning_para.moe.MoE`{_interfaces()}. Use one of those, or set ep=1."
            )
    counts = [("num_experts", name, layer.num_experts) for name, layer in moe_layers(module)]
    counts += [(adapter.count_field(experts), name, experts.num_experts) for adapter, name, experts in found]
    for count_name, name, num_experts in counts:
        if num_experts % ep:
            choices = [d for d in divisors(dp) if num_experts % d == 0]
            raise ValueError(
                f"`ep={ep}` must divide {count_name}={num_experts} of every MoE layer (`{name}`: each rank holds"
                f" {count_name}/ep whole experts). Choose ep in {choices}, or a number of experts divisible by {ep}."
            )


@torch.no_grad()
def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace each stacked ``[E, ...]`` weight by a DTensor holding this rank's ``E/ep`` experts."""
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"Expert weight `{name}` is already a DTensor; apply expert parallelism once.")
        # src_data_rank=None: every rank already holds the same full stack; slice without communication.
        local = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
    experts.grad_scale = 1.0 / ep_mesh.size()


__all__ = ["ExpertParallelInfo", "apply_expert_parallel", "check_expert_layout", "shard_experts"]
