"""Expert parallelism: shard MoE experts over the ``ep`` mesh dim, move tokens with all-to-all.

Layout (see :mod:`lightning_para.mesh`): ``ep`` is the inner part of ``dp``. Each of the ``ep``
ranks of a group holds ``E / ep`` whole experts and its own batch of tokens. The ``edp = dp / ep``
ranks that hold the *same* experts form the expert-data-parallel group.

One MoE layer, one step (GShard, Lepikhin et al. 2020, Sec. 3.2)::

    forward   all_to_all(counts)       which rank receives how many rows (the split sizes)
              all_to_all(tokens)       dispatch: rows sorted by expert go to the expert's rank
              experts                  grouped FFN on the received rows
              all_to_all(outputs)      combine: rows return to the rank that owns the token
    backward  all_to_all(d outputs)    reverse of combine
              all_to_all(d tokens)     reverse of dispatch

Dropless: split sizes are exchanged first, so any load, including zero rows for a rank, works;
every rank issues the same collectives in the same order whatever the routing.

Gradients (why ``grad_scale = 1/ep``): dense parameters average ``dL_r/dtheta`` over the
``dp`` ranks. An expert's gradient already *sums* the contributions of the tokens of all ``ep``
ranks of its group (the backward all-to-all brings them home), and data parallelism then
averages it over ``edp`` only, so each expert's weight gradient is scaled by ``1/ep`` in
backward: ``(1/edp) * sum_edp (1/ep) * sum_ep dL_r/dW = (1/dp) * sum_dp dL_r/dW``.

Expert weights become DTensors ``Shard(0)`` over the ``ep`` mesh and are marked
``param._para_expert = True``; ZeRO-0/1/2 then reduce them over ``edp`` (``expert_or_dense_mesh``),
FSDP2 (ZeRO-3) shards them in their own units over ``edp``, checkpoints store the full
``[E, ...]`` stack, and the global grad norm counts each expert once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from lightning_para.mesh import ParallelDims
    from lightning_para.moe import GroupedExperts


@dataclass
class ExpertParallelContext:
    """What one MoE layer needs to reach its peers: the 1-D ``ep`` mesh."""

    mesh: DeviceMesh

    def __post_init__(self) -> None:
        self.group = self.mesh.get_group()
        self.size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()

    def __deepcopy__(self, memo: dict) -> "ExpertParallelContext":
        return self  # process groups are not copyable; a copy of a layer talks to the same peers


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Tensor:
    """Differentiable uneven all-to-all of rows of ``x`` over ``group``."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: Tensor, ctx: ExpertParallelContext) -> Tensor:
    """``counts[E]`` rows this rank sends per expert -> ``[ep, E/ep]`` rows each source sends to my experts."""
    send = counts.view(ctx.size, -1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ctx.group)
    return recv


def run_experts_parallel(experts: "GroupedExperts", routed: Tensor, counts: Tensor, ctx: ExpertParallelContext) -> Tensor:
    """Send ``routed`` (rows sorted by global expert id, ``counts[e]`` each) to the experts' ranks,
    run the local experts, and bring each row's output back in the same order."""
    recv_counts = exchange_counts(counts, ctx)  # [source rank, local expert]
    input_splits = counts.view(ctx.size, -1).sum(1).tolist()
    output_splits = recv_counts.sum(1).tolist()
    received = all_to_all(routed, output_splits, input_splits, ctx.group)
    # Received rows are grouped (source, local expert); the experts want (local expert, source).
    num_local = recv_counts.shape[1]
    expert_of_row = torch.repeat_interleave(
        torch.arange(num_local, device=counts.device).repeat(ctx.size), recv_counts.reshape(-1)
    )
    by_expert = torch.argsort(expert_of_row, stable=True)
    local_out = experts(received[by_expert], recv_counts.sum(0).tolist())
    back = local_out.new_empty(local_out.shape).index_copy(0, by_expert, local_out)
    return all_to_all(back, input_splits, output_splits, ctx.group)


# ----------------------------------------------------------------------------- apply
def apply_expert_parallel(module: nn.Module, dims: "ParallelDims") -> list[nn.Module]:
    """Shard every :class:`~lightning_para.moe.MoE` of ``module`` over ``dims``' ``ep`` mesh dim.

    Keeps experts ``[r*E/ep, (r+1)*E/ep)`` on ep rank ``r``, sliced locally from the full,
    already initialised stack (no communication, so a single-device run with the same seed has
    the same experts), gives each layer the ``ep`` process group, and marks expert parameters
    ``_para_expert``. With ``ep == 1`` the experts stay plain tensors and are only marked.
    Returns the MoE layers. Raises ``ValueError`` (on every rank alike) for a bad layout.
    """
    from lightning_para.moe import MoE

    layers = [m for m in module.modules() if isinstance(m, MoE)]
    check_expert_layout(module, dims)
    if not layers:
        return []
    ep_mesh = dims.get_mesh("ep") if dims.ep > 1 else None
    for layer in layers:
        if ep_mesh is not None:
            shard_experts(layer.experts, ep_mesh)
            layer.expert_parallel = ExpertParallelContext(ep_mesh)
        for p in layer.experts.parameters():
            p._para_expert = True  # type: ignore[attr-defined]
    return layers


def check_expert_layout(module: nn.Module, dims: "ParallelDims") -> None:
    """Raise ``ValueError`` (identically on every rank, no communication) if ``module`` cannot be
    expert-parallel over ``dims.ep``. ``parallelize`` calls it on the whole model, before any split."""
    from lightning_para.moe import MoE

    layers = [m for m in module.modules() if isinstance(m, MoE)]
    if dims.ep > 1 and not layers and isinstance(module, LightningModule):
        raise ValueError(
            f"`ep={dims.ep}` shards Mixture-of-Experts layers, but the model has no `lightning_para.moe.MoE`"
            " module. Build its MoE blocks from `lightning_para.moe.MoE`, or set ep=1."
        )
    for layer in layers:
        if layer.num_experts % dims.ep:
            choices = [d for d in range(1, dims.dp + 1) if dims.dp % d == 0 and layer.num_experts % d == 0]
            raise ValueError(
                f"`ep={dims.ep}` must divide num_experts={layer.num_experts} of every MoE layer (each rank holds"
                f" num_experts/ep whole experts). Choose ep in {choices}, or a number of experts divisible by {dims.ep}."
            )


@torch.no_grad()
def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace each stacked ``[E, ...]`` weight by a DTensor holding this rank's ``E/ep`` experts."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"Expert weight `{name}` is already a DTensor; apply expert parallelism once.")
        # src_data_rank=None: every rank already holds the same full stack; slice without communication.
        local = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        new = nn.Parameter(local, requires_grad=param.requires_grad)
        experts.register_parameter(name, new)
    experts.grad_scale = 1.0 / ep_mesh.size()


__all__ = ["ExpertParallelContext", "all_to_all", "apply_expert_parallel", "check_expert_layout", "exchange_counts", "run_experts_parallel", "shard_experts"]
