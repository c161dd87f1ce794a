"""``Checkpoints``: the engine's checkpoint IO, one object it holds: state dicts of any layout, atomic checksummed
saves, loads in place, and this run's hold on its checkpoint folders (:class:`~lightning_para.checkpoint.CheckpointRun`).
"""

from __future__ import annotations

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
    """

    def __init__(self, run_id: Optional[str], parallel: Callable[[], ParallelModel], run_guard: RunGuard) -> None:
        self.run = ckpt.CheckpointRun(run_id)  # which run saves; rank 0's hold on its checkpoint folders
        self.parallel = parallel
        self.run_guard = run_guard

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
        broadcast: Callable[[Any], Any],
    ) -> None:
        """Write Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, the rest) atomically, with
        checksums, at rank 0's ``path`` (collective). The step guard's check in flight is read first: no
        checkpoint holds a non-finite step."""
        target, token = broadcast((str(path), self.run.new_token()))  # the hidden sibling every rank writes into
        self.run_guard.settle()
        if module is not None:
            # What integrations record about the model (transformers: each model's class and config).
            checkpoint.update(ckpt.model_info(module))
        self.run_guard.report(f"saving checkpoint {target}", exempt=True)  # I/O may outlast watchdog_timeout
        ckpt.save_checkpoint(Path(target), checkpoint, sharded=sharded, token=token, run=self.run)
        self.run_guard.report(f"checkpoint {target} saved (step {self.run_guard.step()})")

    def load(
        self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: Optional[bool] = None,
        convert: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
    ) -> dict[str, Any]:
        """Load model and optimizer state in place (sharded DCP folder of any layout, or one full file) and
        return the rest of the checkpoint. ``strict`` (default ``module.strict_loading``): missing or unexpected
        model keys raise; ``convert``: a single file's layout into Lightning's (``checkpoint.load_checkpoint_in_place``)."""
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
        self.run.end()  # stops the lock's refresh thread: nothing of ours outlives `fit`


__all__ = ["Checkpoints"]
