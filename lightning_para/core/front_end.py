"""``ParaFrontEnd``: the one argument list of both front ends' ``ParaStrategy``, and what they share.

The Trainer's :class:`lightning_para.ParaStrategy` and Fabric's :class:`lightning_para.fabric.ParaStrategy`
inherit their ``__init__`` from here: it takes every layout option of :data:`lightning_para.spec.options.LAYOUT_OPTIONS`
(same names, types and defaults; ``tests/unit/test_options_once.py`` holds them equal), builds the
:class:`~lightning_para.config.ParallelConfig` and the :class:`~lightning_para.core.ParaEngine`, and hands what
only a front end knows (its precision plugin, accelerator, cluster environment) to its
:meth:`ParaFrontEnd._init_strategy`. The signature is spelled out, not generated: LightningCLI (jsonargparse)
reads ``strategy.init_args`` from it, and ``help()`` and IDEs show it. The ``Args`` section of both classes'
docstrings is written once, from the declaration and :data:`FRONT_END_ARGUMENTS` (``__init_subclass__``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_para.config import ParallelConfig
from lightning_para.core.engine import ParaEngine
from lightning_para.mesh import ParallelDims
from lightning_para.spec.options import Degree, arguments_doc
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.parallelize import ParallelModel
from lightning_para.reliability.spike_guard import SpikeGuard
from lightning_para.reliability.straggler import StragglerDetector
from lightning_para.threads import apply_thread_budget, available_cores

# The front ends' own arguments (the layout options are documented in lightning_para.spec.options), in signature order.
FRONT_END_ARGUMENTS: dict[str, str] = {
    "precision": "``\"32-true\"``, ``\"bf16-mixed\"``, ``\"bf16-true\"``, ``\"16-true\"`` or ``\"16-mixed\"``; when set"
    " it overrides the Trainer's or Fabric's ``precision=`` (which also works).",
    "save_distributed_checkpoint": "sharded directory (default) or one consolidated file. With ``False``, the"
    " model's and optimizers' states are full plain tensors on rank 0 and ``{}`` elsewhere, as Lightning's"
    " FSDP/ModelParallel strategies do. Either is written atomically (``docs/reliability.md``).",
    "process_group_backend": "override ``\"gloo\"``/``\"nccl\"`` chosen from the device.",
    "timeout": "process-group timeout.",
    "integrity_check_every_n_steps": "every N optimizer steps, compare checksums of all replicated state across its"
    " replicas and report non-finite losses/gradients (``None``: off).",
    "integrity_action": "``\"raise\"`` (``IntegrityError`` on every rank) or ``\"warn\"`` on a finding.",
    "watchdog_timeout": "seconds after which a rank that is gone (no heartbeat) or stuck (no progress) makes every"
    " surviving rank log it and exit with code 75; ``None`` switches it off. Keep it below ``timeout`` and above"
    " the longest step (``docs/reliability.md``).",
    "check_finite": "stop every rank before the optimizer step when a loss or gradient is not finite, naming the"
    " step, the rank and (under pp) the stage where it first appeared (``NonFiniteError``); ``False`` trains on"
    " (``docs/reliability.md``).",
    "on_sigterm": "``\"checkpoint\"``: after SIGTERM on any rank, every rank saves ``hpc_ckpt_<n>.ckpt`` in"
    " ``default_root_dir`` at the next step boundary and exits with code 143; ``\"exit\"``: the same without"
    " saving; ``None``: Lightning's own SIGTERM handling. ``\"auto\"``: ``\"checkpoint\"`` under the Trainer,"
    " ``None`` under Fabric. Under Fabric the loop owns its state: with ``\"checkpoint\"`` every rank sees"
    " ``fabric.strategy.preempted`` turn true after the same ``optimizer.step()`` (the loop saves and exits);"
    " ``\"exit\"`` raises ``Preempted`` (code 143) there.",
    "straggler": "name a rank slower than the median over ranks by ``factor`` at ``patience`` consecutive comparisons"
    " every ``every_n_steps`` steps: ``True`` (1.5, 3, 5), ``False``, a dict or a ``StragglerDetector`` (``docs/reliability.md``).",
    "spike_guard": "skip (``\"skip\"``) or clip (``\"clip\"``) an optimizer step whose loss or gradient norm spikes, on every"
    " rank: ``None`` (off), ``True``, a dict or a ``SpikeGuard`` (``docs/reliability.md``).",
    "run_id": "this run's id across restarts, recorded in every checkpoint; the Trainer's ``ckpt_path=\"hpc\"``/"
    "``\"last\"`` resume the newest complete checkpoint of this run (default: ``LIGHTNING_PARA_RUN_ID``, else the"
    " scheduler's job id, else the run a resume continues; ``docs/reliability.md``).",
    "async_save": "sharded saves return once this rank's checkpoint tensors are copied to host memory (pinned on"
    " accelerators: a copy of the state, kept until teardown); the write, checksums, completion marker and swap into"
    " place run in the background (DCP's ``async_save``). At most one save is in flight; a failed write is raised on"
    " every rank at the next step boundary. Lightning's ``AsyncCheckpointIO`` plugin means the same under the"
    " Trainer (``docs/checkpointing.md``).",
    "accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin": "set by the Trainer or"
    " Fabric, as for Lightning's own strategies.",
}


class ParaFrontEnd:
    """The arguments, the layout, the engine and the read-only views both front ends share (mixed in
    before Lightning's ``ParallelStrategy``; see the module docstring)."""

    front_end = "Trainer"  # named in errors about the order of calls
    launcher_class: Any  # the framework's subprocess launcher (Lightning's for the Trainer, Fabric's)
    # What ``"auto"`` means for the options whose default depends on the front end.
    auto_loss_parallel = True
    auto_on_sigterm: Optional[str] = "checkpoint"
    strategy_name = "para"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and "\n    Args:\n" not in cls.__doc__:  # the Args text, written once for both
            cls.__doc__ = cls.__doc__.rstrip() + "\n\n    Args:\n" + arguments_doc(FRONT_END_ARGUMENTS) + "\n"

    def __init__(
        self,
        dp: Degree = "auto",
        tp: Degree = 1,
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
        sequence_parallel: bool = False,
        sp_save_input_shard: bool = True,
        tp_plan: Optional[Mapping[str, Any]] = None,
        tp_unplanned: str = "error",
        loss_parallel: Union[bool, Literal["auto"]] = "auto",
        activation_checkpointing: Optional[str] = None,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        pipeline_split: Optional[Sequence[int]] = None,
        pipeline_balance: str = "params",
        bucket_size_mb: float = 25.0,
        zero_accumulation: str = "no_sync",
        zero3_units: str = "auto",
        compile: Union[bool, Mapping[str, Any]] = False,
        fp8: Optional[str] = None,
        layout: Optional[str] = None,
        layout_memory_gb: Optional[float] = None,
        precision: Optional[str] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        integrity_check_every_n_steps: Optional[int] = None,
        integrity_action: str = "raise",
        watchdog_timeout: Optional[float] = 60.0,
        check_finite: bool = True,
        on_sigterm: Optional[str] = "auto",
        run_id: Optional[str] = None,
        straggler: Union[bool, Mapping[str, Any], StragglerDetector, None] = True,
        spike_guard: Union[bool, str, Mapping[str, Any], SpikeGuard, None] = None,
        async_save: bool = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        config = ParallelConfig(
            dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, cp=cp, cp_method=cp_method, cp_load_balance=cp_load_balance,
            cp_check=cp_check, dp_replicate=dp_replicate, dp_shard=dp_shard, sequence_parallel=sequence_parallel,
            sp_save_input_shard=sp_save_input_shard, tp_plan=tp_plan, tp_unplanned=tp_unplanned,
            loss_parallel=self.auto_loss_parallel if loss_parallel == "auto" else loss_parallel,
            activation_checkpointing=activation_checkpointing, schedule=schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, pipeline_split=pipeline_split, pipeline_balance=pipeline_balance,
            bucket_size_mb=bucket_size_mb, zero_accumulation=zero_accumulation, zero3_units=zero3_units,
            compile=compile, fp8=fp8, layout=layout, layout_memory_gb=layout_memory_gb,
        )
        self._check_front_end(config, on_sigterm)
        # The layout, run guard and checkpoint IO; reliability options validated before any process group exists.
        self.core = ParaEngine(
            config, integrity_check_every_n_steps=integrity_check_every_n_steps, integrity_action=integrity_action,
            watchdog_timeout=watchdog_timeout, timeout=timeout, check_finite=check_finite,
            on_sigterm=self.auto_on_sigterm if on_sigterm == "auto" else on_sigterm, run_id=run_id,
            async_save=async_save, front_end=self.front_end, step=self._step_number, straggler=straggler,
            spike_guard=spike_guard,
        )
        self.core.checkpoints.use_checkpoint_io(checkpoint_io)
        if precision is not None and precision_plugin is not None:
            raise ValueError("Pass either `precision=` or `precision_plugin=` to ParaStrategy, not both.")
        self._init_strategy(
            precision=precision, accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    # ------------------------------------------------------------------ the front end's part
    def _step_number(self) -> int:
        """The step counter the engine reports and checks with (the Trainer's global step, Fabric's optimizer steps)."""
        raise NotImplementedError

    def _check_front_end(self, config: ParallelConfig, on_sigterm: Optional[str]) -> None:
        """Raise ``ValueError`` naming an argument this front end does not take (default: it takes them all)."""

    def _init_strategy(
        self, *, precision: Optional[str], accelerator: Any, parallel_devices: Optional[list[torch.device]],
        cluster_environment: Optional[ClusterEnvironment], checkpoint_io: Optional[CheckpointIO],
        precision_plugin: Optional[Precision],
    ) -> None:
        """Initialise the framework's strategy with its own plugins (``precision``: a name, else ``None``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ launching (both front ends)
    def _resolve_dims(self) -> ParallelDims:
        """The degrees for this world (``ValueError`` before any process or collective)."""
        return self.core.resolve_dims(self.num_nodes * self.num_processes, devices_per_node=self.num_processes or None)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._resolve_dims()  # fail in the launching process, before any worker exists, if the degrees cannot fit
        # One process needs no launcher. Lightning's subprocess launcher would also write LOCAL_RANK,
        # NODE_RANK and WORLD_SIZE into this process's environment, and a later multi-device Trainer in
        # the same process (a notebook, `parity.compare`) would then take itself for a launched child
        # and wait for ranks that never start.
        if not self.cluster_environment.creates_processes_externally and self.num_nodes * self.num_processes > 1:
            self._launcher = self.launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def _share_cores(self) -> None:
        """The ranks of one node share its CPU cores (intra-op threads per rank; ``threads.py``)."""
        threads = apply_thread_budget(self.num_processes)
        if threads is not None:
            rank_zero_info(
                f"lightning-para: {self.num_processes} ranks per node share {available_cores()} CPU cores:"
                f" {threads} intra-op thread(s) per rank. Set OMP_NUM_THREADS or call torch.set_num_threads"
                " to choose otherwise."
            )

    # ------------------------------------------------------------------ shared views of the engine
    @property
    def config(self) -> ParallelConfig:
        """The layout (``layout="auto"`` replaces it with the planner's choice at setup)."""
        return self.core.config

    @config.setter
    def config(self, config: ParallelConfig) -> None:
        self.core.config = config

    @property
    def parallel_dims(self) -> ParallelDims:
        """Degrees and mesh of this run (available once the front end sets up its environment)."""
        return self.core.parallel_dims

    @property
    def parallel_model(self) -> ParallelModel:
        """The typed record of what was applied to the model (available once the model is set up)."""
        return self.core.parallel_model

    @property
    def checkpoint_run(self) -> Any:
        """This run's :class:`~lightning_para.checkpoint.CheckpointRun` (``ParaModelCheckpoint`` reads it for ``"last"``)."""
        return self.core.checkpoints.run

    @property
    def device_mesh(self) -> Any:
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
    def straggler(self) -> Optional[StragglerDetector]:
        """The straggler detector (``None``: off): ``.figures``, ``.stragglers`` after each comparison."""
        return self.core.straggler

    @property
    def spike_guard(self) -> Optional[SpikeGuard]:
        """The spike guard (``None``: off): ``.events`` lists the spikes logged so far."""
        return self.core.spike_guard

    def wait_for_checkpoint(self) -> None:
        """``async_save=True``: wait until the checkpoint written in the background is in place, or raise its error
        (the same on every rank). The Trainer waits at the end of ``fit``; a Fabric loop calls it before it ends."""
        self.core.checkpoints.settle_save()

    def pipeline_stats(self) -> PipelineStats:
        """Per-step busy/idle time and action events of this rank's pipeline stages (``pp > 1`` only),
        as a :class:`~lightning_para.parallel.pipeline.PipelineStats` record."""
        return self.core.pipeline_stats()


__all__ = ["FRONT_END_ARGUMENTS", "ParaFrontEnd"]
