"""``RunGuard``: what keeps a run honest between steps, one object the engine holds.

It owns the step guard (non-finite values, SIGTERM; :mod:`lightning_para.reliability.step_guard`) and its riders
(the spike guard, the straggler detector), the watchdog, the integrity checker and, under ``compile=True``, the
compile watch. :class:`~lightning_para.core.engine.ParaEngine`
calls it at the points of its lifecycle; no front end reaches into it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_para import checkpoint as ckpt
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallelize import ParallelModel
from lightning_para.reliability.integrity import IntegrityChecker, check_integrity_options
from lightning_para.reliability.spike_guard import spike_guard_option
from lightning_para.reliability.step_guard import Preempted, StepGuard, pipeline_rank_info
from lightning_para.reliability.straggler import mesh_coordinates, straggler_option
from lightning_para.reliability.watchdog import Watchdog, check_watchdog_timeout, start_watchdog


class RunGuard:
    """The run guard of one run. ``step()`` reads the front end's step counter (for reports and the checks).

    Args: the reliability options of ``ParaStrategy`` (validated here, before any process group exists);
    ``timeout`` is the process group's (the watchdog's must be below it); ``front_end``: ``"Trainer"`` or
    ``"Fabric"``, whose words a watchdog verdict uses to say how to resume.
    """

    def __init__(
        self, step: Callable[[], int], *, integrity_check_every_n_steps: Optional[int], integrity_action: str,
        watchdog_timeout: Optional[float], timeout: Optional[timedelta], check_finite: bool, on_sigterm: Optional[str],
        straggler: Any = True, spike_guard: Any = None, front_end: str = "Trainer",
    ) -> None:
        check_integrity_options(integrity_check_every_n_steps, integrity_action)
        check_watchdog_timeout(watchdog_timeout, timeout)
        self.step = step
        self.watchdog_timeout = watchdog_timeout
        fabric = front_end == "Fabric"
        self.resume = "fabric.load(path, state) from the last fabric.save" if fabric else "trainer.fit(..., ckpt_path='last')"
        self.watchdog: Optional[Watchdog] = None
        every = integrity_check_every_n_steps
        self.integrity = IntegrityChecker(every, integrity_action) if every else None
        self.guard = StepGuard(check_finite=check_finite, on_sigterm=on_sigterm)  # NaN stop, SIGTERM
        self.spike = spike_guard_option(spike_guard)  # both ride the step guard's all-reduce
        self.straggler = straggler_option(straggler)
        self.guard.riders = [r for r in (self.spike, self.straggler) if r is not None]
        self.compile_watch: Optional[CompileWatch] = None  # compile=True: graphs and recompiles
        self._compiled_phases: set[str] = set()  # compile=True: step kinds that ran once (compiled) already

    # ------------------------------------------------------------------ watchdog
    def start_watchdog(self, world_size: int, broadcast: Callable[[Any], Any]) -> None:
        if self.watchdog_timeout is None or world_size < 2 or self.watchdog is not None:
            return
        token = broadcast(ckpt.new_token())  # the heartbeats' key namespace for this run, agreed at setup
        self.watchdog = start_watchdog(self.watchdog_timeout, token, self.resume)
        self.report("setup", exempt=True)

    def report(self, what: str, exempt: bool = False, in_user_code: bool = False) -> None:
        """Tell the watchdog what this rank does now (two attribute writes: nothing waits)."""
        if self.watchdog is not None:
            self.watchdog.progress(what, exempt, in_user_code)

    def progress(self, phase: str, what: Optional[str] = None) -> None:
        """Report ``phase`` (in words: ``what``) of the current step; a compiling one is exempt (:meth:`compiling`)."""
        self.report(f"{what or phase} (step {self.step()})", exempt=self.compiling(phase))

    def compiling(self, phase: str) -> bool:
        """Under compile, the first optimizer step and the first call of each other step kind compile the
        blocks (minutes with inductor on a large model, at different times on different ranks): exempt
        from the watchdog, like setup. Later recompilations are not."""
        if self.compile_watch is None:
            return False
        first = phase not in self._compiled_phases
        self._compiled_phases.add(phase)
        return first or self.step() <= 0

    # ------------------------------------------------------------------ the engine's lifecycle points
    def connect(self, parallel: ParallelModel, device: torch.device) -> None:
        """A model is set up: the step guard learns the device and the stages (each stage's forward output
        is checked, so a NaN is traced to the stage that made it); the riders learn the world."""
        dims = parallel.dims
        self.guard.connect(device, pipeline_rank_info(dims.mesh), parallel.data_parallel.grad_replication)
        if self.straggler is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.straggler.connect(device, rank, dims.world_size, lambda r: mesh_coordinates(dims, r))
        if self.spike is not None:
            self.spike.connect(device, self.guard)
        pipeline = parallel.pipeline
        if pipeline is not None:
            self.guard.watch_stage_outputs(
                ((m.stage_index, m) for m in pipeline.stage_modules), self.step, lambda: pipeline.inferring_shapes
            )

    def watch_compiles(self, parallel: ParallelModel) -> None:
        """``compile=True``: count compilations from here (the first of each block class is expected)."""
        if parallel.compiled:
            self.compile_watch = CompileWatch(sorted({t for info in parallel.compiled for t in info.block_types}))

    def observe_loss(self, output: Any, local: bool) -> None:
        """Device-side notes of a non-finite local loss (no sync, no collective); ``local``: this rank computed
        it (under pp only the last stage's rank does)."""
        if self.guard.active:
            self.guard.observe_loss(output, self.step(), local=local)
        loss = output.get("loss") if isinstance(output, dict) else output
        if self.spike is not None and local and isinstance(loss, torch.Tensor):
            self.spike.observe_loss(loss)
        if self.integrity is not None and local:
            self.integrity.observe_loss(output, self.step())

    def before_backward(self) -> None:
        """The end of this rank's own work before the gradient synchronisation (straggler detection)."""
        if self.straggler is not None:
            self.straggler.arrive()

    def check_step(self, params: Optional[Any]) -> None:
        """Gradients are final: one all-reduce agrees on non-finite values and signals (``reliability/step_guard``)."""
        self.progress("finite check")
        self.guard.check(self.step(), params)

    def integrity_due(self, final: bool = False) -> bool:
        """Whether the scheduled integrity check runs now (``final``: at the end of training, unless it ran at this step)."""
        integrity, step = self.integrity, self.step()
        return integrity is not None and (step != integrity.last_checked_step if final else integrity.due(step))

    def check_integrity(
        self, parallel: ParallelModel, module: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device,
        step: Optional[int] = None,
    ) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; ``docs/reliability.md``)."""
        checker = self.integrity or IntegrityChecker(1, "raise")
        return checker.check_model(
            self.step() if step is None else step, module, optimizers, parallel.dims, device,
            fully_sharded=parallel.fully_sharded, is_expert=parallel.expert_predicate(),
        )

    def end_step(self, save: Optional[Callable[[], Optional[str]]]) -> None:
        """A step boundary (every rank together): the step guard's boundary, and after an agreed SIGTERM the stop
        (``save`` writes the preemption checkpoint; without one under ``on_sigterm="checkpoint"`` the loop saves)."""
        try:
            self.guard.at_step_boundary(self.step(), save)
        except Preempted as preempted:
            self.on_exception(preempted)  # every rank agreed: the watchdog stops as after a finished run
            raise

    def settle(self) -> None:
        """Read the step guard's agreement in flight now (before a save, at the end of training)."""
        self.guard.settle()

    @property
    def preempted(self) -> bool:
        """Every rank agreed on a SIGTERM (read from the step guard's agreement: no collective of its own)."""
        return self.guard.stop_signal is not None

    def on_exception(self, exception: BaseException) -> None:
        if self.watchdog is not None:  # stop beating: peers blocked on this rank exit after watchdog_timeout
            if isinstance(exception, Preempted):  # every rank agreed to stop here: a finished run, no failure
                self.watchdog.stop()
            else:
                self.watchdog.failed(exception)
            self.watchdog = None

    def teardown(self) -> None:
        self.guard.restore_signal_handler()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


__all__ = ["RunGuard"]
