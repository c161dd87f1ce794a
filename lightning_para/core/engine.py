"""``ParaEngine``: what a training run on one device mesh does, whichever front end drives it, as a lifecycle.

The Trainer's :class:`lightning_para.ParaStrategy` and Fabric's :class:`lightning_para.fabric.ParaStrategy`
translate their framework's calls into it and nothing more; the dry run drives its step too. In order:
``resolve_dims``, ``setup_environment``, ``setup_module``, ``setup_optimizers``, ``start_training``; per step
``begin_step``, ``step``, ``before_backward``, ``backward``, ``before_optimizer_step`` (called by the precision
once gradients are final), ``optimizer_step``, ``end_step``; then ``end_training``, ``on_exception``,
``teardown``; saves and loads through ``checkpoints``. ``docs/architecture.md`` ("The engine as a lifecycle")
says who calls what. The run guard (step guard, watchdog, integrity checker) and the checkpoint IO are objects
the engine holds; a feature acting at a step boundary, around the optimizer step or at a save hooks into the
matching method here, once for both front ends.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para._dtensor import plain_step_output
from lightning_para.config import ParallelConfig
from lightning_para.core.checkpoints import Checkpoints
from lightning_para.core.model_setup import parallel_model_of
from lightning_para.core.precision import PrecisionCore
from lightning_para.core.run_guard import RunGuard
from lightning_para.mesh import ParallelDims
from lightning_para.moe import aux_loss_grad_scale, biased_routers, set_aux_loss_grad_scale, update_expert_bias
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallel.data import MemoryBreakdown
from lightning_para.parallel.fp8 import precompute_float8_scales
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step, step_mixed_groups_per_tensor
from lightning_para.parallelize import ParallelModel
from lightning_para.reliability.spike_guard import SpikeGuard
from lightning_para.reliability.straggler import StragglerDetector


class ParaEngine:
    """One run's layout, parallel model, run guard and checkpoint IO, as a lifecycle (see the module docstring).

    Args:
        config: the validated layout.
        integrity_check_every_n_steps, integrity_action, watchdog_timeout, check_finite, on_sigterm, straggler,
            spike_guard: the reliability options of ``ParaStrategy`` (validated here, before any process group).
        run_id: this run's id across restarts, recorded in every checkpoint (``checkpoint/run.py``).
        async_save: sharded saves return once staged and are written in the background (``checkpoint/async_save.py``).
        timeout: the process-group timeout (the watchdog's must be below it).
        front_end: ``"Trainer"`` or ``"Fabric"``, named in errors about the order of calls.
        step: the front end's step counter (the Trainer's global step, Fabric's optimizer steps).
    """

    def __init__(
        self, config: ParallelConfig, *, integrity_check_every_n_steps: Optional[int] = None,
        integrity_action: str = "raise", watchdog_timeout: Optional[float] = 60.0, timeout: Optional[timedelta] = None,
        check_finite: bool = True, on_sigterm: Optional[str] = "checkpoint", run_id: Optional[str] = None,
        async_save: bool = False, front_end: str = "Trainer", step: Callable[[], int] = lambda: -1,
        straggler: Any = True, spike_guard: Any = None,
    ) -> None:
        self.config = config
        self.front_end = front_end
        self.run_guard = RunGuard(
            step, integrity_check_every_n_steps=integrity_check_every_n_steps, integrity_action=integrity_action,
            watchdog_timeout=watchdog_timeout, timeout=timeout, check_finite=check_finite, on_sigterm=on_sigterm,
            straggler=straggler, spike_guard=spike_guard,
            front_end=front_end,
        )
        self.checkpoints = Checkpoints(run_id, lambda: self.parallel_model, self.run_guard, async_save=async_save)
        self.dims: Optional[ParallelDims] = None
        self.parallel: Optional[ParallelModel] = None
        self.module: Optional[nn.Module] = None  # the set-up model, and what it runs with
        self.precision = PrecisionCore()
        self.device = torch.device("cpu")
        self.optimizers: list[torch.optim.Optimizer] = []

    # ------------------------------------------------------------------ layout
    def resolve_dims(self, world_size: int, devices_per_node: Optional[int] = None) -> ParallelDims:
        """The degrees for ``world_size`` processes (raises ``ValueError`` before any collective)."""
        dims = self.config.resolve_dims(world_size, devices_per_node=devices_per_node)
        if self.dims is None or self.dims.shape != dims.shape:
            self.dims = dims
        return self.dims

    def setup_environment(self, device_type: str, world_size: int, broadcast: Callable[[Any], Any]) -> ParallelDims:
        """The process group exists: build the mesh (once) and start the watchdog."""
        dims = self.parallel_dims
        if dims.mesh is None:
            dims.build_mesh(device_type)
        self.run_guard.start_watchdog(world_size, broadcast)
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
    def has_pipeline(self) -> bool:
        return self.parallel is not None and self.parallel.pipeline is not None

    @property
    def compile_watch(self) -> Optional[CompileWatch]:
        """``compile=True``: the compiled block graphs and their recompilations."""
        return self.run_guard.compile_watch

    @property
    def straggler(self) -> Optional[StragglerDetector]:
        return self.run_guard.straggler

    @property
    def spike_guard(self) -> Optional[SpikeGuard]:
        return self.run_guard.spike

    @property
    def preempted(self) -> bool:
        """Every rank agreed on a SIGTERM (``on_sigterm="checkpoint"``): the loop saves and exits."""
        return self.run_guard.preempted

    def forward_through_root(self, module: nn.Module) -> bool:
        """Whether a step must enter through ``module.__call__`` (FSDP2's root hooks), not a named method."""
        return self.parallel_model.data_parallel.forward_through_root(module)

    def memory_breakdown(self, module: Optional[nn.Module] = None) -> MemoryBreakdown:
        """This rank's parameter, gradient and optimizer bytes against the ZeRO formulas (``docs/data_parallel.md``)."""
        parallel, module = self.parallel_model, module or self.module
        first = next(iter(module.parameters()), None)
        return parallel.data_parallel.memory_breakdown(
            module, self.optimizers, param_bytes=first.element_size() if first is not None else 4,
            master_dtype=self.precision.master_dtype, is_expert=parallel.expert_predicate(),
        )

    def pipeline_stats(self) -> PipelineStats:
        """Per-step busy/idle time and action events of this rank's pipeline stages (``pp > 1`` only)."""
        if not self.has_pipeline:
            raise RuntimeError("pipeline_stats() needs pipeline parallelism (pp > 1).")
        return self.parallel_model.pipeline.stats()

    def progress(self, phase: str) -> None:
        """Tell the watchdog this rank is in ``phase`` of the current step (a compiling one is exempt)."""
        self.run_guard.progress(phase)

    def returned(self, call: str) -> None:
        """Fabric: ``call`` returned to the loop's own code, which may take any time (evaluating, writing files,
        waiting in ``fabric.barrier()`` for a rank doing either): alive, not stuck, and peers stalled in a call
        meanwhile wait for it (``docs/reliability.md``, "The watchdog under Fabric")."""
        self.run_guard.report(f"the loop's own code after {call} (step {self.run_guard.step()})", in_user_code=True)

    # ------------------------------------------------------------------ setup
    def setup_module(
        self, module: nn.Module, device: torch.device, precision: PrecisionCore,
        before: Optional[Callable[[nn.Module], None]] = None, parallel: Optional[ParallelModel] = None,
    ) -> ParallelModel:
        """Materialise ``module`` and parallelize it in place, once (:func:`~lightning_para.core.model_setup.parallel_model_of`;
        ``parallel``: it was parallelized already, the dry run's on the meta device); then the run guard and the
        precision are connected to it. ``before(module)`` runs on the materialised model, before any dimension
        (the Trainer converts BatchNorms)."""
        self.run_guard.report("setup: parallelize the model", exempt=True)
        precision.device_type = device.type
        self.precision, self.device, self.module = precision, device, module
        new = parallel is None
        if parallel is None:
            parallel, new = parallel_model_of(module, self.parallel_dims, self.config, device, precision, before, self.run_guard.report)
        if new:  # counts from here: the first compilation of each block class is expected
            self.run_guard.watch_compiles(parallel)
        self.parallel, self.dims = parallel, parallel.dims  # a module parallelized before keeps its layout and mesh
        self.run_guard.connect(parallel, device)
        active, spike = self.run_guard.guard.active, self.run_guard.spike
        precision.connect_layout(
            parallel.data_parallel, check_step=self.before_optimizer_step if active else None,
            step_gate=spike.run_step if spike is not None else None,
        )
        return parallel

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer], append: bool = False) -> None:
        """Hand each optimizer to data parallelism (ZeRO edits its param groups in place), keep torchao's float8
        weight scales current under ZeRO-3's float8 all-gather, and update MoE selection biases after each step.
        ``append``: beside those set up before (Fabric's one at a time), else in their place (the Trainer's, made
        again for every ``fit``)."""
        parallel = self.parallel_model
        is_expert = parallel.expert_predicate()
        float8, parts = parallel.float8, parallel.parts
        if float8 is not None and float8.fsdp_float8_all_gather:
            # Before the first step too: FSDP2's own first cast reduces the weight amax over its dp mesh
            # only, so a tp-sharded weight would get a per-tp-shard scale (2.7e-3 off one device under
            # dp2 x tp2 ZeRO-3); the precomputed scale is the amax of the whole DTensor.
            for part in parts:
                precompute_float8_scales(part)
        for optimizer in optimizers:
            parallel.data_parallel.attach_optimizer(optimizer, is_expert=is_expert)
            step_mixed_groups_per_tensor(optimizer)  # after ZeRO, which may have put masters in the groups
            if float8 is not None and float8.fsdp_float8_all_gather:
                # ZeRO-3 float8 all-gather: all weight scales in one all-reduce after each step (torchtitan's order).
                optimizer.register_step_post_hook(lambda *_: [precompute_float8_scales(part) for part in parts])
        if optimizers and not (append and self.optimizers) and biased_routers(*parts):
            # The MoE selection biases, after the first optimizer's steps, from the load of the ranks with other tokens.
            dims = self.parallel_dims
            groups = [dims.group("dp")] + ([dims.group("cp")] if dims.size("cp") > 1 else [])
            optimizers[0].register_step_post_hook(lambda *_: update_expert_bias(parts, groups))
        self.optimizers = [*self.optimizers, *optimizers] if append else list(optimizers)

    def start_training(self) -> None:
        """``on_sigterm``: the signal handler records the signal only; every rank agrees on it at a step."""
        self.run_guard.guard.install_signal_handler()

    # ------------------------------------------------------------------ steps
    def begin_step(self, phase: str = "step begins", what: Optional[str] = None) -> None:
        """A step begins (the Trainer: its batch is loaded; Fabric: the last optimizer step ended): the watchdog
        hears of it, and the scheduled integrity check runs (after the last step's ZeRO gather)."""
        self.run_guard.progress(phase, what)
        if self.run_guard.integrity_due():
            self.check_integrity()

    def step(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, context: Any, *, call: Callable[..., Any],
        accumulate: Optional[int] = None, check_cp: bool = True,
        check_contexts: Optional[dict[str, Callable[[], Any]]] = None, observe: Optional[bool] = None,
    ) -> Any:
        """Run step ``name`` of ``module`` on this rank's share: context parallelism's chunks (with its
        first-step check unless ``check_cp`` is false), the pipeline schedule under pp, or ``call(*args,
        **kwargs)`` under tensor parallelism's loss-parallel context. ``context`` is the precision's step
        context; ``check_contexts`` gives one per step name for the cp check's extra forwards. The loss a
        training step returns is noted (``observe``; default: for ``"training_step"``)."""
        self.run_guard.progress(name)
        output = self._step(name, module, args, kwargs, context, call, accumulate, check_cp, check_contexts or {})
        if observe if observe is not None else name == "training_step":
            self.observe_loss(output)
        return output

    def _step(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, context: Any, call: Callable[..., Any],
        accumulate: Optional[int], check_cp: bool, check_contexts: dict[str, Callable[[], Any]],
    ) -> Any:
        parallel = self.parallel_model
        cp = parallel.context
        if cp is None:
            return self._run_parallel_step(name, module, context, args, kwargs, call, accumulate)
        # Context parallel (parallel/context/step.py): this rank's chunks of the batch; SDPA runs
        # across the cp group and cross-entropy covers the whole sequence, in every stage too.
        # The first-step check runs the step twice more without gradients (not under pp: stages see activations).
        if not cp.positions_checked and self.config.cp_check and parallel.pipeline is None and check_cp:
            batch = args[0] if args else kwargs.get("batch")

            def run(step_batch: Any) -> Any:
                step_args, step_kwargs = ((step_batch, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": step_batch})
                step_context = check_contexts[name]() if name in check_contexts else contextlib.nullcontext()
                return self._run_parallel_step(name, module, step_context, step_args, step_kwargs, call, accumulate)

            cp.check_positions(module, batch, run, sequence_multiple=parallel.dims.tp if self.config.sequence_parallel else 1)
        args, kwargs = cp.split_step_inputs(module, args, kwargs)
        mode = cp.mode()
        with mode:
            output = self._run_parallel_step(name, module, context, args, kwargs, call, accumulate)
        cp.check_attention_reached(mode)
        return cp.gather_output(output) if name == "predict_step" else output

    def _run_parallel_step(
        self, name: str, module: nn.Module, context: Any, args: tuple, kwargs: dict, call: Callable[..., Any],
        accumulate: Optional[int],
    ) -> Any:
        parallel = self.parallel_model
        if parallel.pipeline is not None:
            with context:  # the runner enters the tensor-parallel contexts around its stages itself
                # Forward and backward of every microbatch for a training step (gradients set aside until `backward`).
                return parallel.pipeline.run(
                    name, module, args[0] if args else kwargs["batch"], loss_scale=self.precision.loss_scale,
                    gradient_sync=parallel.data_parallel, accumulate=accumulate,
                )
        with context, self.step_context():
            output = call(*args, **kwargs)
        return plain_step_output(output, gather=name == "predict_step")

    def step_context(self) -> contextlib.AbstractContextManager[None]:
        """Tensor parallel: cross-entropy on vocab-sharded logits runs loss-parallel."""
        return loss_parallel_step(self.parallel_model.loss_parallel)

    def observe_loss(self, output: Any) -> None:
        """Device-side notes of a non-finite local loss (no sync, no collective); under pp the loss is the
        last stage's, shared, so only that rank's counts."""
        pipeline = self.parallel_model.pipeline
        self.run_guard.observe_loss(output, local=pipeline is None or pipeline.has_last)

    def accumulation_no_sync(self) -> contextlib.AbstractContextManager[None]:
        """The first A-1 micro-steps follow data parallelism's accumulation policy (``zero_accumulation``)."""
        return self.parallel_model.data_parallel.accumulation_no_sync()

    # ------------------------------------------------------------------ backward and the optimizer step
    def before_backward(self, accumulate: int) -> None:
        """Before a backward: gradients shown since the last step are settled (DDP: until ``zero_grad``), and
        MoE layers scale the aux-loss gradient they feed in backward as the loss is scaled (times the 16-mixed
        loss scale, over ``accumulate`` micro-steps; under pp the runner sets it before its schedule)."""
        parallel = self.parallel_model
        self.run_guard.before_backward()
        parallel.data_parallel.before_backward()
        if parallel.moe_layers and parallel.pipeline is None and self.module is not None:
            scale = aux_loss_grad_scale(loss_scale=self.precision.loss_scale, accumulate=accumulate)
            set_aux_loss_grad_scale(self.module, scale)

    def backward(self, loss: Tensor, run_backward: Callable[[Tensor], Any], *, observe: bool = False) -> Any:
        """The backward of ``loss``: under pp the schedule ran it inside :meth:`step`, so its gradients join
        ``.grad`` and sync over dp (skipped inside ``accumulation_no_sync``); else ``run_backward(loss)`` (the
        framework's backward) under tensor parallelism's loss-parallel kernels. ``observe``: note the loss first."""
        self.run_guard.progress("backward and gradient sync")
        parallel = self.parallel_model
        if parallel.pipeline is not None:
            parallel.pipeline.finish_backward(parallel.data_parallel)
            return None
        if observe:
            self.observe_loss(loss)
        with loss_parallel_backward(parallel.loss_parallel):  # DTensor custom ops: backward needs them too
            return run_backward(loss)

    def finalize_gradients(self) -> None:
        """Finish any gradient communication still pending (before clipping or unscaling)."""
        self.parallel_model.data_parallel.flush()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, check_gradients: bool) -> None:
        """The gradients are final (the precision calls this, on every rank): one all-reduce agrees on non-finite
        values and signals (``reliability/step_guard``); an optimizer step with unchecked gradients (fp16 loss
        scaling) still counts as a step for the signal."""
        self.run_guard.check_step(self.precision.main_params(optimizer) if check_gradients else ())

    def optimizer_step(self, run: Callable[[], Any]) -> Any:
        """Around the framework's optimizer step (``run()``); a recompile storm warns once after it (``compile=True``)."""
        self.run_guard.progress("optimizer step")
        output = run()
        if self.run_guard.compile_watch is not None:
            self.run_guard.compile_watch.check()  # names dynamo's reasons
        return output

    def end_step(self, save: Optional[Callable[[], Optional[str]]] = None) -> None:
        """The boundary after a step, on every rank: a loss noted since the last check is checked (micro-steps,
        manual optimization); after an agreed SIGTERM every rank stops here, ``save``-ing the preemption
        checkpoint first (without ``save`` under ``on_sigterm="checkpoint"`` the loop saves: :attr:`preempted`).
        A failed background write (``async_save``) is raised here, on every rank."""
        try:
            self.run_guard.end_step(save)
        except BaseException:  # e.g. Preempted under Fabric (no on_exception): the save in flight ends first
            self.checkpoints.settle_save(quiet=True)
            raise

    def end_training(self) -> None:
        """The last step's agreement is read (a step late), the save in flight is in place (or its error raised); the
        integrity check runs unless it did at this step."""
        self.run_guard.settle()
        self.checkpoints.settle_save()
        if self.run_guard.integrity_due(final=True):
            self.check_integrity()

    def check_integrity(self, step: Optional[int] = None, module: Optional[nn.Module] = None) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; ``docs/reliability.md``)."""
        return self.run_guard.check_integrity(self.parallel_model, module or self.module, self.optimizers, self.device, step)

    # ------------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        self.checkpoints.settle_save(quiet=True)  # the save in flight ends (in place, or removed) before the run
        self.run_guard.on_exception(exception)

    def teardown(self) -> None:
        self.run_guard.teardown()
        self.checkpoints.teardown()



__all__ = ["ParaEngine"]
