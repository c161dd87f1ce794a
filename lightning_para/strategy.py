"""``ParaStrategy``: Lightning glue around one device mesh and :func:`~lightning_para.parallelize`.

It does only what Lightning needs from a strategy, and delegates each piece to the
framework-neutral engine (:class:`lightning_para.core.ParaEngine`, shared with Fabric's
``lightning_para.fabric.ParaStrategy``): validate the layout before any process starts work,
build the mesh, let ``configure_model`` see it, parallelize the model, route steps (through the
pipeline schedule or FSDP2's root), skip gradient sync while accumulating, and save/load sharded
checkpoints. Each dimension lives in its own module under :mod:`lightning_para.parallel`.
Its arguments, and the views it shares with Fabric's front end, are
:class:`~lightning_para.core.front_end.ParaFrontEnd`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

import lightning.pytorch as pl
from lightning_para.core.front_end import ParaFrontEnd
from lightning_para.checkpoint.fabric_format import for_the_trainer
from lightning_para.observe.panels import straggler_metrics
from lightning_para.observe.publish import log_scalars
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallel.data import MemoryBreakdown, convert_sync_batchnorm
from lightning_para.auto_layout import LayoutChoice, auto_configure
from lightning_para.precision import ParaPrecision, as_para_precision
from lightning_para.reliability.preemption import StepBoundary, save_hpc_checkpoint


class ParaStrategy(ParaFrontEnd, ParallelStrategy):
    """Data (ZeRO 0-3, HSDP), tensor/sequence, pipeline, expert and context parallelism, compile and fp8
    on one DeviceMesh, for Lightning's Trainer.

    The arguments (and the ``Args`` below) are those of :class:`~lightning_para.core.front_end.ParaFrontEnd`,
    shared with Fabric's :class:`lightning_para.fabric.ParaStrategy`; the layout options are declared once in
    :mod:`lightning_para.spec.options`.
    """

    launcher_class = _SubprocessScriptLauncher

    def _init_strategy(
        self, *, precision: Optional[str], accelerator: Any, parallel_devices: Optional[list[torch.device]],
        cluster_environment: Optional[ClusterEnvironment], checkpoint_io: Optional[CheckpointIO],
        precision_plugin: Optional[Precision],
    ) -> None:
        ParallelStrategy.__init__(
            self, accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=ParaPrecision(precision) if precision is not None else as_para_precision(precision_plugin),
        )
        self.num_nodes = 1
        self.layout_choice: Optional[LayoutChoice] = None  # what layout="auto" chose

    # ------------------------------------------------------------------ Lightning plumbing
    # Lightning's ModelParallelStrategy does exactly what this strategy needs for these, so they
    # are its methods, reused as they are. Not a subclass: Lightning's accelerator connector
    # limits `isinstance(strategy, ModelParallelStrategy)` to its own precisions (no 16-mixed).
    root_device = ModelParallelStrategy.root_device
    num_processes = ModelParallelStrategy.num_processes
    restore_checkpoint_after_setup = ModelParallelStrategy.restore_checkpoint_after_setup
    lightning_restore_optimizer = ModelParallelStrategy.lightning_restore_optimizer
    model_to_device = ModelParallelStrategy.model_to_device
    # Parameters are materialized (and reset deterministically) in `setup`, before sharding.
    tensor_init_context = ModelParallelStrategy.tensor_init_context
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    reduce = ModelParallelStrategy.reduce
    _determine_device_ids = ModelParallelStrategy._determine_device_ids
    set_world_ranks = ModelParallelStrategy.set_world_ranks

    @property
    def precision_plugin(self) -> ParaPrecision:  # type: ignore[override]
        return self._precision_plugin if self._precision_plugin is not None else ParaPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning builds a plugin from `Trainer(precision=...)`; speak its mode in our terms.
        self._precision_plugin = as_para_precision(plugin)

    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io
        self.core.checkpoints.use_checkpoint_io(io)  # saves go through DCP; Lightning's AsyncCheckpointIO: async_save

    @property
    def compile_watch(self) -> Optional[CompileWatch]:
        """``compile=True``: the compiled block graphs and their recompilations."""
        return self.core.compile_watch

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning to decide whether to insert a DistributedSampler.
        return True

    def _step_number(self) -> int:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else -1

    def setup_environment(self) -> None:
        self._resolve_dims()  # raises before any collective
        self._share_cores()
        super().setup_environment()
        self._setup_distributed()
        if self.config.layout == "auto":  # the planner decides on rank 0 and broadcasts, before the mesh exists
            self._plan_layout()
        dims = self.core.setup_environment(self.root_device.type, self.world_size, self.broadcast)
        assert self.lightning_module is not None
        # What `LightningModule.device_mesh` returns inside `configure_model` (Lightning reads this attribute).
        self.lightning_module._device_mesh = dims.mesh

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.core.on_exception(exception)

    def teardown(self) -> None:
        self.core.teardown()
        # Unlike the base class, leave the (sharded) model where it is: moving DTensors to CPU
        # would detach them from their mesh.
        ModelParallelStrategy.teardown(self)

    def _plan_layout(self) -> None:
        module = self.lightning_module
        assert module is not None
        trainer = module._trainer  # private: see docs/architecture.md
        self.config, self.layout_choice = auto_configure(
            self.config, module, getattr(trainer, "datamodule", None),
            world_size=self.num_nodes * self.num_processes, processes_per_node=self.num_processes,
            device=self.root_device, precision=self.precision_plugin.precision,
            accumulation=trainer.accumulate_grad_batches if trainer is not None else 1, trainer=trainer,
        )
        rank_zero_info(self.layout_choice.report)
        self._resolve_dims()

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        # Materialised (or, with pretrained weights pending, loaded after parallelizing: each rank its own
        # slices); BatchNorms converted before sharding. A module set up before keeps its layout (and its
        # converted BatchNorms; a clear error if FSDP2 holds plain ones).
        self.core.setup_module(module, self.root_device, self.precision_plugin, before=self._sync_batchnorm)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.core.checkpoints.begin_run(trainer)  # the checkpoint folders held from the start, leftovers swept
            self.setup_optimizers(trainer)
            self.core.setup_optimizers([o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers])
            # Wrap again: a LightningOptimizer's class is made from its optimizer's class, which ZeRO-1/2 just
            # subclassed (`zero_grad` also drops the gradients shown in `p.grad`).
            self.optimizers = list(self.core.optimizers)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        # Re-created for every fit: ZeRO edits the optimizer's param groups in place.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _sync_batchnorm(self, module: nn.Module) -> None:
        """``Trainer(sync_batchnorm=True)``: BatchNorm statistics over the dp group, on any device
        (:mod:`lightning_para.parallel.data.sync_batchnorm`). Layers stay converted after ``fit``."""
        layer_sync = self._layer_sync
        if layer_sync is None:
            return
        if isinstance(layer_sync, TorchSyncBatchNorm):
            convert_sync_batchnorm(module, self.parallel_dims.group("dp"), self.root_device.type)
        else:
            layer_sync.apply(module)  # the user's own LayerSync plugin decides (in place)

    # ------------------------------------------------------------------ steps
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if not any(isinstance(c, StepBoundary) for c in trainer.callbacks):  # after ModelCheckpoint
            trainer.callbacks.append(StepBoundary(lambda: self.core.end_step(self._save_preemption_checkpoint)))
        self.core.start_training()  # after Lightning's SIGTERM handler (which runs a collective)
        if self.core.straggler is not None:  # rank 0 logs every rank's figure: a per-rank TensorBoard panel
            self.core.straggler.publish = lambda figures, named: log_scalars(trainer, straggler_metrics(figures, named))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.core.begin_step("train batch", f"train batch {batch_idx} loaded")

    def _run_step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        through_root = self.core.forward_through_root(module)

        def call(*step_args: Any, **step_kwargs: Any) -> Any:
            if through_root:
                # Through the FSDP2 root's __call__, so its root pre/post-forward hooks run.
                return self._forward_redirection(module, module, name, *step_args, **step_kwargs)
            return getattr(module, name)(*step_args, **step_kwargs)

        precision = self.precision_plugin
        # cp's first-step check runs the step twice more without gradients: not a manual-optimization
        # training_step (it steps the optimizer itself; a validation step can check).
        manual = name == "training_step" and not module.automatic_optimization
        return self.core.step(
            name, module, args, kwargs, context, call=call, check_cp=not manual,
            check_contexts={
                "training_step": precision.train_step_context, "validation_step": precision.val_step_context,
                "test_step": precision.test_step_context, "predict_step": precision.predict_step_context,
            },
        )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        module = self.lightning_module
        # MoE aux-loss gradients are scaled as Lightning scales the loss: over the accumulation.
        self.core.before_backward(module.trainer.accumulate_grad_batches if module.automatic_optimization else 1)

    def backward(self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's `Strategy.backward`, with the engine's backward of the loss in the middle: under pp the
        # schedule ran it inside `training_step` and its gradients join `.grad` there (after Lightning's
        # zero_grad); the precision hooks still run, so `on_before/after_backward` callbacks fire.
        module, precision = self.lightning_module, self.precision_plugin
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, module)
        self.core.backward(closure_loss, lambda loss: precision.backward(loss, module, optimizer, *args, **kwargs))
        closure_loss = precision.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self.core.optimizer_step(lambda: super(ParaStrategy, self).optimizer_step(optimizer, closure, model, **kwargs))

    def finalize_gradients(self) -> None:
        """Finish any gradient communication still pending (before clipping or unscaling)."""
        self.core.finalize_gradients()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the first A-1 micro-steps follow data parallelism's accumulation
        policy (``zero_accumulation``; :meth:`DataParallel.accumulation_no_sync`)."""
        with self.core.accumulation_no_sync():
            yield

    def _save_preemption_checkpoint(self) -> str:
        """Always sharded, whatever ``save_distributed_checkpoint`` says: a sharded checkpoint resumes into
        any layout, and a pipeline run cannot resume from one file."""
        sharded, self.save_distributed_checkpoint = self.save_distributed_checkpoint, True
        try:
            return save_hpc_checkpoint(self.lightning_module.trainer)
        finally:
            self.save_distributed_checkpoint = sharded

    def on_train_end(self) -> None:
        super().on_train_end()
        self.core.end_training()  # the last step's finite check (read a step late), the last integrity check

    def check_integrity(self, step: Optional[int] = None) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; see ``docs/reliability.md``).
        Returns the findings; raises ``IntegrityError`` on one unless ``integrity_action="warn"``."""
        return self.core.check_integrity(step)

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(self) -> MemoryBreakdown:
        """This rank's bytes for ``params``, ``grads`` and ``optimizer`` (fp32 masters included),
        with ``expected`` bytes from the ZeRO formulas for the active stage (see ``docs/``), as a
        :class:`~lightning_para.parallel.data.MemoryBreakdown` (``.as_dict()`` for plain values).

        The formulas' ``N`` is the number of ranks that *shard* the state: ``dp_shard x cp``
        (``edp x cp`` for experts); hybrid sharding's ``dp_replicate`` replicas hold copies."""
        return self.core.memory_breakdown(self.lightning_module)

    # ------------------------------------------------------------------ checkpoints
    def _sharded_parameters(self) -> None:
        """FSDP2 units a forward-only pass left gathered are resharded, so parameters are the sharded
        ones the optimizer and checkpoints name (e.g. ModelCheckpoint saving after validation)."""
        self.core.checkpoints.reshard(self.lightning_module)

    def on_validation_end(self) -> None:
        self._sharded_parameters()  # and the gathered head's memory is freed until the next forward

    def on_test_end(self) -> None:
        self._sharded_parameters()

    def on_predict_end(self) -> None:
        self._sharded_parameters()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded (DTensors) on every rank; with ``save_distributed_checkpoint=False``, the full state as
        plain tensors on rank 0 and ``{}`` elsewhere (Lightning's contract; collective)."""
        return self.core.checkpoints.model_state(self.lightning_module, full=not self.save_distributed_checkpoint)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """By parameter name with global DTensors; with ``save_distributed_checkpoint=False``, PyTorch's own
        format with full plain tensors on rank 0 and ``{}`` elsewhere (collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        full = not self.save_distributed_checkpoint
        return self.core.checkpoints.optimizer_state(self.lightning_module, optimizer, full=full)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by `load_checkpoint`

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by `load_checkpoint`

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ParaStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP.")
        self.core.checkpoints.save(
            filepath, checkpoint, sharded=self.save_distributed_checkpoint, module=self.lightning_module,
            broadcast=self.broadcast, background=self.core.checkpoints.run.active,  # async_save: inside `fit` only
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        self.core.checkpoints.remove(filepath, rank0=self.is_global_zero)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load model and optimizer state in place (sharded DCP folder or one full file) and
        return the rest of Lightning's checkpoint (loops, callbacks, schedulers)."""
        # "hpc"/"last" (Lightning's lookups) become this run's newest complete checkpoint, agreed from rank 0.
        trainer = getattr(self.lightning_module, "_trainer", None)
        path = self.core.checkpoints.resume_path(checkpoint_path, trainer)
        if trainer is not None and str(path) != str(checkpoint_path):  # `trainer.ckpt_path`, "Restored all states from"
            connector = trainer._checkpoint_connector  # private: see docs/architecture.md
            connector._ckpt_path = str(path)
        # A Fabric checkpoint (lightning_para.fabric) loads too: its model and optimizers, the loops start afresh.
        return for_the_trainer(self.core.checkpoints.load(path, self.lightning_module, self.core.optimizers))
