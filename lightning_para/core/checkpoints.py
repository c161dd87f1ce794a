"""``Checkpoints``: the engine's checkpoint IO, one object it holds: state dicts of any layout, atomic checksummed
saves, loads in place, and this run's hold on its checkpoint folders (:class:`~lightning_para.checkpoint.CheckpointRun`);
with ``async_save``, the one save in flight (:class:`~lightning_para.checkpoint.AsyncSaver`), settled before the next
save, a load, the end of training, an exception and teardown.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_para import checkpoint as ckpt
from lightning_para.core.run_guard import RunGuard
from lightning_para.parallelize import ParallelModel


class Checkpoints:
    """Saving and loading one run's model and optimizers in any layout.

    Args:
        run_id: this run's id across restarts, recorded in every checkpoint (``checkpoint/run.py``).
        parallel: the engine's parallel model (raises until the model is set up).
        run_guard: told what this rank does (I/O is exempt from the watchdog); settled before a save.
        async_save: sharded saves return once staged and are written in the background (``checkpoint/async_save.py``).
    """

    def __init__(
        self, run_id: Optional[str], parallel: Callable[[], ParallelModel], run_guard: RunGuard, async_save: bool = False,
    ) -> None:
        self.run = ckpt.CheckpointRun(run_id)  # which run saves; rank 0's hold on its checkpoint folders
        self.parallel = parallel
        self.run_guard = run_guard
        self.saver: Optional[ckpt.AsyncSaver] = None
        if ckpt.check_async_save(async_save):
            self.enable_async_save()

    def begin_run(self, trainer: Any) -> None:
        """Collective, when ``fit`` starts: rank 0 holds ``trainer``'s checkpoint folders and sweeps the leftovers
        of interrupted saves (``checkpoint/resume.py``)."""
        ckpt.begin_run(self.run, trainer)

    def resume_path(self, requested: Any, trainer: Any) -> Path:
        """Collective: the checkpoint a load of ``requested`` loads (``"hpc"``/``"last"``: this run's newest complete one)."""
        self.run_guard.report(f"choosing the checkpoint for {requested}", exempt=True)
        return ckpt.resume_path(requested, trainer, self.run)

    def reshard(self, module: nn.Module) -> None:
        """FSDP2 units a forward-only pass left gathered are resharded, so parameters are the sharded
        ones the optimizer and checkpoints name."""
        self.parallel().data_parallel.reshard(module)

    def model_state(self, module: nn.Module, *, full: bool) -> dict[str, Any]:
        """Sharded (DTensors) on every rank; ``full``: plain tensors on rank 0 and ``{}`` elsewhere (collective)."""
        self.reshard(module)
        if not full:
            return module.state_dict()
        parallel = self.parallel()
        return ckpt.full_model_state(module, parallel.data_parallel, parallel.dims)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict[str, Any]:
        """By parameter name with global DTensors; ``full``: PyTorch's own format with full plain tensors on
        rank 0 and ``{}`` elsewhere (collective)."""
        self.reshard(module)
        parallel = self.parallel()
        state = ckpt.optimizer_state_dict(optimizer, ckpt.optimizer_params(module, parallel.data_parallel, parallel.dims))
        if parallel.pipeline is not None:  # each stage's optimizer names only its own parameters
            state["param_groups"] = parallel.pipeline.merge_param_group_names(state["param_groups"])
        return ckpt.full_optimizer_state(state, module, parallel.dims) if full else state

    def save(
        self, path: Any, checkpoint: dict[str, Any], *, sharded: bool, module: Optional[nn.Module],
        broadcast: Callable[[Any], Any], background: bool = True,
    ) -> None:
        """Write Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, the rest) atomically, with
        checksums, at rank 0's ``path`` (collective). The step guard's check in flight and the save in flight are
        read first: no checkpoint holds a non-finite step. With ``async_save`` a sharded save in ``background``
        returns once staged (a preemption's save waits for its write)."""
        target, token = broadcast((str(path), self.run.new_token()))  # the hidden sibling every rank writes into
        self.run_guard.settle()
        self.settle_save()  # at most one save in flight
        if module is not None:
            # What integrations record about the model (transformers: each model's class and config).
            checkpoint.update(ckpt.model_info(module))
            if sharded:  # shards holding tp's rank-major rows: consolidation and other layouts reorder them
                checkpoint[ckpt.ROW_ORDER_KEY] = ckpt.stored_row_orders(module, self.parallel().pipeline)
        self.run_guard.report(f"saving checkpoint {target}", exempt=True)  # I/O may outlast watchdog_timeout
        saver = self.saver if background and sharded and not self.run_guard.preempted else None
        ckpt.save_checkpoint(Path(target), checkpoint, sharded=sharded, token=token, run=self.run, saver=saver)
        done = "staged, written in the background" if saver is not None else "saved"
        self.run_guard.report(f"checkpoint {target} {done} (step {self.run_guard.step()})")

    def enable_async_save(self) -> None:
        """``async_save=True`` (or Lightning's ``AsyncCheckpointIO``): a failed background write rides on the step
        guard's agreement, raised on every rank at the next step boundary."""
        if self.saver is None:
            self.saver = ckpt.AsyncSaver()
            self.run_guard.guard.background = self.saver  # the step guard's all-reduce carries its failure

    def use_checkpoint_io(self, io: Any) -> None:
        """Saves go through DCP, never a ``CheckpointIO`` plugin; Lightning's ``AsyncCheckpointIO`` means ``async_save``."""
        if ckpt.is_async_checkpoint_io(io):
            self.enable_async_save()

    def settle_save(self, quiet: bool = False) -> None:
        """Wait for the checkpoint written in the background: in place, or its error raised (the same on every rank:
        agreed in the background). ``quiet``: the error is printed instead (another exception is on its way)."""
        if self.saver is None or not self.saver.in_flight:
            return
        self.run_guard.report("waiting for the checkpoint written in the background", exempt=True)
        try:
            self.saver.settle()
        except BaseException as error:
            if not quiet:
                raise
            sys.stderr.write(f"lightning-para: the checkpoint written in the background failed too: {error}\n")

    def remove(self, path: Any, rank0: bool) -> None:
        """Delete a checkpoint (rank 0), renamed away first (a kill mid-delete leaves no half checkpoint under its
        name); while a save is in flight, once that one is complete (top-k never deletes before the newer is in place)."""
        if (self.saver is None or not self.saver.remove_after(Path(path))) and rank0:
            ckpt.remove_checkpoint(Path(path))

    def load(
        self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: Optional[bool] = None,
        convert: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
    ) -> dict[str, Any]:
        """Load model and optimizer state in place (sharded DCP folder of any layout, or one full file) and
        return the rest of the checkpoint. ``strict`` (default ``module.strict_loading``): missing or unexpected
        model keys raise; ``convert``: a single file's layout into Lightning's (``checkpoint.load_checkpoint_in_place``)."""
        self.settle_save()  # a load never races the save in flight
        self.run_guard.report(f"loading checkpoint {path}", exempt=True)
        self.reshard(module)
        parallel = self.parallel()
        views = ckpt.optimizer_params(module, parallel.data_parallel, parallel.dims)
        # A load may run under torch.inference_mode(): tensors DCP reads there could not be copied into
        # parameters ("Cannot set version_counter for inference tensor").
        with torch.inference_mode(False), torch.no_grad():
            return ckpt.load_checkpoint_in_place(
                path, module, optimizers, views, data_parallel=parallel.data_parallel, pipeline=parallel.pipeline,
                strict=strict, convert=convert,
            )

    def teardown(self) -> None:
        if self.saver is not None:  # the save in flight ends, the staging copy and the save group are freed
            self.settle_save(quiet=True)
            self.saver.close()
        self.run.end()  # stops the lock's refresh thread: nothing of ours outlives `fit`


__all__ = ["Checkpoints"]
