"""``parallelize()``: apply every dimension to a model, in one fixed order.

Order, and why:

1. **Pipeline split** first: each rank keeps only its own stages, so every later step works
   on (and allocates for) a fraction of the model.
2. **Tensor parallel** next: it turns parameters into DTensors on the ``tp`` mesh; data
   parallelism must see those shards, not the full weights, to shard the right bytes.
3. **Expert parallel**: experts become ``ep`` shards; marks their parameters so data
   parallelism reduces them over ``edp`` only.
4. **Activation checkpointing** wraps blocks that are already TP/EP-parallel, so the
   recomputed forward re-issues the same collectives.
5. **Data parallel / ZeRO** last: FSDP2 (stage 3) must wrap the final parameters, and the
   ZeRO-0/1/2 gradient hooks must sit on the parameters that really receive gradients.
6. **Precision** casts the model to bf16 (``bf16-true``) after ZeRO-0/1/2 took their fp32
   master copies, so masters start from the exact fp32 initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data_parallel import ZeroDataParallel, expert_or_dense_mesh
from lightning_para.parallel.fsdp import apply_fully_shard
from lightning_para.precision import ParaPrecision


@dataclass
class ParallelModel:
    """What :func:`parallelize` did to a module; kept by the strategy."""

    config: ParallelConfig
    dims: ParallelDims
    zero: Optional[ZeroDataParallel] = None
    fully_sharded: bool = False
    pipeline: Optional[Any] = None
    extras: dict[str, Any] = field(default_factory=dict)


def parallelize(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig, precision: ParaPrecision
) -> ParallelModel:
    """Apply pp, tp, ep, activation checkpointing, ZeRO and precision to ``module`` in place."""
    result = ParallelModel(config=config, dims=dims)
    if dims.pp_enabled:
        from lightning_para.parallel.pipeline_parallel import apply_pipeline_parallel

        result.pipeline = apply_pipeline_parallel(module, dims, config)
    if dims.tp_enabled:
        from lightning_para.parallel.tensor_parallel import apply_tensor_parallel

        for part in _model_parts(module, result):
            apply_tensor_parallel(part, dims.get_mesh("tp"), config)
    if dims.ep_enabled or _has_moe(module):
        from lightning_para.parallel.expert_parallel import apply_expert_parallel

        for part in _model_parts(module, result):
            apply_expert_parallel(part, dims)
    if config.activation_checkpointing:
        from lightning_para.parallel.activation_checkpoint import apply_activation_checkpointing

        for part in _model_parts(module, result):
            apply_activation_checkpointing(part, config.activation_checkpointing)

    # psi of the ZeRO formulas: what this rank holds before data parallelism shards it.
    result.extras["psi_dense"], result.extras["psi_expert"] = _count_params(module)

    dense_mesh, expert_mesh = dims.get_mesh("dp"), dims.get_mesh("edp")
    if config.zero == 3:
        precision.keep_fp32_params = True
        shard_placement = None
        if dims.tp_enabled:
            from lightning_para.parallel.tensor_parallel import fsdp_shard_placement_fn

            shard_placement = fsdp_shard_placement_fn(dims.dp)
        for part in _model_parts(module, result):
            apply_fully_shard(
                part,
                dense_mesh,
                param_dtype=precision.param_dtype,
                unit_mesh=_expert_unit_mesh(expert_mesh) if dims.ep_enabled else None,
                shard_placement_fn=shard_placement,
            )
        result.fully_sharded = True
    else:
        named = [
            (name, p, expert_or_dense_mesh(p, dense_mesh, expert_mesh))
            for name, p in module.named_parameters()
            if p.requires_grad
        ]
        result.zero = ZeroDataParallel(
            named, config.zero, bucket_size_mb=config.bucket_size_mb, master_dtype=precision.master_dtype
        )
    precision.convert_module(module)
    return result


def _count_params(module: nn.Module) -> tuple[int, int]:
    from lightning_para.parallel.grad_norm import local_tensor

    dense = expert = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        n = local_tensor(p.data).numel()
        if getattr(p, "_para_expert", False):
            expert += n
        else:
            dense += n
    return dense, expert


def _model_parts(module: nn.Module, result: ParallelModel) -> list[nn.Module]:
    """The modules each dimension is applied to: this rank's pipeline stages, or the whole model."""
    if result.pipeline is not None:
        return list(result.pipeline.stage_modules)
    return [module]


def _has_moe(module: nn.Module) -> bool:
    try:
        from lightning_para.moe import MoE
    except ImportError:
        return False
    return any(isinstance(m, MoE) for m in module.modules())


def _expert_unit_mesh(expert_mesh):
    def pick(unit: nn.Module):
        params = list(unit.parameters())
        if params and all(getattr(p, "_para_expert", False) for p in params):
            return expert_mesh
        return None

    return pick
