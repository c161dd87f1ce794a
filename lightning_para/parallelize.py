"""``parallelize()``: apply every dimension to a model, in one fixed order (the order and why: the comment in
:func:`parallelize` and ``docs/architecture.md``, "The order in ``parallelize()``").

What the user's ``configure_model`` already applied (TP with ``parallelize_module``, FSDP2 with ``fully_shard``)
is checked against the degrees and skipped (:func:`~lightning_para.compat.detect_user_parallelism`): a model the
user fully sharded gets nothing more; one the user split with TP gets only data parallelism on top. Each step is
one ``apply_*`` function of its dimension's package, given its sub-mesh and its options explicitly. The result is
a typed :class:`ParallelModel`: what was applied, per dimension, for the engine and the tools that read it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para._dtensor import local_tensor
from lightning_para.compat import UserParallelism, detect_user_parallelism
from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.moe import MoE, biased_routers, keep_expert_biases_fp32
from lightning_para.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_para.parallel.compile import CompileInfo, apply_compile, check_blocks
from lightning_para.parallel.fp8 import (
    Float8Info,
    apply_float8,
    float8_collectives_supported,
    float8_tensor_parallel_styles,
)
from lightning_para.parallel.context import ContextParallel, apply_context_parallel
from lightning_para.parallel.data import DataParallel, GradReplication, NoDataParallel, apply_data_parallel
from lightning_para.parallel.expert import ExpertParallelInfo, apply_expert_parallel, check_expert_layout
from lightning_para.parallel.pipeline import PipelineRunner, apply_pipeline_parallel
from lightning_para.parallel.tensor import (
    TensorParallelInfo,
    adapted_fused_projections,
    apply_tensor_parallel,
    fsdp_shard_placement_fn,
    hook_grad_layouts,
    plan_tensor_parallel,
)
from lightning_para.spec.options import compile_options


log = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """What :func:`parallelize` did to one module; kept by the strategy.

    ``parts`` are the modules each dimension was applied to: this rank's pipeline stages, or
    the whole model. ``tensor`` and ``experts`` hold one record per part.
    """

    config: ParallelConfig
    dims: ParallelDims
    parts: list[nn.Module]
    # Data parallelism (ZeRO 0-2, FSDP2, or the user's fully_shard): the one interface to it (a no-op one
    # until `parallelize` applies it).
    data_parallel: DataParallel
    pipeline: Optional[PipelineRunner] = None
    tensor: list[TensorParallelInfo] = field(default_factory=list)
    experts: list[ExpertParallelInfo] = field(default_factory=list)
    context: Optional[ContextParallel] = None  # cp > 1: batch split, attention and loss around each step
    compiled: list[CompileInfo] = field(default_factory=list)  # compile=True: the compiled blocks, per part
    float8: Optional[Float8Info] = None  # fp8: the linears converted to torchao float8 training, and the skipped
    # psi of the ZeRO formulas: what this rank holds before data parallelism shards it.
    psi_dense: int = 0
    psi_expert: int = 0
    # What the user's configure_model already applied (those dimensions were skipped).
    user: UserParallelism = field(default_factory=UserParallelism)

    @property
    def fully_sharded(self) -> bool:
        """Whether parameters are FSDP2 shards (ZeRO-3, HSDP, or the user's ``fully_shard``)."""
        return self.data_parallel.fully_sharded

    @property
    def grad_replication(self) -> GradReplication:
        """On how many ranks each optimizer parameter's gradient is identical (set when optimizers are attached)."""
        return self.data_parallel.grad_replication

    @property
    def loss_parallel(self) -> bool:
        """Whether the logits come out vocab-sharded, so losses run loss-parallel (tensor parallelism)."""
        return any(info.shards_logits for info in self.tensor)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer for info in self.experts for layer in info.layers]

    def expert_predicate(self) -> Callable[[Tensor], bool]:
        """``is_expert(tensor)`` for the expert parameters as they are now, and the ZeRO masters of them.

        Taken once and used for a batch of questions (the set is built at call time)."""
        ids = {id(p) for info in self.experts for p in info.expert_parameters()}
        ids |= self.data_parallel.masters_of(ids)
        return lambda t: id(t) in ids


@contextlib.contextmanager
def _entered(contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]]) -> Iterator[None]:
    """Enter each ``contexts[i]()`` in turn (the recomputation contexts of :func:`parallelize`)."""
    with contextlib.ExitStack() as stack:
        for make in contexts:
            stack.enter_context(make())
        yield


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    *,
    param_dtype: Optional[torch.dtype] = None,
    master_dtype: Optional[torch.dtype] = None,
    recompute_context: Optional[Callable[[], contextlib.AbstractContextManager[Any]]] = None,
) -> ParallelModel:
    """Apply pp, tp, ep, activation checkpointing, ZeRO and the precision cast to ``module`` in place.

    ``param_dtype`` is the dtype parameters compute in (bf16 under ``bf16-true``; ``None``: as they
    are); ``master_dtype`` the dtype of separate optimizer copies of the weights (fp32 then).
    ``recompute_context``: a context entered around each activation recomputation (besides context
    parallelism's): torch-function modes active in the forward are not active in backward (the dry
    run's fused-kernel mode, :mod:`lightning_para.simulate.rank`).
    """
    user = detect_user_parallelism(module, dims, config)
    if user.fully_sharded:
        return _keep_user_fully_sharded(module, dims, config, user, param_dtype)
    compile_opts = compile_options(config.compile)  # None: no compile
    # The order, and why: float8 first (the tp plan and the pipeline split see the float8 modules); the cast of
    # `*-true` before any dimension makes its parameters and hooks (or, ZeRO 0-2 with masters, just before the
    # gradient hooks: `_PrecisionCast`); the ep check, cp set-up and tp plan on the whole model, so every rank
    # raises the same error before the pipeline split keeps only this rank's stages; tp (data parallelism must
    # shard the tp shards), ep, then recomputation around already-parallel blocks (it re-issues their
    # collectives) and compile on each stage; data parallelism last, over the final parameters.
    float8 = _apply_float8(module, dims, config) if config.fp8 is not None else None
    cast = _PrecisionCast.choose(param_dtype, master_dtype, config.zero)
    if cast.first is not None:
        _cast(module, cast.first)
    if dims.ep > 1:
        check_expert_layout(module, dims.ep, dims.dp)
    context = None
    if dims.cp_enabled:
        context = apply_context_parallel(
            module, dims.get_mesh("cp"), method=config.cp_method, load_balance=config.cp_load_balance, tp=dims.tp
        )
    # The tensor-parallel plan is resolved and checked on the whole model, keyed by module: every
    # rank raises the same error, and each pipeline stage later gets exactly its modules' styles
    # whatever names (wrappers, references) reach them. A user's own TP (configure_model) is kept.
    tp_plan = (
        plan_tensor_parallel(
            module, dims.tp, plan=config.tp_plan, sequence_parallel=config.sequence_parallel,
            unplanned=config.tp_unplanned,
        )
        if dims.tp_enabled and not user.tensor_parallel else None
    )
    pipeline = _apply_pipeline(module, dims, config, compile_opts) if dims.pp_enabled else None
    result = ParallelModel(
        config, dims, list(pipeline.stage_modules) if pipeline is not None else [module],
        NoDataParallel(dims, stage=config.zero), pipeline=pipeline, context=context, user=user, float8=float8,
    )
    # Tensor parallelism's gradient hooks wait for the last cast (see `_PrecisionCast`).
    hooked_by_tp = [module] if user.tensor_parallel else _apply_tensor_parallel(result, tp_plan, compile_opts)
    ep_mesh = dims.get_mesh("ep") if dims.ep > 1 else None
    result.experts = [apply_expert_parallel(part, ep_mesh, dims.get_mesh("dp")) for part in result.parts]
    recompute = [c for c in (context.mode if context else None, recompute_context) if c is not None]
    for part in result.parts:
        # Under cp the recomputed attention must run across the cp group again (its mode is not active in backward).
        apply_activation_checkpointing(part, config.activation_checkpointing, partial(_entered, recompute) if recompute else None)
    if compile_opts is not None:  # after TP/SP, CP, EP and recomputation; before data parallelism wraps the blocks
        result.compiled = [apply_compile(part, options=compile_opts, require_blocks=pipeline is None) for part in result.parts]
    result.data_parallel = _apply_data_parallel(result, module, cast, hooked_by_tp, param_dtype, master_dtype)
    return result


def _apply_data_parallel(
    result: ParallelModel, module: nn.Module, cast: "_PrecisionCast", hooked_by_tp: list[nn.Module],
    param_dtype: Optional[torch.dtype], master_dtype: Optional[torch.dtype],
) -> DataParallel:
    """ZeRO 0-2 or FSDP2 over everything applied before; the last cast and tensor parallelism's gradient hooks
    come between ZeRO taking its masters and its own gradient hooks (``before_gradient_hooks``)."""
    config, dims = result.config, result.dims
    result.psi_dense, result.psi_expert = _count_params(module, result.expert_predicate())

    def before_gradient_hooks() -> None:
        if cast.after_masters is not None:
            _cast(module, cast.after_masters)
        for target in hooked_by_tp:
            hook_grad_layouts(target)

    return apply_data_parallel(
        module, dims, stage=config.zero, parts=result.parts, accumulation=config.zero_accumulation,
        bucket_size_mb=config.bucket_size_mb, zero3_units=config.zero3_units, param_dtype=param_dtype,
        master_dtype=master_dtype, is_expert=result.expert_predicate(),
        expert_units=[m for info in result.experts for m in info.expert_modules],
        shard_placement_fn=fsdp_shard_placement_fn(dims.zero_shards) if dims.tp_enabled else None,
        psi_dense=result.psi_dense, psi_expert=result.psi_expert, before_gradient_hooks=before_gradient_hooks,
    )


def _apply_float8(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> Float8Info:
    """torchao's float8 training linears; under ZeRO-3 FSDP2 all-gathers the float8 weights in float8 (half the
    bytes of bf16). Fused projections tensor parallelism adapts stay in high precision."""
    keep = adapted_fused_projections(module) if dims.tp > 1 else None
    fsdp_float8 = config.zero == 3 and dims.zero_shards > 1
    float8 = apply_float8(module, recipe=config.fp8, fsdp_float8_all_gather=fsdp_float8, keep=keep)
    if float8.skipped:
        log.info("fp8=%r: kept in high precision: %s", config.fp8, "; ".join(f"{k} ({v})" for k, v in float8.skipped.items()))
    return float8


def _apply_pipeline(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig, compile_opts: Optional[Any]
) -> PipelineRunner:
    """The pipeline split: only this rank's stages are kept (and built, from a meta model)."""
    if compile_opts is not None:
        check_blocks(module)  # on the whole model: a stage may hold only the embedding or the head
    return apply_pipeline_parallel(
        module, dims.get_mesh("pp"), schedule=config.schedule, microbatches=config.pipeline_microbatches,
        virtual_stages=config.virtual_stages, pipeline_split=config.pipeline_split,
        pipeline_balance=config.pipeline_balance,
    )


def _apply_tensor_parallel(result: ParallelModel, tp_plan: Any, compile_opts: Optional[Any]) -> list[nn.Module]:
    """Tensor (and sequence) parallelism on each part, from the plan resolved on the whole model; returns the
    modules whose gradients get their parameters' layouts once the last cast is done."""
    config, dims, pipeline = result.config, result.dims, result.pipeline
    if not dims.tp_enabled:
        return []
    # Megatron-SP keeps the sequence shard of each sublayer input and all-gathers it again in
    # backward. Activation checkpointing recomputes the whole block anyway, so the two are not
    # combined (the recomputed forward would install the hooks a second time).
    # Under compile the block's saved tensors are the compiled graph's, chosen by AOTAutograd's
    # partitioner; the shard-keeping saved-tensor hooks (matched by storage pointer) cannot be
    # traced and would graph-break and recompile at every call, so they are left out too.
    keep_shard = config.sp_save_input_shard and config.activation_checkpointing is None and compile_opts is None
    float8_styles = float8_tensor_parallel_styles(
        config.fp8, float8_collectives=float8_collectives_supported(dims.get_mesh("tp").get_group())
    )
    result.tensor = [
        apply_tensor_parallel(
            part, dims.get_mesh("tp"), plan=tp_plan, sequence_parallel=config.sequence_parallel,
            loss_parallel=config.loss_parallel, keep_sequence_shard=keep_shard, unplanned=config.tp_unplanned,
            pipeline_stage=pipeline is not None, float8=float8_styles, hook_grads=False,
        )
        for part in result.parts
    ]
    if pipeline is not None and result.loss_parallel:
        pipeline.enable_loss_parallel()
    if pipeline is not None and config.sequence_parallel:
        pipeline.require_sequence_multiple(dims.tp)  # checked on every pipeline rank before any send
    return result.parts


@dataclass(frozen=True)
class _PrecisionCast:
    """When :func:`parallelize` casts the parameters under ``*-true``, and to what.

    ``first``: before any dimension is applied, so tensor parallelism, ZeRO and FSDP2 make their
    shards and hooks on parameters of the final dtype. ``after_masters``: ZeRO 0-2 with fp32 masters,
    between taking the masters (from the exact fp32 initialisation) and registering any gradient
    hook. Never later: ``module.to(dtype)`` swaps each DTensor parameter's tensor
    (``torch.utils.swap_tensors``; the Python object stays) and the hooks on the old tensor never
    fire again, so tensor parallelism's Partial gradients would reach ZeRO unreduced and ZeRO's own
    hooks on tp shards would be lost.
    """

    first: Optional[torch.dtype] = None
    after_masters: Optional[torch.dtype] = None

    @staticmethod
    def choose(param_dtype: Optional[torch.dtype], master_dtype: Optional[torch.dtype], zero: int) -> "_PrecisionCast":
        if param_dtype is None:
            return _PrecisionCast()
        if master_dtype is None:
            # No fp32 masters (`ParaPrecision(master_weights=False)`, Lightning's true half precision): every
            # stage holds and steps the half-precision weights, FSDP2's shards included.
            return _PrecisionCast(first=param_dtype)
        if zero == 3:
            # FSDP2's shards are the masters: fp32, also for weights made in bf16 under `trainer.init_module()`;
            # FSDP2 gathers them in `param_dtype` itself.
            return _PrecisionCast(first=master_dtype)
        return _PrecisionCast(after_masters=param_dtype)


def _keep_user_fully_sharded(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig, user: UserParallelism, param_dtype: Optional[torch.dtype]
) -> ParallelModel:
    """The user's ``fully_shard`` (and TP, if any) is the whole layout: nothing is added. Under ``*-true``
    the model is cast as Lightning's ModelParallelStrategy casts it (FSDP2 keeps shards in that dtype)."""
    result = ParallelModel(config, dims, [module], NoDataParallel(dims, stage=config.zero), user=user)
    dense, _ = _count_params(module, result.expert_predicate())
    result.psi_dense = dense * dims.dp  # the shards FSDP2 left this rank, times the ranks that share them
    result.data_parallel = apply_data_parallel(
        module, dims, stage=config.zero, accumulation=config.zero_accumulation, user_fsdp_roots=user.fsdp_roots,
        psi_dense=result.psi_dense,
    )
    if param_dtype is not None:
        module.to(dtype=param_dtype)
        keep_expert_biases_fp32(module)
    return result


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)``, skipped where every floating-point tensor already has it (a no-op ``.to``
    would still swap DTensor parameters, dropping hooks the user's ``configure_model`` put on them); MoE
    selection biases stay fp32."""
    tensors = [*module.parameters(), *module.buffers()]
    fp32_biases = {id(getattr(router, router.bias_buffer)) for router in biased_routers(module)}
    if any(t.is_floating_point() and t.dtype != dtype and id(t) not in fp32_biases for t in tensors):
        module.to(dtype=dtype)
    keep_expert_biases_fp32(module)


def _count_params(module: nn.Module, is_expert: Callable[[Tensor], bool]) -> tuple[int, int]:
    dense = expert = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        n = local_tensor(p.data).numel()
        if is_expert(p):
            expert += n
        else:
            dense += n
    return dense, expert


__all__ = ["ParallelModel", "parallelize"]
