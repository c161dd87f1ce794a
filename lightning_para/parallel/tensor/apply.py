"""Tensor parallelism with sequence parallelism on ``torch.distributed.tensor.parallel``.

:func:`apply_tensor_parallel` turns a module's plan (see :mod:`.plan` and
``docs/tensor_parallel.md``) into torch ``ParallelStyle``\\ s over the 1-D ``tp`` mesh:

1. resolve the plan (strategy override > declared ``tensor_parallel_plan()`` > automatic),
   once on the whole model and keyed by module identity (:func:`plan_tensor_parallel`), so a
   module reachable under several names is planned once and a pipeline stage gets the plan
   of exactly the modules it holds;
2. validate it *without communication* (:func:`~.validate.check_plan`): styles fit module types, every
   split dimension divides by tp, no ``nn.Linear`` is left unplanned, sequence-parallel
   regions are closed, tied weights get one layout. Every rank sees the same model, so
   every rank raises the same ``ValueError`` before any collective -- nothing hangs;
3. apply the styles, re-tie tied weights (torch registers a new parameter per module), and
   hook gradients whose layout differs from their parameter's: ``Partial`` ones
   (sequence-parallel norm weights: each rank saw other tokens) are summed over tp right
   after accumulation, before ZeRO, clipping or the optimizer read them.

Loss parallel: with ``loss_parallel=True`` the head's logits stay a DTensor sharded over the
vocabulary; see :mod:`.loss` for the step and backward contexts that compute the loss on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_para._dtensor import is_strided, tied_parameter_groups
from lightning_para.parallel.tensor.adapters import tensor_parallel_adapter
from lightning_para.parallel.tensor.plan import ModulePlan, Style, plan_modules, resolve_plan
from lightning_para.parallel.tensor.styles import make_style, shard_stage_boundary
from lightning_para.parallel.tensor.validate import check_plan


@dataclass
class TensorParallelInfo:
    """What :func:`apply_tensor_parallel` did to one module (the model, or one pipeline stage)."""

    plan: dict[str, Style]
    source: str  # "override", "declared" or "auto"
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    head_attributes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def shards_logits(self) -> bool:
        """Whether the head's logits come out vocab-sharded, so the loss must run loss-parallel."""
        return self.loss_parallel and bool(self.plan)


def plan_tensor_parallel(
    model: nn.Module,
    tp: int,
    *,
    plan: Optional[Mapping[str, Any]] = None,
    sequence_parallel: bool = False,
    unplanned: str = "error",
) -> ModulePlan:
    """Resolve and validate the plan of the *whole* model, before a pipeline split (no communication).

    Every rank sees the whole model here, so every rank raises the same ``ValueError``; the
    result, keyed by module, is then applied to each part with :func:`apply_tensor_parallel`.
    """
    resolved = plan_modules(model, plan)
    check_plan(model, resolved.by_name, tp, sequence_parallel=sequence_parallel, unplanned=unplanned)
    return resolved


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    plan: Optional[Any] = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    keep_sequence_shard: bool = True,
    unplanned: str = "error",
    pipeline_stage: bool = False,
    float8: Optional[Any] = None,
    hook_grads: bool = True,
) -> TensorParallelInfo:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following its plan (see module docstring).

    ``plan``: a :class:`~.plan.ModulePlan` of the whole model (:func:`plan_tensor_parallel`), of
    which ``module`` is a part; or patterns that override the module's declared or automatic
    plan (``ParaStrategy(tp_plan=...)``); ``None``: declared or automatic.
    ``keep_sequence_shard`` (Megatron-SP, with ``sequence_parallel``): keep only the sequence
    shard of each sublayer input for backward and all-gather it again there.
    ``unplanned="replicate"`` keeps ``nn.Linear`` modules the plan leaves out whole on every rank
    (``ParaStrategy(tp_unplanned=...)``) instead of raising.
    ``pipeline_stage``: ``module`` is a pipeline stage; under SP the stream enters and leaves it
    as this rank's plain sequence slice (:func:`~.styles.shard_stage_boundary`).
    ``float8``: torchao's float8 tensor-parallel styles (``parallel/fp8.py``'s ``Float8ParallelStyles``,
    ``fp8="tensorwise"``): the converted linears get them, sublayers cast their input to float8 before
    the sequence all-gather; everything else keeps its style.
    """
    tp = tp_mesh.size()
    sp, lp = bool(sequence_parallel), bool(loss_parallel)
    if isinstance(plan, ModulePlan):
        resolved, source = plan.for_part(module), plan.source
    else:
        resolved, source = resolve_plan(module, plan)
    heads = check_plan(module, resolved, tp, sequence_parallel=sp, unplanned=unplanned)
    tied = tied_parameter_groups(module)
    for fqn, style in resolved.items():
        if isinstance(style, str):
            target = module.get_submodule(fqn)
            is_float8 = float8 is not None and (float8.applies_to(target) or style in ("attention", "mlp"))
            style = make_style(
                style, sequence_parallel=sp, loss_parallel=lp, head_attributes=heads.get(fqn),
                keep_shard=sp and keep_sequence_shard, float8=float8 if is_float8 else None, name=fqn,
            )
        parallelize_module(module.get_submodule(fqn), tp_mesh, style)
        adapter = tensor_parallel_adapter(module.get_submodule(fqn)) if resolved[fqn] == "attention" else None
        if adapter is not None:
            adapter.adapt(module.get_submodule(fqn), tp)

    _retie(module, tied)
    if hook_grads:
        hook_grad_layouts(module)
    if sp and pipeline_stage:
        shard_stage_boundary(module, tp_mesh)
    return TensorParallelInfo(resolved, source, tp, sp, lp, heads)


def hook_grad_layouts(module: nn.Module) -> None:
    """Give each DTensor parameter's gradient its parameter's layout right after accumulation
    (also for tensor parallelism the user applied in ``configure_model``).

    Register after any dtype cast of the parameters (``module.to(torch.bfloat16)`` swaps a DTensor
    parameter's tensor and drops its hooks: a ``Partial`` gradient would then reach ZeRO unreduced)."""
    for p in module.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_to_param_layout)


# ----------------------------------------------------------------------------- tied weights and gradients
def _retie(module: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every member of a tied group at one parameter again (e.g. wte.weight is lm_head.weight)."""
    for group in groups:
        params = [getattr(module.get_submodule(fqn), name) for fqn, name in group]
        first = params[0]
        layouts = {str(p.placements) if isinstance(p, DTensor) else "plain tensor" for p in params}
        if len(layouts) > 1:
            names = ", ".join(f"{fqn}.{name}" for fqn, name in group)
            raise ValueError(
                f"Tied parameters {names} get different tensor-parallel layouts ({sorted(layouts)}). Plan the"
                " embedding as 'vocab_parallel' and the output head as 'lm_head' (both split the vocabulary), or untie them."
            )
        for fqn, name in group[1:]:
            setattr(module.get_submodule(fqn), name, first)


def _grad_to_param_layout(param: torch.Tensor) -> None:
    """Give a gradient its parameter's layout right after accumulation.

    Sequence-parallel norm weights get ``Partial`` gradients (each rank saw other tokens):
    this sums them over tp (an all-reduce of the weight size). Any other mismatch (a
    replicated gradient for a sharded weight) is a local slice. ZeRO, clipping and the
    optimizer then read a gradient whose local tensor matches the parameter's.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def fsdp_shard_placement_fn(dp: int) -> Callable[[nn.Parameter], Optional[Shard]]:
    """FSDP2 ``shard_placement_fn`` for tensor-parallel parameters (ZeRO-3 over dp on top of TP).

    FSDP2 shards dim 0 by default. On a fused projection's ``_StridedShard(0)`` weight, a dp
    chunk of the tp-local rows mixes q, k and v rows and no placement describes it, so full
    tensors and checkpoints would be wrong. Those weights are sharded along dim 1 instead.
    """
    def placement(param: nn.Parameter) -> Optional[Shard]:
        if not is_strided(param):
            return None
        if param.dim() < 2 or param.shape[1] % dp:
            raise ValueError(
                f"ZeRO-3 with a fused tensor-parallel projection shards its weight {tuple(param.shape)} along dim 1,"
                f" which needs dp={dp} to divide {param.shape[1] if param.dim() > 1 else 'a second dim'}."
                " Choose a dp that divides the model width, or plan the projection as separate q/k/v Linears."
            )
        return Shard(1)

    return placement


def step_mixed_groups_per_tensor(optimizer: torch.optim.Optimizer) -> list[int]:
    """Make the optimizer step per tensor in each param group that mixes DTensors and plain tensors and left
    ``foreach`` to torch; returns the indices of the groups changed.

    Tensor parallelism without sequence parallelism leaves the norms plain tensors beside the DTensor
    projections. Where torch has multi-tensor kernels for the parameters' device (CUDA), an optimizer created
    with ``foreach=None`` (the default) steps each group as one multi-tensor call, and DTensor refuses mixed
    lists ("got mixed torch.Tensor and DTensor"): the first step of such a run raised. ``foreach=False`` is
    torch's own per-tensor step (the CPU default), so the numbers are the same; a group the user set is kept."""
    changed = []
    for index, group in enumerate(optimizer.param_groups):
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) > 1:
            group["foreach"] = False
            changed.append(index)
    return changed


__all__ = [
    "TensorParallelInfo", "apply_tensor_parallel", "fsdp_shard_placement_fn", "hook_grad_layouts",
    "plan_tensor_parallel", "step_mixed_groups_per_tensor",
]
