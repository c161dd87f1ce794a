"""Tensor parallelism with sequence parallelism: plans (:mod:`.plan`), styles (:mod:`.styles`),
validation (:mod:`.validate`), applying them (:mod:`.apply`), loss parallel (:mod:`.loss`) and
checkpointing strided shards (:mod:`.checkpoint`)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".adapters": ("adapted_fused_projections",),
    ".apply": ("TensorParallelInfo", "apply_tensor_parallel", "fsdp_shard_placement_fn", "hook_grad_layouts",
        "plan_tensor_parallel", "step_mixed_groups_per_tensor"),
    ".loss": ("loss_parallel_backward", "loss_parallel_step"),
    ".plan": ("ModulePlan", "auto_plan", "resolve_plan"),
    ".validate": ("check_plan",),
})
