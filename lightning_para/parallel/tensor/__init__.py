"""Tensor parallelism with sequence parallelism: plans (:mod:`.plan`), styles (:mod:`.styles`),
validation (:mod:`.validate`), applying them (:mod:`.apply`), loss parallel (:mod:`.loss`) and
checkpointing strided shards (:mod:`.checkpoint`)."""

from lightning_para.parallel.tensor.adapters import adapted_fused_projections
from lightning_para.parallel.tensor.apply import (
    TensorParallelInfo,
    apply_tensor_parallel,
    fsdp_shard_placement_fn,
    hook_grad_layouts,
    plan_tensor_parallel,
    step_mixed_groups_per_tensor,
)
from lightning_para.parallel.tensor.loss import loss_parallel_backward, loss_parallel_step
from lightning_para.parallel.tensor.plan import ModulePlan, auto_plan, resolve_plan
from lightning_para.parallel.tensor.validate import check_plan

__all__ = [
    "ModulePlan",
    "TensorParallelInfo",
    "adapted_fused_projections",
    "apply_tensor_parallel",
    "auto_plan",
    "check_plan",
    "fsdp_shard_placement_fn",
    "hook_grad_layouts",
    "loss_parallel_backward",
    "loss_parallel_step",
    "plan_tensor_parallel",
    "resolve_plan",
    "step_mixed_groups_per_tensor",
]
