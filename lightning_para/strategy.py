"""``ParaStrategy``: Lightning glue around one device mesh and :func:`~lightning_para.parallelize`.

It does only what Lightning needs from a strategy, and delegates each piece to the
framework-neutral engine (:class:`lightning_para.core.ParaEngine`, shared with Fabric's
``lightning_para.fabric.ParaStrategy``): validate the layout before any process starts work,
build the mesh, let ``configure_model`` see it, parallelize the model, route steps (through the
pipeline schedule or FSDP2's root), skip gradient sync while accumulating, and save/load sharded
checkpoints. Each dimension lives in its own module under :mod:`lightning_para.parallel`.

Why this module is long: it implements Lightning's whole ``Strategy`` interface (some forty
hooks and properties); each is a few lines that delegate to a dimension's package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
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
from lightning_para import checkpoint as ckpt
from lightning_para.config import ParallelConfig
from lightning_para.core import ParaEngine
from lightning_para.fabric.checkpoint import for_the_trainer
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallel.data import MemoryBreakdown, convert_sync_batchnorm
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.parallelize import ParallelModel
from lightning_para.auto_layout import LayoutChoice, auto_configure
from lightning_para.precision import ParaPrecision, as_para_precision
from lightning_para.reliability.preemption import save_hpc_checkpoint
from lightning_para.threads import apply_thread_budget, available_cores


class ParaStrategy(ParallelStrategy):
    """Data (ZeRO 0-3), tensor/sequence, pipeline and expert parallelism on one DeviceMesh.

    Args:
        dp: data-parallel degree; ``"auto"`` takes what is left of the world size.
        tp: tensor-parallel degree (innermost mesh dim: keep it within a node); ``"auto"`` as in
            Lightning's ``ModelParallelStrategy``: the devices of one node (what dp leaves if dp is set).
        pp: pipeline-parallel degree (outermost mesh dim).
        ep: expert-parallel degree; must divide ``dp`` (experts are sharded inside dp).
        zero: ZeRO stage 0, 1, 2 or 3 over ``dp`` (over ``dp_shard x cp`` in general).
        cp: context-parallel degree: each sequence is split over ``cp`` ranks (load-balanced
            head-tail chunks) and attention runs across them (``docs/context_parallel.md``).
        cp_method: ``"ring"`` (K/V blocks passed peer-to-peer) or ``"all_to_all"`` (DeepSpeed-Ulysses).
        cp_load_balance: head-tail chunks (``2 * cp`` must divide the sequence); ``False``:
            contiguous slices (``cp`` must divide it; causal attention then costs more on late ranks).
        cp_check: before the first cp step, run a short prefix of the batch on the whole sequence and
            under cp and raise if the attention inputs differ (positions built from the local chunk;
            ``docs/context_parallel.md``). ``False`` skips it.
        dp_replicate, dp_shard: hybrid sharded data parallel, ``dp = dp_replicate x dp_shard``:
            ZeRO state sharded over ``dp_shard`` (within a node), replicated over ``dp_replicate``
            (across nodes); needs ``zero >= 1``. ``dp`` alone means ``dp_shard = dp``.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-true"`` or ``"16-mixed"``; when set
            it overrides ``Trainer(precision=...)`` (which also works).
        sequence_parallel: shard norms/dropout/residuals along the sequence over ``tp``.
        sp_save_input_shard: under sequence parallel, save only the sequence shard of each
            sublayer input for backward and all-gather it again there (Megatron-SP; less memory,
            one more all-gather per sublayer). ``False`` keeps the gathered input instead.
        tp_plan: module-name pattern -> parallel style; overrides the model's declared plan.
        tp_unplanned: ``"error"`` (default) for an ``nn.Linear`` no plan covers, or ``"replicate"``
            to keep such Linears whole on every tp rank.
        loss_parallel: vocab-parallel cross-entropy under ``tp`` (full logits never gathered).
        activation_checkpointing: ``None``, ``"full"``, ``"selective"`` or ``"selective_op"`` (torchtitan's
            per-op policy: every second matmul recomputed) per block; see ``parallel/activation_checkpoint.py``.
        schedule: pipeline schedule (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``, ...).
        microbatches: microbatches per pipeline step (default: ``pp * virtual_stages``, one per stage).
        virtual_stages: stages per pipeline rank for interleaved schedules.
        pipeline_split: explicit layer indices where stages start (instead of balancing).
        pipeline_balance: ``"params"`` (default) or ``"time"`` (measured per layer).
        bucket_size_mb: gradient bucket size for ZeRO 0-2.
        zero_accumulation: ``"no_sync"`` (no communication until the last micro-step),
            ``"reduce_each_step"`` (ZeRO-2/3 keep gradients sharded while accumulating) or
            ``"reduce_each_microbatch"`` (ZeRO-2: also over a pipeline's microbatches, stage by
            stage; ``m`` times the gradient traffic, one stage's whole gradients at most).
        zero3_units: ZeRO-3's FSDP2 units. ``"blocks"`` (the collectives of Lightning's FSDP2 recipe):
            one unit per block, and the embedding, final norm and head as one grouped unit gathered once
            per step. ``"blocks_and_ends"`` (torchtitan's): the embedding and the head get a unit each,
            which holds less memory gathered and costs two more collectives per step. ``"auto"``
            (default): ``"blocks"`` when the parameters outside the blocks are no more than the largest
            block's. The bytes moved are the same (``docs/data_parallel.md``).
        compile: ``torch.compile`` each transformer block after TP/SP, CP and activation
            checkpointing, before data parallelism (``True``: inductor; a dict: ``torch.compile``'s
            keyword arguments, e.g. ``{"backend": "aot_eager"}``). Blocks of one class share one
            graph; a recompile storm warns with dynamo's reasons (``docs/performance.md``).
        fp8: ``"tensorwise"`` or ``"rowwise"``: torchao float8 training of the linears (not the head,
            not widths that are not multiples of 16; ``strategy.parallel_model.float8`` names them);
            ``pip install lightning-para[fp8]``. Emulated without float8 hardware. Under tp, torchao's
            float8 tensor-parallel styles (``"tensorwise"`` only); under ZeRO-3 the weights are
            all-gathered in float8.
        save_distributed_checkpoint: sharded directory (default) or one consolidated file. With
            ``False``, ``lightning_module_state_dict()`` and ``optimizer_state()`` return full plain
            tensors on rank 0 and ``{}`` elsewhere, as Lightning's FSDP/ModelParallel strategies do.
            Either is written atomically (``docs/reliability.md``).
        process_group_backend: override ``"gloo"``/``"nccl"`` chosen from the device.
        timeout: process-group timeout.
        layout: ``"auto"``: at setup the planner (``lightning_para.plan``) picks every degree and
            option left at its default for this model, world size and device memory, logs the
            choice and the runner-up, and uses it; values you set are kept (see ``docs/planner.md``).
        layout_memory_gb: memory per process the planner may fill (default: the device's; on CPU
            the RAM divided among the node's processes).
        integrity_check_every_n_steps: every N optimizer steps, compare checksums of all replicated
            state across its replicas and report non-finite losses/gradients (``None``: off).
        integrity_action: ``"raise"`` (``IntegrityError`` on every rank) or ``"warn"`` on a finding.
        watchdog_timeout: seconds after which a rank that is gone (no heartbeat) or stuck (no progress)
            makes every surviving rank log it and exit with code 75; ``None`` switches it off. Keep it
            below ``timeout`` and above the longest step (``docs/reliability.md``).
        check_finite: stop every rank before the optimizer step when a loss or gradient is not finite,
            naming the step, the rank and (under pp) the stage where it first appeared (``NonFiniteError``);
            ``False`` trains on (``docs/reliability.md``).
        on_sigterm: ``"checkpoint"`` (default): after SIGTERM on any rank, every rank saves
            ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` at the next step boundary and exits with code
            143; ``"exit"``: the same without saving; ``None``: Lightning's own SIGTERM handling.
        run_id: this run's id across restarts, recorded in every checkpoint; ``ckpt_path="hpc"``/``"last"``
            resume the newest complete checkpoint of this run (default: ``LIGHTNING_PARA_RUN_ID``, else the
            scheduler's job id, else the run a resume continues; ``docs/reliability.md``).
    """

    strategy_name = "para"

    def __init__(
        self,
        dp: Union[int, str] = "auto",
        tp: Union[int, str] = 1,
        pp: int = 1,
        ep: int = 1,
        zero: int = 0,
        *,
        cp: int = 1,
        cp_method: str = "ring",
        cp_load_balance: bool = True,
        cp_check: bool = True,
        dp_replicate: Optional[int] = None,
        dp_shard: Optional[int] = None,
        precision: Optional[str] = None,
        sequence_parallel: bool = False,
        sp_save_input_shard: bool = True,
        tp_plan: Optional[Mapping[str, Any]] = None,
        tp_unplanned: str = "error",
        loss_parallel: bool = True,
        activation_checkpointing: Optional[str] = None,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        pipeline_split: Optional[list[int]] = None,
        pipeline_balance: str = "params",
        bucket_size_mb: float = 25.0,
        zero_accumulation: str = "no_sync",
        zero3_units: str = "auto",
        compile: Union[bool, Mapping[str, Any]] = False,
        fp8: Optional[str] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        layout: Optional[str] = None,
        layout_memory_gb: Optional[float] = None,
        integrity_check_every_n_steps: Optional[int] = None,
        integrity_action: str = "raise",
        watchdog_timeout: Optional[float] = 60.0,
        check_finite: bool = True,
        on_sigterm: Optional[str] = "checkpoint",
        run_id: Optional[str] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        config = ParallelConfig(
            dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, sequence_parallel=sequence_parallel,
            sp_save_input_shard=sp_save_input_shard, tp_plan=tp_plan, tp_unplanned=tp_unplanned,
            loss_parallel=loss_parallel, activation_checkpointing=activation_checkpointing, schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages, pipeline_split=pipeline_split,
            pipeline_balance=pipeline_balance, bucket_size_mb=bucket_size_mb, zero_accumulation=zero_accumulation,
            zero3_units=zero3_units,
            cp=cp, cp_method=cp_method, cp_load_balance=cp_load_balance, cp_check=cp_check, dp_replicate=dp_replicate, dp_shard=dp_shard,
            layout=layout, layout_memory_gb=layout_memory_gb, compile=compile, fp8=fp8,
        )
        # The layout, run guard and checkpoint IO; reliability options validated before any process group exists.
        self.core = ParaEngine(
            config, integrity_check_every_n_steps=integrity_check_every_n_steps, integrity_action=integrity_action,
            watchdog_timeout=watchdog_timeout, timeout=timeout, check_finite=check_finite, on_sigterm=on_sigterm,
            run_id=run_id,
        )
        if precision is not None:
            if precision_plugin is not None:
                raise ValueError("Pass either `precision=` or `precision_plugin=` to ParaStrategy, not both.")
            precision_plugin = ParaPrecision(precision)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=as_para_precision(precision_plugin),
        )
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.layout_choice: Optional[LayoutChoice] = None  # what layout="auto" chose (issue 15)

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

    @property
    def parallel_dims(self) -> ParallelDims:
        """Degrees and mesh of this run (available from ``setup_environment`` on)."""
        return self.core.parallel_dims

    @property
    def parallel_model(self) -> ParallelModel:
        """The typed record of what was applied to the model (available from ``setup`` on)."""
        return self.core.parallel_model

    @property
    def config(self) -> ParallelConfig:
        """The layout (``layout="auto"`` replaces it with the planner's choice at setup)."""
        return self.core.config

    @config.setter
    def config(self, config: ParallelConfig) -> None:
        self.core.config = config

    @property
    def compile_watch(self) -> Optional[CompileWatch]:
        """``compile=True``: the compiled block graphs and their recompilations (issue 25)."""
        return self.core.compile_watch

    @property
    def device_mesh(self):
        """The one ``DeviceMesh`` with dims ``("pp", "dp_replicate", "edp", "ep", "cp", "tp")`` and flattened
        ``"dp"``, ``"dp_shard"``, ``"dp_shard_cp"``, ``"edp_cp"`` (see :mod:`lightning_para.mesh`)."""
        return self.parallel_dims.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # One sample stream per dp rank: the tp, cp and pp ranks of a dp coordinate see the same batch
        # (ep ranks are dp ranks, so they get different batches, as expert parallelism expects;
        # cp ranks then take their own chunks of each sequence in the step).
        dims = self.parallel_dims
        return {"num_replicas": dims.dp, "rank": dims.local_rank("dp")}

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning to decide whether to insert a DistributedSampler.
        return True

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Fail in the launching process, before any worker exists, if the degrees cannot fit.
        self._resolve_dims(self.num_nodes * self.num_processes)
        # One process needs no launcher. Lightning's subprocess launcher would also write LOCAL_RANK,
        # NODE_RANK and WORLD_SIZE into this process's environment, and a later multi-device Trainer in
        # the same process (a notebook, `parity.compare`) would then take itself for a launched child
        # and wait for ranks that never start.
        if not self.cluster_environment.creates_processes_externally and self.num_nodes * self.num_processes > 1:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _resolve_dims(self, world_size: int) -> ParallelDims:
        return self.core.resolve_dims(world_size, devices_per_node=self.num_processes or None)

    def setup_environment(self) -> None:
        dims = self._resolve_dims(self.num_nodes * self.num_processes)  # raises before any collective
        threads = apply_thread_budget(self.num_processes)  # ranks of one node share its cores
        if threads is not None:
            rank_zero_info(
                f"lightning-para: {self.num_processes} ranks per node share {available_cores()} CPU cores:"
                f" {threads} intra-op thread(s) per rank. Set OMP_NUM_THREADS or call torch.set_num_threads"
                " to choose otherwise."
            )
        super().setup_environment()
        self._setup_distributed()
        if self.config.layout == "auto":  # the planner decides on rank 0 and broadcasts, before the mesh exists
            dims = self._plan_layout()
        dims = self.core.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        # What `LightningModule.device_mesh` returns inside `configure_model` (Lightning reads this attribute).
        self.lightning_module._device_mesh = dims.mesh
        self._start_watchdog()

    # ------------------------------------------------------------------ watchdog (issue 14)
    def _start_watchdog(self) -> None:
        self.core.start_watchdog(self.world_size, self.broadcast)

    def _report(self, what: str, exempt: bool = False) -> None:
        """Tell the watchdog what this rank does now (two attribute writes: nothing waits)."""
        self.core.report(what, exempt)

    def _compiling(self, phase: str) -> bool:
        """Compiling steps are exempt from the watchdog (:meth:`ParaEngine.compiling`)."""
        return self.core.compiling(phase, self._global_step())

    def _global_step(self) -> int:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else -1

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.core.on_exception(exception)

    def teardown(self) -> None:
        self.core.teardown()
        # Unlike the base class, leave the (sharded) model where it is: moving DTensors to CPU
        # would detach them from their mesh.
        ModelParallelStrategy.teardown(self)

    def _plan_layout(self) -> ParallelDims:
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
        return self._resolve_dims(self.num_nodes * self.num_processes)

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
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        self._report("setup: parallelize the model", exempt=True)
        # Materialised (or, with pretrained weights pending, loaded after parallelizing: each rank its own
        # slices); BatchNorms converted before sharding. A module set up before keeps its layout (and its
        # converted BatchNorms; a clear error if FSDP2 holds plain ones).
        self.core.parallelize(module, self.root_device, precision, before=self._sync_batchnorm)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            ckpt.begin_run(self.core.checkpoint_run, trainer)  # the checkpoint folders held from the start, leftovers swept
            self.setup_optimizers(trainer)
            self._attach_optimizers()
            # Wrap again: a LightningOptimizer's class is made from its optimizer's class, which ZeRO-1/2 just
            # subclassed (`zero_grad` also drops the gradients shown in `p.grad`).
            self.optimizers = self._raw_optimizers()
        self.setup_precision_plugin()
        self.core.connect(self.root_device, precision, self._global_step, self._check_step)

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

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        # Re-created for every fit: ZeRO edits the optimizer's param groups in place.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _attach_optimizers(self) -> None:
        self.core.attach_optimizers(self._raw_optimizers())

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        module = self.lightning_module
        # MoE aux-loss gradients are scaled as Lightning scales the loss: over the accumulation.
        accumulate = module.trainer.accumulate_grad_batches if module.automatic_optimization else 1
        self.core.before_backward(module, self.precision_plugin, accumulate)

    def finalize_gradients(self) -> None:
        """Finish any gradient communication still pending (before clipping or unscaling)."""
        self.core.finalize_gradients()

    # ------------------------------------------------------------------ steps
    def _run_step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        self._report(f"{name} (global step {self._global_step()})", exempt=self._compiling(name))
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
        return self.core.run_step(
            name, module, args, kwargs, context, call=call, precision=precision, check_cp=not manual,
            check_contexts={
                "training_step": precision.train_step_context, "validation_step": precision.val_step_context,
                "test_step": precision.test_step_context, "predict_step": precision.predict_step_context,
            },
        )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._run_step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)
        self.core.after_training_step(output, self._global_step())  # notes of a non-finite loss, recompile storms
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        self._report(f"backward and gradient sync (global step {self._global_step()})", exempt=self._compiling("backward"))
        if not self.core.has_pipeline:
            with self.core.backward_context():  # tensor parallel's loss-parallel kernels
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule already ran forward and backward over every microbatch inside
        # `training_step`; its gradients join `.grad` here (after Lightning's zero_grad) and sync
        # over dp. The precision hooks still run so `on_before/after_backward` callbacks fire.
        self.pre_backward(closure_loss)
        self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.core.finish_pipeline_backward()
        self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the first A-1 micro-steps follow data parallelism's accumulation
        policy (``zero_accumulation``; :meth:`DataParallel.accumulation_no_sync`)."""
        with self.core.accumulation_no_sync():
            yield

    # ------------------------------------------------------------------ non-finite values, SIGTERM (issue 24)
    def on_train_start(self) -> None:
        super().on_train_start()
        self.core.guard.start_fit(self.lightning_module.trainer, self._save_preemption_checkpoint)  # end-of-batch stop, SIGTERM

    def _save_preemption_checkpoint(self) -> str:
        """Always sharded, whatever ``save_distributed_checkpoint`` says: a sharded checkpoint resumes into
        any layout, and a pipeline run cannot resume from one file."""
        sharded, self.save_distributed_checkpoint = self.save_distributed_checkpoint, True
        try:
            return save_hpc_checkpoint(self.lightning_module.trainer)
        finally:
            self.save_distributed_checkpoint = sharded

    def _check_step(self, optimizer: Any, check_gradients: bool) -> None:
        """Gradients are final: one all-reduce agrees on non-finite values and signals (``reliability/step_guard``)."""
        self._report(f"finite check (global step {self._global_step()})", exempt=self._compiling("finite check"))
        self.core.check_step(self._global_step(), self.precision_plugin.main_params(optimizer) if check_gradients else None)

    # ------------------------------------------------------------------ integrity (issue 14)
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        step = self.lightning_module.trainer.global_step
        self._report(f"train batch {batch_idx} loaded (global step {step})", exempt=self._compiling("train batch"))
        integrity = self.core.integrity
        if integrity is not None and integrity.due(step):  # after the last step's ZeRO gather
            self.check_integrity(step)

    def on_train_end(self) -> None:
        super().on_train_end()
        self.core.guard.settle()  # the last step's finite check (read a step late)
        step = self.lightning_module.trainer.global_step
        integrity = self.core.integrity
        if integrity is not None and step != integrity.last_checked_step:
            self.check_integrity(step)

    def check_integrity(self, step: Optional[int] = None) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; see ``docs/reliability.md``).
        Returns the findings; raises ``IntegrityError`` on one unless ``integrity_action="warn"``."""
        module = self.lightning_module
        return self.core.check_integrity(
            module.trainer.global_step if step is None else step, module, self._raw_optimizers(), self.root_device
        )

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(self) -> MemoryBreakdown:
        """This rank's bytes for ``params``, ``grads`` and ``optimizer`` (fp32 masters included),
        with ``expected`` bytes from the ZeRO formulas for the active stage (see ``docs/``), as a
        :class:`~lightning_para.parallel.data.MemoryBreakdown` (``.as_dict()`` for plain values).

        The formulas' ``N`` is the number of ranks that *shard* the state: ``dp_shard x cp``
        (``edp x cp`` for experts); hybrid sharding's ``dp_replicate`` replicas hold copies."""
        return self.core.memory_breakdown(self.lightning_module, self._raw_optimizers(), self.precision_plugin)

    def pipeline_stats(self) -> PipelineStats:
        """Per-step busy/idle time and action events of this rank's pipeline stages (``pp > 1`` only),
        as a :class:`~lightning_para.parallel.pipeline.PipelineStats` record."""
        return self.core.pipeline_stats()

    # ------------------------------------------------------------------ checkpoints
    def _sharded_parameters(self) -> None:
        """FSDP2 units a forward-only pass left gathered are resharded, so parameters are the sharded
        ones the optimizer and checkpoints name (e.g. ModelCheckpoint saving after validation)."""
        self.core.reshard(self.lightning_module)

    def on_validation_end(self) -> None:
        self._sharded_parameters()  # and the gathered head's memory is freed until the next forward

    def on_test_end(self) -> None:
        self._sharded_parameters()

    def on_predict_end(self) -> None:
        self._sharded_parameters()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded (DTensors) on every rank; with ``save_distributed_checkpoint=False``, the full state as
        plain tensors on rank 0 and ``{}`` elsewhere (Lightning's contract; collective)."""
        return self.core.model_state(self.lightning_module, full=not self.save_distributed_checkpoint)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """By parameter name with global DTensors; with ``save_distributed_checkpoint=False``, PyTorch's own
        format with full plain tensors on rank 0 and ``{}`` elsewhere (collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self.core.optimizer_state(self.lightning_module, optimizer, full=not self.save_distributed_checkpoint)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by `load_checkpoint`

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by `load_checkpoint`

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ParaStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP.")
        # Rank 0's path, and its token naming the hidden sibling every rank writes into (atomic save).
        path, token = self.broadcast((str(filepath), self.core.checkpoint_run.new_token()))
        self.core.save_checkpoint(
            Path(path), token, checkpoint, sharded=self.save_distributed_checkpoint, module=self.lightning_module,
            step=self._global_step(),
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        # Renamed away first, then deleted: a kill mid-delete never leaves a half checkpoint under its name.
        if self.is_global_zero:
            ckpt.remove_checkpoint(Path(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load model and optimizer state in place (sharded DCP folder or one full file) and
        return the rest of Lightning's checkpoint (loops, callbacks, schedulers)."""
        self._report(f"choosing the checkpoint for {checkpoint_path}", exempt=True)
        # "hpc"/"last" (Lightning's lookups) become this run's newest complete checkpoint, agreed from rank 0.
        path = ckpt.resume_path(checkpoint_path, getattr(self.lightning_module, "_trainer", None), self.core.checkpoint_run)
        # A Fabric checkpoint (lightning_para.fabric) loads too: its model and optimizers, the loops start afresh.
        return for_the_trainer(self.core.load_checkpoint(path, self.lightning_module, self._raw_optimizers()))

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("para", cls, description="lightning-para: ZeRO/TP/PP/EP on one DeviceMesh")
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"para_zero{stage}", cls, description=f"lightning-para with ZeRO stage {stage}", zero=stage
            )
