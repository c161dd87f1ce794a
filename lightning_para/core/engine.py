"""``ParaEngine``: what a training run on one device mesh does, whichever front end drives it.

The Trainer's :class:`lightning_para.ParaStrategy` (``strategy.py``) and Fabric's
:class:`lightning_para.fabric.ParaStrategy` are adapters over one engine. The engine owns:

* the layout (:class:`~lightning_para.config.ParallelConfig` -> :class:`~lightning_para.mesh.ParallelDims`,
  the one DeviceMesh) and the record of what :func:`~lightning_para.parallelize` applied;
* the model set-up: materialising an ``empty_init`` (meta) model, parallelizing it once, attaching
  optimizers to data parallelism (and torchao's float8 scale hooks);
* the run guard: the step guard (non-finite values, SIGTERM), the watchdog and the integrity checker;
* the routing of a step: context parallelism's batch split and its first-step check, the pipeline
  schedule, the loss-parallel contexts of tensor parallelism, MoE aux-loss gradient scaling;
* checkpoint IO: state dicts of any layout, atomic checksummed saves, loads in place.

A front end supplies only what its framework knows: the world size, the step counter, how a
step is called (Lightning's forward redirection) and the accumulation factor.

The run guard's methods are :class:`~lightning_para.core.run_guard.EngineRunGuard`'s and the checkpoint IO's
:class:`~lightning_para.core.checkpoints.EngineCheckpoints`' (the engine's own state, in two more modules).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch import nn

from lightning_para import checkpoint as ckpt
from lightning_para._dtensor import plain_step_output
from lightning_para.checkpoint.pretrained import load_pretrained_into, materialize_for_loading, pending_weights, real_buffers
from lightning_para.config import ParallelConfig
from lightning_para.core.checkpoints import EngineCheckpoints
from lightning_para.core.run_guard import EngineRunGuard
from lightning_para.instrument.saved_activations import SavedActivationMeter
from lightning_para.mesh import ParallelDims
from lightning_para.moe import aux_loss_grad_scale, set_aux_loss_grad_scale
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallel.data import DataParallel, MemoryBreakdown
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.parallel.fp8 import precompute_float8_scales
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step, step_mixed_groups_per_tensor
from lightning_para.parallelize import ParallelModel, parallelize
from lightning_para.precision import ParaPrecision
from lightning_para.reliability.integrity import IntegrityChecker, check_integrity_options
from lightning_para.reliability.spike_guard import spike_guard_option
from lightning_para.reliability.step_guard import StepGuard, pipeline_rank_info
from lightning_para.reliability.straggler import mesh_coordinates, straggler_option
from lightning_para.reliability.watchdog import Watchdog, check_watchdog_timeout

# The layout each module was parallelized with, so a second `fit`/`setup` of the same module reuses it
# (a module is parallelized in place, once). Weak: it keeps no module alive.
_PARALLELIZED: "weakref.WeakKeyDictionary[nn.Module, ParallelModel]" = weakref.WeakKeyDictionary()


class ParaEngine(EngineRunGuard, EngineCheckpoints):
    """One run's layout, parallel model, run guard and checkpoint IO (see the module docstring).

    Args:
        config: the validated layout.
        integrity_check_every_n_steps, integrity_action, watchdog_timeout, check_finite, on_sigterm, straggler,
            spike_guard: the reliability options of ``ParaStrategy`` (validated here, before any process group).
        run_id: this run's id across restarts, recorded in every checkpoint (``checkpoint/run.py``).
        timeout: the process-group timeout (the watchdog's must be below it).
        front_end: ``"Trainer"`` or ``"Fabric"``, named in errors about the order of calls.
    """

    def __init__(
        self,
        config: ParallelConfig,
        *,
        integrity_check_every_n_steps: Optional[int] = None,
        integrity_action: str = "raise",
        watchdog_timeout: Optional[float] = 60.0,
        timeout: Optional[timedelta] = None,
        check_finite: bool = True,
        on_sigterm: Optional[str] = "checkpoint",
        run_id: Optional[str] = None,
        front_end: str = "Trainer",
        straggler: Any = True,
        spike_guard: Any = None,
    ) -> None:
        check_integrity_options(integrity_check_every_n_steps, integrity_action)
        check_watchdog_timeout(watchdog_timeout, timeout)
        self.config = config
        self.front_end = front_end
        self.watchdog_timeout = watchdog_timeout
        self.checkpoint_run = ckpt.CheckpointRun(run_id)  # which run saves; rank 0's hold on its checkpoint folders
        self.watchdog: Optional[Watchdog] = None
        self.integrity = (
            IntegrityChecker(integrity_check_every_n_steps, integrity_action) if integrity_check_every_n_steps else None
        )
        self.guard = StepGuard(check_finite=check_finite, on_sigterm=on_sigterm)  # NaN stop, SIGTERM
        self.spike = spike_guard_option(spike_guard)  # both ride the step guard's all-reduce
        self.straggler = straggler_option(straggler)
        self.guard.riders = [r for r in (self.spike, self.straggler) if r is not None]
        self.dims: Optional[ParallelDims] = None
        self.parallel: Optional[ParallelModel] = None
        self.compile_watch: Optional[CompileWatch] = None  # compile=True: graphs and recompiles
        self._compiled_phases: set[str] = set()  # compile=True: step kinds that ran once (compiled) already

    # ------------------------------------------------------------------ layout
    def resolve_dims(self, world_size: int, devices_per_node: Optional[int] = None) -> ParallelDims:
        """The degrees for ``world_size`` processes (raises ``ValueError`` before any collective)."""
        dims = self.config.resolve_dims(world_size, devices_per_node=devices_per_node)
        if self.dims is None or self.dims.shape != dims.shape:
            self.dims = dims
        return self.dims

    def build_mesh(self, device_type: str) -> ParallelDims:
        dims = self.parallel_dims
        if dims.mesh is None:
            dims.build_mesh(device_type)
        return dims

    @property
    def parallel_dims(self) -> ParallelDims:
        if self.dims is None:
            raise RuntimeError(f"The parallel layout is resolved when the {self.front_end} sets up the strategy.")
        return self.dims

    @property
    def parallel_model(self) -> ParallelModel:
        if self.parallel is None:
            raise RuntimeError(f"The model is parallelized when the {self.front_end} sets up the strategy.")
        return self.parallel

    @property
    def data_parallel(self) -> Optional[DataParallel]:
        return self.parallel.data_parallel if self.parallel is not None else None

    @property
    def has_pipeline(self) -> bool:
        return self.parallel is not None and self.parallel.pipeline is not None

    def forward_through_root(self, module: nn.Module) -> bool:
        """Whether a step must enter through ``module.__call__`` (FSDP2's root hooks), not a named method."""
        return self.data_parallel is not None and self.data_parallel.forward_through_root(module)

    def memory_breakdown(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], precision: ParaPrecision) -> MemoryBreakdown:
        """This rank's parameter, gradient and optimizer bytes against the ZeRO formulas (``docs/data_parallel.md``)."""
        if self.data_parallel is None:
            raise RuntimeError(f"memory_breakdown() is available once the {self.front_end} has set up the strategy.")
        first = next(iter(module.parameters()), None)
        return self.data_parallel.memory_breakdown(
            module, optimizers, param_bytes=first.element_size() if first is not None else 4,
            master_dtype=precision.master_dtype, is_expert=self.parallel_model.expert_predicate(),
        )

    def pipeline_stats(self) -> PipelineStats:
        """Per-step busy/idle time and action events of this rank's pipeline stages (``pp > 1`` only)."""
        if not self.has_pipeline:
            raise RuntimeError("pipeline_stats() needs pipeline parallelism (pp > 1).")
        return self.parallel_model.pipeline.stats()

    # ------------------------------------------------------------------ model
    def parallelize(
        self, module: nn.Module, device: torch.device, precision: ParaPrecision,
        before: Optional[Callable[[nn.Module], None]] = None,
    ) -> ParallelModel:
        """Materialise ``module`` and parallelize it in place, once; a module parallelized before keeps its
        layout (a different one raises). ``before(module)`` runs on the materialised model, before any
        dimension (the Trainer converts BatchNorms there).

        Parameters made under ``init_module(empty_init=True)`` are on the meta device: allocated on
        ``device`` and reset deterministically before sharding; or, when the module asks for pretrained
        weights (:mod:`lightning_para.checkpoint.pretrained`), read after parallelizing, each rank its
        own slices (ZeRO 0-2 replicate them over dp: empty storage before, no random init)."""
        existing = _PARALLELIZED.get(module)
        if existing is not None:
            self._check_same_layout(existing)
            self.parallel = existing
            if before is not None:
                before(module)
            return existing
        weights = pending_weights(module) if any(p.is_meta for p in module.parameters()) else None
        kept_buffers = real_buffers(module) if weights is not None else {}
        if not self.parallel_dims.pp_enabled:  # the pipeline split builds only this rank's stages
            if weights is None:
                self.materialize(module, device)
            elif self.config.zero < 3:
                materialize_for_loading(module, device, kept_buffers)
        if before is not None:
            before(module)
        self.parallel = parallelize(
            module, self.parallel_dims, self.config, param_dtype=precision.param_dtype, master_dtype=precision.master_dtype
        )
        if weights is not None:
            materialize_for_loading(module, device, kept_buffers)
            self.report("setup: load pretrained weights, each rank its own slices", exempt=True)
            load_pretrained_into(module, weights)
        _PARALLELIZED[module] = self.parallel
        if self.parallel.pipeline is not None:
            self.parallel.pipeline.activation_meter = SavedActivationMeter
        if self.parallel.compiled:  # counts from here: the first compilation of each block class is expected
            types = sorted({t for info in self.parallel.compiled for t in info.block_types})
            self.compile_watch = CompileWatch(types)
        return self.parallel

    @staticmethod
    def materialize(module: nn.Module, device: torch.device) -> None:
        """Meta parameters (``init_module(empty_init=True)``) allocated on ``device`` and reset by each
        submodule's ``reset_parameters`` (seeded: every rank gets the same values); the rest moved there."""
        _materialize_distributed_module(module, device)
        module.to(device)

    def _check_same_layout(self, existing: ParallelModel) -> None:
        old, new = existing.config, self.config
        if (existing.dims.shape, old.zero) != (self.parallel_dims.shape, new.zero):
            raise ValueError(
                "This module was already parallelized by another ParaStrategy with a different layout"
                f" (pp={existing.dims.pp}, dp={existing.dims.dp}, tp={existing.dims.tp}, ep={existing.dims.ep},"
                f" cp={existing.dims.cp}, dp_replicate={existing.dims.dp_replicate},"
                f" zero={old.zero}). Create a new module instance (or load a checkpoint into one) for a new layout."
            )
        self.dims = existing.dims

    def attach_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Hand each optimizer to data parallelism (ZeRO edits its param groups in place), and keep torchao's
        float8 weight scales current under ZeRO-3's float8 all-gather."""
        parallel = self.parallel_model
        data_parallel = parallel.data_parallel
        assert data_parallel is not None
        is_expert = parallel.expert_predicate()
        float8, parts = parallel.float8, parallel.parts
        if float8 is not None and float8.fsdp_float8_all_gather:
            # Before the first step too: FSDP2's own first cast reduces the weight amax over its dp mesh
            # only, so a tp-sharded weight would get a per-tp-shard scale (2.7e-3 off one device under
            # dp2 x tp2 ZeRO-3); the precomputed scale is the amax of the whole DTensor.
            for part in parts:
                precompute_float8_scales(part)
        for optimizer in optimizers:
            data_parallel.attach_optimizer(optimizer, is_expert=is_expert)
            step_mixed_groups_per_tensor(optimizer)  # after ZeRO, which may have put masters in the groups
            if float8 is not None and float8.fsdp_float8_all_gather:
                # ZeRO-3 float8 all-gather: all weight scales in one all-reduce after each step (torchtitan's order).
                optimizer.register_step_post_hook(lambda *_: [precompute_float8_scales(part) for part in parts])

    def connect(
        self, device: torch.device, precision: ParaPrecision, step: Callable[[], int],
        check_step: Callable[[Any, bool], None],
    ) -> None:
        """After set-up: the step guard learns the device and stages; the precision plugin learns data
        parallelism (gradient flush, replication counts) and the guard's check before each optimizer step."""
        pipeline, dims, data_parallel = self.parallel_model.pipeline, self.parallel_dims, self.data_parallel
        assert data_parallel is not None
        self.guard.connect(device, pipeline_rank_info(dims.mesh), data_parallel.grad_replication)
        if self.straggler is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.straggler.connect(device, rank, dims.world_size, lambda r: mesh_coordinates(dims, r))
        if self.spike is not None:
            self.spike.connect(device, self.guard)
        if pipeline is not None:  # which stage produced a NaN first: each stage's forward output is checked
            self.guard.watch_stage_outputs(
                ((m.stage_index, m) for m in pipeline.stage_modules), step, lambda: pipeline.inferring_shapes
            )
        precision.connect_layout(
            data_parallel, check_step=check_step if self.guard.active else None,
            step_gate=self.spike.run_step if self.spike is not None else None,
        )

    # ------------------------------------------------------------------ backward and accumulation
    def before_backward(self, module: Optional[nn.Module], precision: ParaPrecision, accumulate: int) -> None:
        """Before a (non-pipeline) backward: gradients shown since the last step are settled (DDP: until
        ``zero_grad``), and MoE layers scale the aux-loss gradient they feed in backward as the loss is scaled
        (``moe.aux_loss_grad_scale``: times the 16-mixed loss scale, over ``accumulate`` micro-steps). Under
        pp the pipeline runner sets the MoE scale before its schedule runs backward."""
        parallel = self.parallel
        if parallel is None:
            return
        if self.straggler is not None:  # the end of this rank's own work before the gradient synchronisation
            self.straggler.arrive()
        if parallel.data_parallel is not None:
            parallel.data_parallel.before_backward()
        if parallel.moe_layers and parallel.pipeline is None and module is not None:
            loss_scale = precision.scale if precision.uses_loss_scaling else 1.0
            set_aux_loss_grad_scale(module, aux_loss_grad_scale(loss_scale=loss_scale, accumulate=accumulate))

    def backward_context(self) -> contextlib.AbstractContextManager[None]:
        """Tensor parallel: the loss-parallel cross-entropy kernels are DTensor custom ops, backward needs them too."""
        return loss_parallel_backward(self.parallel is not None and self.parallel.loss_parallel)

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        """Tensor parallel: cross-entropy on vocab-sharded logits runs loss-parallel."""
        return loss_parallel_step(self.parallel is not None and self.parallel.loss_parallel)

    @contextlib.contextmanager
    def accumulation_no_sync(self) -> Generator[None, None, None]:
        """The first A-1 micro-steps follow data parallelism's accumulation policy (``zero_accumulation``)."""
        data_parallel = self.data_parallel
        if data_parallel is None:
            yield
        else:
            with data_parallel.accumulation_no_sync():
                yield

    def finalize_gradients(self) -> None:
        """Finish any gradient communication still pending (before clipping or unscaling)."""
        if self.data_parallel is not None:
            self.data_parallel.flush()

    # ------------------------------------------------------------------ steps
    def run_step(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, context: Any, *,
        call: Callable[..., Any], precision: ParaPrecision, accumulate: Optional[int] = None, check_cp: bool = True,
        check_contexts: Optional[dict[str, Callable[[], Any]]] = None,
    ) -> Any:
        """Run step ``name`` of ``module`` on this rank's share: context parallelism's chunks (with its
        first-step check unless ``check_cp`` is false), the pipeline schedule under pp, or ``call(*args,
        **kwargs)`` under tensor parallelism's loss-parallel context. ``context`` is the precision's step
        context; ``check_contexts`` gives one per step name for the cp check's extra forwards."""
        cp = self.parallel.context if self.parallel is not None else None
        if cp is None:
            return self._run_parallel_step(name, module, context, args, kwargs, call, precision, accumulate)
        # Context parallel (parallel/context/step.py): this rank's chunks of the batch; SDPA runs
        # across the cp group and cross-entropy covers the whole sequence, in every stage too.
        # The first-step check runs the step twice more without gradients (not under pp: stages see activations).
        if not cp.positions_checked and self.config.cp_check and self.parallel.pipeline is None and check_cp:
            contexts = check_contexts or {}
            batch = args[0] if args else kwargs.get("batch")

            def run(step_batch: Any) -> Any:
                step_args, step_kwargs = ((step_batch, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": step_batch})
                step_context = contexts[name]() if name in contexts else contextlib.nullcontext()
                return self._run_parallel_step(name, module, step_context, step_args, step_kwargs, call, precision, accumulate)

            multiple = self.parallel.dims.tp if self.config.sequence_parallel else 1
            cp.check_positions(module, batch, run, sequence_multiple=multiple)
        args, kwargs = cp.split_step_inputs(module, args, kwargs)
        mode = cp.mode()
        with mode:
            output = self._run_parallel_step(name, module, context, args, kwargs, call, precision, accumulate)
        cp.check_attention_reached(mode)
        return cp.gather_output(output) if name == "predict_step" else output

    def _run_parallel_step(
        self, name: str, module: nn.Module, context: Any, args: tuple, kwargs: dict, call: Callable[..., Any],
        precision: ParaPrecision, accumulate: Optional[int],
    ) -> Any:
        parallel = self.parallel
        if parallel is not None and parallel.pipeline is not None:
            with context:  # the runner enters the tensor-parallel contexts around its stages itself
                return self.pipeline_run(name, module, args[0] if args else kwargs["batch"], precision, accumulate)
        with context, self.step_context():
            output = call(*args, **kwargs)
        return plain_step_output(output, gather=name == "predict_step")

    def pipeline_run(
        self, name: str, module: nn.Module, batch: Any, precision: ParaPrecision, accumulate: Optional[int] = None
    ) -> Any:
        """One step of the pipeline schedule over ``batch`` (pp > 1): forward and backward of every
        microbatch for ``"training_step"`` (gradients set aside until :meth:`finish_pipeline_backward`)."""
        parallel = self.parallel_model
        if parallel.pipeline is None:
            raise RuntimeError("A pipeline step needs pipeline parallelism (pp > 1).")
        return parallel.pipeline.run(
            name, module, batch, loss_scale=precision.scale if precision.uses_loss_scaling else 1.0,
            gradient_sync=parallel.data_parallel, accumulate=accumulate,
        )

    def finish_pipeline_backward(self) -> None:
        """The pipeline step's gradients join ``.grad`` and sync over dp (its schedule ran backward already)."""
        parallel = self.parallel_model
        assert parallel.pipeline is not None
        parallel.pipeline.finish_backward(parallel.data_parallel)

__all__ = ["ParaEngine"]
