"""Fabric's ``ParaStrategy``: the same layouts as the Trainer's, for a loop the user writes.

``L.Fabric(strategy=ParaStrategy(tp=2, zero=3))``: the arguments, their validation and errors are the Trainer's
(:class:`~lightning_para.core.front_end.ParaFrontEnd`), and every piece of work is the framework-neutral
engine's (:class:`lightning_para.core.ParaEngine`): this module translates Fabric's strategy protocol
(``setup_environment``, ``setup_module``, ``backward``, ``no_backward_sync``, ``clip_gradients``,
``optimizer.step()``, ``save``/``load``) into the engine's lifecycle. pp: :meth:`ParaStrategy.pipeline_step` runs
the schedule over a batch; cp: :meth:`ParaStrategy.run_step` runs the loop's forward and loss on this rank's
sequence chunks. ``docs/fabric.md`` shows a loop and what each call does.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_para.checkpoint.run import RUN_KEY
from lightning_para.config import ParallelConfig
from lightning_para.core import ParaEngine
from lightning_para.core.front_end import ParaFrontEnd
from lightning_para.checkpoint.fabric_format import check_load_state, check_save_arguments, from_full_file, restore_other, split_state, to_fabric_file, to_trainer_format
from lightning_para.fabric.precision import FabricParaPrecision, as_fabric_para_precision
from lightning_para.fabric.steps import check_accumulate, check_run_step, outside_run_step_error, pipeline_forward_error, schedule_only
from lightning_para.fabric.wrappers import repoint, unwrap
from lightning_para.parallel.data import MemoryBreakdown


_NO_CHECKPOINT_IO = (
    "ParaStrategy does not support setting a `CheckpointIO` plugin: it writes sharded checkpoints with DCP,"
    " atomically and with checksums (`save_distributed_checkpoint=False` for one file; `async_save=True` writes in the"
    " background, what Lightning's `AsyncCheckpointIO` does under the Trainer). Remove the plugin."
)


class ParaStrategy(ParaFrontEnd, ParallelStrategy):
    """Data (ZeRO 0-3, HSDP), tensor/sequence, pipeline and expert parallelism, compile and fp8 under Fabric.

    Takes the arguments of the Trainer's :class:`lightning_para.ParaStrategy` (one argument list,
    :class:`~lightning_para.core.front_end.ParaFrontEnd`'s), with these differences (``docs/fabric.md``):

    * ``loss_parallel="auto"`` is ``False``: the loss is computed in the user's loop, outside
      the strategy, so the head's logits come out whole. With ``True`` they are vocab-sharded
      DTensors and the loss must be computed inside ``with strategy.loss_parallel():``.
    * ``layout="auto"`` (planned from the Trainer's datamodule) raises a ``ValueError``.
    * ``cp > 1``: the loop runs its forward and loss through :meth:`ParaStrategy.run_step`, which
      gives the model this rank's sequence chunks (a Fabric loop has no ``training_step`` to wrap).
    * ``on_sigterm``: ``"auto"`` is ``None``. The loop owns its state, so with ``"checkpoint"`` every rank
      sees :attr:`ParaStrategy.preempted` turn true after the same ``optimizer.step()``, for the loop to
      ``fabric.save`` and exit; ``"exit"`` raises ``Preempted`` (exit code 143) there. ``check_finite`` (every loss passed to
      ``fabric.backward``, every gradient before the step), ``watchdog_timeout`` (time in the loop's own code
      between calls is alive, not stuck) and ``integrity_check_every_n_steps`` (after every N-th ``optimizer.step()``)
      work as there. ``run_id`` is
      recorded in every checkpoint as there; Fabric loads the path it is given (no ``"hpc"``/``"last"`` lookup).
    """

    front_end = "Fabric"
    launcher_class = _SubprocessScriptLauncher
    auto_loss_parallel = False
    auto_on_sigterm = None

    def _check_front_end(self, config: ParallelConfig, on_sigterm: Optional[str]) -> None:
        if config.layout == "auto":
            raise ValueError(
                "ParaStrategy(layout='auto') plans from the Trainer's datamodule and is not available under Fabric."
                " Pass the degrees (dp=, tp=, pp=, zero=...); `lightning-para plan` prints a layout for your model."
            )

    def _init_strategy(
        self, *, precision: Optional[str], accelerator: Any, parallel_devices: Optional[list[torch.device]],
        cluster_environment: Optional[ClusterEnvironment], checkpoint_io: Optional[CheckpointIO],
        precision_plugin: Optional[FabricPrecision],
    ) -> None:
        if checkpoint_io is not None:
            raise NotImplementedError(_NO_CHECKPOINT_IO)
        ParallelStrategy.__init__(
            self, accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            precision=FabricParaPrecision(precision) if precision is not None else as_fabric_para_precision(precision_plugin),
        )
        self._num_nodes = 1
        self._backward_sync_control = _ParaBackwardSyncControl(self.core)
        self._step = 0  # optimizer steps taken (the step guard's and the watchdog's step number)
        self._in_step = False  # inside `run_step` (under cp the model is called only there)

    # ------------------------------------------------------------------ Fabric plumbing
    # Lightning's Fabric ModelParallelStrategy does exactly what this strategy needs for these (device
    # placement, ranks, the process group, collectives), so they are its methods, reused as they are.
    root_device = FabricModelParallel.root_device
    num_nodes = FabricModelParallel.num_nodes
    num_processes = FabricModelParallel.num_processes
    process_group_backend = FabricModelParallel.process_group_backend
    all_reduce = FabricModelParallel.all_reduce
    barrier = FabricModelParallel.barrier
    broadcast = FabricModelParallel.broadcast
    _setup_distributed = FabricModelParallel._setup_distributed
    _get_process_group_backend = FabricModelParallel._get_process_group_backend
    _set_world_ranks = FabricModelParallel._set_world_ranks

    @property
    def precision(self) -> FabricParaPrecision:  # type: ignore[override]
        return self._precision if self._precision is not None else FabricParaPrecision()

    @precision.setter
    def precision(self, plugin: Optional[FabricPrecision]) -> None:
        # Fabric builds a plugin from `Fabric(precision=...)`; speak its mode in our terms.
        self._precision = as_fabric_para_precision(plugin)

    @property
    def checkpoint_io(self) -> CheckpointIO:  # type: ignore[override]
        return super().checkpoint_io  # never used for saving (teardown closes it)

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        if io is not None:
            raise NotImplementedError(_NO_CHECKPOINT_IO)

    def _step_number(self) -> int:
        return self._step

    def setup_environment(self) -> None:
        self._resolve_dims()  # raises before any collective
        self._share_cores()
        super().setup_environment()
        self._setup_distributed()
        self.core.setup_environment(self.root_device.type, self.world_size, self.broadcast)

    # ------------------------------------------------------------------ model and optimizers
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """``empty_init=True``: parameters on the meta device, materialised (and reset, seeded) in ``setup``,
        before they are sharded; no rank ever holds the whole initialised model."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        pass  # `setup_module` materialises and places each rank's shards

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.core.dims is None or self.core.dims.mesh is None:  # a Fabric marked launched without `launch()`
            self.setup_environment()
        self.core.setup_module(module, self.root_device, self.precision)
        if self.core.has_pipeline:
            module.register_forward_pre_hook(pipeline_forward_error)
        else:  # the watchdog hears of each forward (compiling ones exempt: the first of each kind may take minutes)
            module.register_forward_pre_hook(self._report_forward)
            module.register_forward_hook(lambda *_: self.core.returned("forward"))
        self.core.start_training()  # on_sigterm: the signal is only recorded, agreed at a step
        self.barrier()
        self.core.returned("fabric.setup")
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Hand ``optimizer`` (made from the set-up model's parameters) to data parallelism."""
        self.core.setup_optimizers([optimizer], append=True)
        return optimizer

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """``fabric.setup(model, optimizer)``: parallelizing replaces parameters (DTensors, FSDP2 shards), so
        each optimizer made before is re-pointed at the new parameters of the same names."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        current = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            repoint(optimizer, names, current, pipeline=self.core.has_pipeline)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    # ------------------------------------------------------------------ steps
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, accumulate: int = 1, **kwargs: Any) -> None:
        """``fabric.backward(loss)``. ``accumulate``: the micro-steps per optimizer step (``fabric.backward(loss / A,
        accumulate=A)``), read by MoE layers, which feed their aux-loss gradient themselves and scale it as the
        loss is scaled; without MoE layers it changes nothing. Under pp :meth:`pipeline_step` ran forward and
        backward of every microbatch: its gradients join ``.grad`` and sync here."""
        check_accumulate("backward", accumulate)
        self.core.before_backward(accumulate)
        # The loss is noted on the device (a non-finite local loss; no sync).
        self.core.backward(tensor, lambda loss: self.precision.backward(loss, module, *args, **kwargs), observe=True)
        self.core.returned("fabric.backward")

    def pipeline_step(self, module: nn.Module, batch: Any, accumulate: int = 1) -> Tensor:
        """Run the pipeline schedule (``pp > 1``) over ``batch``: forward and backward of every microbatch of
        this rank's stages. Returns the batch's mean loss (the last stage's, on every rank). Then call
        ``fabric.backward(loss)``, which adds the gradients to ``.grad`` and syncs them over dp (skipped inside
        ``fabric.no_backward_sync``); ``accumulate``: micro-steps before the optimizer step (each adds
        ``1/accumulate`` of its gradients; do not divide the loss yourself). The model states the split
        with ``configure_pipeline()`` (``docs/pipeline_parallel.md``)."""
        check_accumulate("pipeline_step", accumulate)
        return self._schedule("training_step", module, batch, accumulate)

    def pipeline_eval_step(self, module: nn.Module, batch: Any) -> Tensor:
        """The pipeline's forward-only loss over ``batch`` (``pp > 1``), on every rank."""
        with torch.no_grad():
            return self._schedule("validation_step", module, batch, None)

    def _schedule(self, name: str, module: nn.Module, batch: Any, accumulate: Optional[int]) -> Any:
        # Through the core's step routing, so that under cp each stage sees this rank's sequence chunks.
        output = self.core.step(
            name, unwrap(module), (self.batch_to_device(batch),), {}, self.precision.forward_context(),
            call=schedule_only, accumulate=accumulate,
        )
        self.core.returned("the pipeline schedule")
        return output

    def run_step(self, module: nn.Module, step: Callable[[nn.Module, Any], Any], batch: Any) -> Any:
        """``step(module, local_batch)`` on this rank's share of ``batch``; returns what it returns.

        ``cp=1``: ``step(module, batch)``. ``cp > 1``: every tensor of ``batch`` with two or more dims is cut
        along dim 1 (pass inputs and targets already shifted), SDPA inside ``step`` runs across the cp group,
        ``F.cross_entropy`` returns the whole sequence's loss on every cp rank (gradients exact after the dp x cp
        average), and the first call checks positions (``cp_check``). Under pp use :meth:`pipeline_step`.
        ``docs/fabric.md`` ("Context parallelism") has the contract.
        """
        check_run_step(step, pipeline=self.core.has_pipeline)
        batch = self.batch_to_device(batch)
        name = "training_step" if torch.is_grad_enabled() else "validation_step"
        self._in_step = True
        try:
            return self.core.step(
                name, unwrap(module), (batch,), {}, contextlib.nullcontext(), call=lambda local: step(module, local),
                observe=False,  # `fabric.backward` notes the loss
            )
        finally:
            self._in_step = False
            self.core.returned("run_step")

    @contextlib.contextmanager
    def loss_parallel(self) -> Any:
        """With ``loss_parallel=True``: compute the cross-entropy of the vocab-sharded logits inside this context
        (forward) and call ``fabric.backward`` as usual."""
        with self.core.step_context():
            yield

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = self.core.optimizer_step(lambda: self.precision.optimizer_step(unwrap(optimizer), **kwargs))
        self._step += 1
        self.core.end_step()  # on_sigterm="exit": every rank stops here; "checkpoint": `preempted` turns true
        self.core.begin_step()  # `integrity_check_every_n_steps`, after the step's ZeRO gather
        self.core.returned("optimizer.step()")
        return output

    @property
    def preempted(self) -> bool:
        """True on every rank once all ranks agreed on a SIGTERM (``on_sigterm="checkpoint"``), from the same
        ``optimizer.step()`` on: save with ``fabric.save`` and exit (code 143 tells schedulers to restart). Read
        from the step guard's agreement: no collective or device sync of its own."""
        return self.core.preempted

    def _report_forward(self, module: nn.Module, args: Any) -> None:
        if not self._in_step and self.core.parallel_dims.cp > 1:
            raise RuntimeError(outside_run_step_error(self.core.parallel_dims.cp))
        self.core.progress("forward" if torch.is_grad_enabled() else "forward without gradients")

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip to the true global norm over every shard (dp, tp, pp, ep); returns the norm before clipping."""
        optimizer = unwrap(optimizer)
        self.precision.unscale_gradients(optimizer)
        total = self.precision.clip_grad_by_norm(optimizer, max_norm, norm_type=float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite, so they cannot be clipped."
                " Pass `error_if_nonfinite=False` to `fabric.clip_gradients` to clip anyway."
            )
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        optimizer = unwrap(optimizer)
        self.precision.unscale_gradients(optimizer)
        self.precision.clip_grad_by_value(optimizer, clip_val)

    def memory_breakdown(self, module: nn.Module) -> MemoryBreakdown:
        """This rank's parameter, gradient and optimizer bytes against the ZeRO formulas (``docs/data_parallel.md``)."""
        return self.core.memory_breakdown(unwrap(module))

    def check_integrity(self, module: nn.Module) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; ``docs/reliability.md``)."""
        return self.core.check_integrity(module=unwrap(module))

    # ------------------------------------------------------------------ checkpoints
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        raise NotImplementedError(
            "ParaStrategy loads checkpoints in place: use `fabric.load(path, {'model': model, ...})` or"
            " `fabric.load_raw(path, model)`."
        )

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Sharded (DCP folder) or, with ``save_distributed_checkpoint=False``, one full file; atomic and
        checksummed; readable by the Trainer's ParaStrategy and by this one, in any layout (collective)."""
        check_save_arguments(storage_options, filter, sharded=self.save_distributed_checkpoint)
        parts = split_state(state, unwrap, "save_checkpoint")
        full, checkpoints = not self.save_distributed_checkpoint, self.core.checkpoints
        model_state = checkpoints.model_state(parts.module, full=full)
        optimizer_states = [checkpoints.optimizer_state(parts.module, o, full=full) for o in parts.optimizers]
        checkpoint = to_trainer_format(parts, model_state, optimizer_states, filter)
        if full:  # rank 0 holds the full states: Fabric's single-file layout
            checkpoint = to_fabric_file(checkpoint) if self.is_global_zero else {}
        checkpoints.save(path, checkpoint, sharded=not full, module=parts.module, broadcast=self.broadcast)
        self.core.returned("fabric.save")

    def load_checkpoint(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None, strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Load in place: ``state`` a dict with one model (and its optimizers, other entries), or one model
        (``fabric.load_raw``: a sharded folder, a full checkpoint file or a plain ``state_dict`` file)."""
        state = unwrap(state) if not isinstance(state, dict) else state
        check_load_state(state)
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            self._load_raw(path, state, strict)
            self.core.returned("fabric.load_raw")
            return {}
        parts = split_state(state, unwrap, "load_checkpoint")
        loaded = dict(self.core.checkpoints.load(path, parts.module, parts.optimizers, strict=strict, convert=from_full_file(parts)))
        self.core.returned("fabric.load")
        loaded.pop(RUN_KEY, None)  # which run saved it (checkpoint/run.py): the checkpoint's record, not the user's state
        return restore_other(state, parts, loaded, strict)

    def _load_raw(self, path: Path, module: nn.Module, strict: bool) -> None:
        """``fabric.load_raw``: a sharded folder, a full checkpoint (Fabric's or the Trainer's), or a plain
        ``model.state_dict()`` file, into the parallel model."""
        parts = split_state({"model": module}, unwrap, "load_checkpoint")
        self.core.checkpoints.load(path, module, [], strict=strict, convert=from_full_file(parts, raw_model_state=True))

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        self.core.teardown()
        # Unlike the base class, leave the (sharded) model where it is: moving DTensors would detach them.
        super().teardown()


class _ParaBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: data parallelism's accumulation policy (``zero_accumulation``)."""

    def __init__(self, core: ParaEngine) -> None:
        self._core = core

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self._core.accumulation_no_sync() if enabled else contextlib.nullcontext()


__all__ = ["ParaStrategy"]
