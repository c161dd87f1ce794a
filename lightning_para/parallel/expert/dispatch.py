"""Expert parallelism's token dispatch: move routed tokens to their experts' ranks with all-to-all.

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

The MoE layer (:mod:`lightning_para.moe`) knows nothing of this module: :func:`~.apply.apply_expert_parallel`
hands each layer an :class:`AllToAllDispatcher`, which the layer calls instead of running all
experts locally.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh


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


class AllToAllDispatcher:
    """Runs a layer's routed tokens on the experts of all ``ep`` ranks (the MoE layer's dispatcher).

    Args:
        ep_mesh: the 1-D ``ep`` mesh; rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``.
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()

    def __deepcopy__(self, memo: dict) -> "AllToAllDispatcher":
        return self  # process groups are not copyable; a copy of a layer talks to the same peers

    def exchange_counts(self, counts: Tensor) -> Tensor:
        """``counts[E]`` rows this rank sends per expert -> ``[ep, E/ep]`` rows each source sends to my experts."""
        send = counts.view(self.size, -1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    # Eager under torch.compile (compile=True compiles the rest of the block around it): the split
    # sizes are host integers read from this step's routing, so a traced exchange would graph-break at
    # each `.tolist()` and recompile for every new set of counts.
    @torch.compiler.disable(reason="expert dispatch: data-dependent all-to-all split sizes")
    def __call__(
        self, experts: Callable[[Tensor, list[int]], Tensor], routed: Tensor, counts: Tensor,
        balanced_counts: Optional[list[int]] = None,
    ) -> Tensor:
        """Send ``routed`` (rows sorted by global expert id, ``counts[e]`` each) to the experts' ranks,
        run the local ``experts(rows, rows_per_local_expert)``, and bring each row's output back in
        the same order. Runs eagerly under ``torch.compile``.

        ``balanced_counts``: the dry run's balanced routing (:func:`lightning_para.moe.balanced_routing`):
        ``counts`` as host integers, the same on every rank of the group. The split sizes are then
        derived from them instead of read from tensors (meta tensors have no values); the same
        collectives run, the count exchange included."""
        recv_counts = self.exchange_counts(counts)  # [source rank, local expert]
        num_local = recv_counts.shape[1]
        if balanced_counts is None:
            input_splits = counts.view(self.size, -1).sum(1).tolist()
            output_splits = recv_counts.sum(1).tolist()
            recv_rows, local_counts, rows = recv_counts.reshape(-1), recv_counts.sum(0).tolist(), None
        else:
            mine = balanced_counts[self.rank * num_local:(self.rank + 1) * num_local]  # what each source sends me
            input_splits = [sum(balanced_counts[r * num_local:(r + 1) * num_local]) for r in range(self.size)]
            output_splits = [sum(mine)] * self.size
            recv_rows = torch.tensor(mine * self.size, device=counts.device)
            local_counts, rows = [c * self.size for c in mine], sum(output_splits)
        received = all_to_all(routed, output_splits, input_splits, self.group)
        # Received rows are grouped (source, local expert); the experts want (local expert, source).
        expert_of_row = torch.repeat_interleave(
            torch.arange(num_local, device=counts.device).repeat(self.size), recv_rows, output_size=rows
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        local_out = experts(received[by_expert], local_counts)
        back = local_out.new_empty(local_out.shape).index_copy(0, by_expert, local_out)
        return all_to_all(back, input_splits, output_splits, self.group)


__all__ = ["AllToAllDispatcher", "all_to_all"]
