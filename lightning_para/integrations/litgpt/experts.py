"""Expert parallelism for LitGPT's ``LLaMAMoE``: its experts on the ep dimension, tokens by all-to-all.

``LLaMAMoE`` routes each token to ``n_expert_per_token`` of ``n_expert`` experts (``gate``: a Linear,
top-k of its logits, softmax over the chosen ones) and runs ``experts``, an ``nn.ModuleList`` of
``LLaMAMLP`` (``proj(silu(fc_1(x)) * fc_2(x))``), on the tokens routed to each. Under
``ParaStrategy(ep=e)`` the adapter registered here:

* stacks the experts' weights into expert-major parameters **on the ``experts`` module itself**
  (``experts.fc_1 [E, I, H]``, ``experts.fc_2 [E, I, H]``, ``experts.proj [E, H, I]``, and biases
  with ``config.bias``), so generic expert parallelism shards them ``Shard(0)`` over ep (each rank
  keeps ``E/ep`` whole experts, checkpoints keep the whole stack) and counts exactly those as
  expert parameters (the router stays a dense parameter). :func:`~.checkpoint.export` unstacks them
  back to LitGPT's names (``experts.{i}.fc_1.weight``);
* replaces the block's forward with the same routing followed by the dispatcher's all-to-all
  (:class:`~lightning_para.parallel.expert.dispatch.AllToAllDispatcher`, the one
  ``lightning_para.moe.MoE`` uses), this rank's experts, the way back and the weighted sum.
  Expert gradients are scaled by ``1/ep`` (see :mod:`lightning_para.parallel.expert.apply`).

Not supported (refused): grouped routers (``n_expert_groups``, DeepSeek-V3's ``GroupedTopkRouter``).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_para._dtensor import scale_grad
from lightning_para.integrations.litgpt.tensor import is_litgpt_module
from lightning_para.moe.routing import add_expert_bias, record_load, rows_per_expert, select_experts
from lightning_para.parallel.expert.adapters import ExpertAdapter, register_expert_adapter

INTERFACE = "LitGPT's LLaMAMoE (a Linear `gate` and an nn.ModuleList of LLaMAMLP `experts`)"
STACKED = ("fc_1", "fc_2", "proj")
# experts ModuleList -> its LLaMAMoE block (weak: keeps no model alive).
_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def is_llama_moe(module: nn.Module) -> bool:
    return is_litgpt_module(module, "LLaMAMoE") and not getattr(module.config, "n_expert_groups", None)


def litgpt_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, experts)`` for the ``experts`` of every ``LLaMAMoE`` in ``module`` (``experts.num_experts`` set)."""
    found = []
    for name, block in module.named_modules():
        if is_llama_moe(block):
            block.experts.num_experts = int(block.config.n_expert)
            _BLOCKS[block.experts] = block
            found.append((f"{name}.experts" if name else "experts", block.experts))
    return found


def unsupported_blocks(module: nn.Module, known: Callable[[nn.Module], bool]) -> list[str]:
    return [
        f"`{name}` (LLaMAMoE): a grouped router (config.n_expert_groups={block.config.n_expert_groups})"
        for name, block in module.named_modules()
        if is_litgpt_module(block, "LLaMAMoE") and getattr(block.config, "n_expert_groups", None)
    ]


class StackedExperts(nn.ModuleList):
    """``LLaMAMoE.experts`` after :func:`stack_experts`: expert-major parameters, called on routed rows.

    The block's forward calls it (``experts(rows, counts)``), so ZeRO-3 (FSDP2, which shards experts in
    units of their own) gathers its parameters around that call like any module's."""

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:  # type: ignore[override]
        return run_local_experts(self, float(getattr(self, "grad_scale", 1.0)), rows, counts)


@torch.no_grad()
def stack_experts(experts: nn.ModuleList) -> None:
    """Move the per-expert ``LLaMAMLP`` weights into expert-major parameters of ``experts`` (no children left);
    the same object becomes a :class:`StackedExperts` (expert parallelism keeps a reference to it)."""
    mlps = list(experts)
    for part in STACKED:
        for kind in ("weight", "bias"):
            tensors = [getattr(getattr(mlp, part), kind) for mlp in mlps]
            if tensors[0] is not None:
                name = part if kind == "weight" else f"{part}_bias"
                experts.register_parameter(name, nn.Parameter(torch.stack([t.detach() for t in tensors])))
    for index in range(len(mlps)):
        del experts._modules[str(index)]  # private: the ModuleList's own registry of children
    experts.__class__ = StackedExperts  # same object, same names; now callable on routed rows


def _local(experts: nn.Module, name: str, grad_scale: float) -> Any:
    w = getattr(experts, name, None)
    if w is None:
        return None
    w = w.to_local() if isinstance(w, DTensor) else w
    return scale_grad(w, grad_scale) if grad_scale != 1.0 else w


def run_local_experts(experts: nn.Module, grad_scale: float, rows: Tensor, counts: list[int]) -> Tensor:
    """This rank's experts on ``rows`` grouped by local expert: ``proj(silu(fc_1 x) * fc_2 x)`` (LLaMAMLP)."""
    w = {name: _local(experts, name, grad_scale) for name in (*STACKED, *(f"{p}_bias" for p in STACKED))}

    def linear(part: str, e: int, x: Tensor) -> Tensor:
        bias = w[f"{part}_bias"]
        return F.linear(x, w[part][e], bias[e] if bias is not None else None)

    outputs = []
    for e, chunk in enumerate(rows.split(counts)):  # every local expert runs, so each weight gets a gradient
        outputs.append(linear("proj", e, F.silu(linear("fc_1", e, chunk)) * linear("fc_2", e, chunk)))
    return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[-1])


def _expert_parallel_forward(block: nn.Module, dispatcher: Any, x: Tensor) -> Tensor:
    """``LLaMAMoE.forward`` with the experts behind the dispatcher (the same routing math)."""
    config = block.config
    B, T, C = x.size()
    flat = x.reshape(-1, C)
    k = int(config.n_expert_per_token)
    bias = getattr(block, "expert_bias", None)  # `add_litgpt_bias`: on the gate's logits, for the selection only
    probs, indices = select_experts(block.gate(flat), bias, k)
    if bias is not None:
        record_load(block, indices)
    probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=flat.dtype)
    if config.routed_scaling_factor != 1.0:
        probs = probs * config.routed_scaling_factor
    expert_of = indices.reshape(-1)
    order = torch.argsort(expert_of, stable=True)  # (token t, slot j) -> row t*k+j, sorted by expert
    counts = rows_per_expert(expert_of, int(config.n_expert))
    experts = block.experts
    out = dispatcher(lambda rows, local_counts: experts(rows, local_counts), flat[order // k], counts)
    slots = out.new_zeros(flat.shape[0] * k, C).index_copy(0, order, out)
    y = (slots.view(-1, k, C) * probs.unsqueeze(-1)).sum(1).view(B, T, C)
    if config.n_shared_expert:
        y = y + block.shared_experts(x)
    return y


def add_litgpt_bias(module: nn.Module, bias_update_rate: float) -> int:
    """Auxiliary-loss-free balancing for every ``LLaMAMoE`` in ``module`` (a bias on its gate's logits, which it
    selects by): the block routes as under expert parallelism, running its own experts at ep=1."""
    blocks = [block for _, block in module.named_modules() if is_llama_moe(block)]
    for block in blocks:
        add_expert_bias(block, int(block.config.n_expert), bias_update_rate)
        block.forward = partial(_expert_parallel_forward, block, partial(_run_unstacked, block))
    return len(blocks)


def _run_unstacked(block: nn.Module, run: Any, routed: Tensor, counts: Tensor) -> Tensor:
    """ep=1: the routed rows through the block's own ``LLaMAMLP`` experts (the host reads the counts, as
    ``LLaMAMoE``'s ``torch.where`` does)."""
    return torch.cat([mlp(rows) for mlp, rows in zip(block.experts, routed.split(counts.tolist()))])


def shard_litgpt_experts(experts: nn.Module, dispatcher: Any, shard: Callable[[nn.Module], None]) -> None:
    """Stack ``experts``, shard the stacks over ep and route the block's tokens through ``dispatcher``."""
    block = _BLOCKS[experts]
    stack_experts(experts)
    shard(experts)
    block.forward = partial(_expert_parallel_forward, block, dispatcher)  # experts.grad_scale = 1/ep (shard)


def expert_count_field(experts: nn.Module) -> str:
    return "config.n_expert"


ADAPTER = ExpertAdapter(
    name="litgpt", interface=INTERFACE, find=litgpt_experts, shard=shard_litgpt_experts,
    count_field=expert_count_field, unsupported=unsupported_blocks, add_bias=add_litgpt_bias,
)
register_expert_adapter(ADAPTER)

__all__ = ["ADAPTER", "StackedExperts", "add_litgpt_bias", "is_llama_moe", "litgpt_experts", "run_local_experts", "shard_litgpt_experts", "stack_experts"]
