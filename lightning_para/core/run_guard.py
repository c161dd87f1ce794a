"""The engine's run guard: the step guard (non-finite values, SIGTERM), the watchdog and the integrity checker.

:class:`EngineRunGuard` is a part of :class:`~lightning_para.core.engine.ParaEngine` (its base): the methods read
the engine's own state, set in ``ParaEngine.__init__``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_para import checkpoint as ckpt
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.compile import CompileWatch
from lightning_para.parallelize import ParallelModel
from lightning_para.reliability.integrity import IntegrityChecker
from lightning_para.reliability.spike_guard import SpikeGuard
from lightning_para.reliability.step_guard import Preempted, StepGuard
from lightning_para.reliability.watchdog import Watchdog, start_watchdog


class EngineRunGuard:
    """What keeps a run honest between steps (see the module docstring)."""

    watchdog_timeout: Optional[float]
    watchdog: Optional[Watchdog]
    integrity: Optional[IntegrityChecker]
    guard: StepGuard
    spike: Optional[SpikeGuard]
    checkpoint_run: ckpt.CheckpointRun
    parallel: Optional[ParallelModel]
    compile_watch: Optional[CompileWatch]
    _compiled_phases: set[str]
    parallel_dims: ParallelDims
    parallel_model: ParallelModel

    def start_watchdog(self, world_size: int, broadcast: Callable[[Any], Any]) -> None:
        if self.watchdog_timeout is None or world_size < 2 or self.watchdog is not None:
            return
        token = broadcast(ckpt.new_token())  # the heartbeats' key namespace for this run, agreed at setup
        self.watchdog = start_watchdog(self.watchdog_timeout, token)
        self.report("setup", exempt=True)

    def report(self, what: str, exempt: bool = False) -> None:
        """Tell the watchdog what this rank does now (two attribute writes: nothing waits)."""
        if self.watchdog is not None:
            self.watchdog.progress(what, exempt)

    def compiling(self, phase: str, step: int) -> bool:
        """Under compile, the first optimizer step and the first call of each other step kind compile the
        blocks (minutes with inductor on a large model, at different times on different ranks): exempt
        from the watchdog, like setup. Later recompilations are not."""
        if self.compile_watch is None:
            return False
        first = phase not in self._compiled_phases
        self._compiled_phases.add(phase)
        return first or step <= 0

    def on_exception(self, exception: BaseException) -> None:
        if self.watchdog is not None:  # stop beating: peers blocked on this rank exit after watchdog_timeout
            if isinstance(exception, Preempted):  # every rank agreed to stop here: a finished run, no failure
                self.watchdog.stop()
            else:
                self.watchdog.failed(exception)
            self.watchdog = None

    def teardown(self) -> None:
        self.guard.restore_signal_handler()
        self.checkpoint_run.end()  # stops the lock's refresh thread: nothing of ours outlives `fit`
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def after_training_step(self, output: Any, step: int) -> None:
        """A training step's loss is out: note a non-finite one; warn once on a recompile storm (``compile=True``)."""
        if self.compile_watch is not None:
            self.compile_watch.check()  # names dynamo's reasons
        self.observe_loss(output, step)

    def observe_loss(self, output: Any, step: int) -> None:
        """Device-side notes of a non-finite local loss (no sync, no collective); under pp the loss is the
        last stage's, shared, so only that rank's counts."""
        pipeline = self.parallel.pipeline if self.parallel is not None else None
        local = pipeline is None or pipeline.has_last
        if self.guard.active:
            self.guard.observe_loss(output, step, local=local)
        loss = output.get("loss") if isinstance(output, dict) else output
        if self.spike is not None and local and isinstance(loss, torch.Tensor):
            self.spike.observe_loss(loss)
        if self.integrity is not None and local:
            self.integrity.observe_loss(output, step)

    def check_step(self, step: int, params: Optional[Any]) -> None:
        """Gradients are final: one all-reduce agrees on non-finite values and signals (``reliability/step_guard``)."""
        self.guard.check(step, params)

    def check_integrity(self, step: int, module: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> list[str]:
        """Compare every replicated tensor across its replicas now (collective; ``docs/reliability.md``)."""
        parallel = self.parallel_model
        checker = self.integrity or IntegrityChecker(1, "raise")
        return checker.check_model(
            step, module, optimizers, self.parallel_dims, device,
            fully_sharded=parallel.fully_sharded, is_expert=parallel.expert_predicate(),
        )


__all__ = ["EngineRunGuard"]
