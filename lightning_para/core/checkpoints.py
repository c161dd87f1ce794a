"""The engine's checkpoint IO: state dicts of any layout, atomic checksummed saves, loads in place.

:class:`EngineCheckpoints` is a part of :class:`~lightning_para.core.engine.ParaEngine` (its base): the methods
read the engine's own state (the parallel model, the step guard, the checkpoint run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_para import checkpoint as ckpt
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.data import DataParallel
from lightning_para.parallelize import ParallelModel
from lightning_para.reliability.step_guard import StepGuard


class EngineCheckpoints:
    """Saving and loading a run's model and optimizers in any layout (see the module docstring)."""

    guard: StepGuard
    checkpoint_run: ckpt.CheckpointRun
    parallel: Optional[ParallelModel]
    data_parallel: Optional[DataParallel]
    parallel_dims: ParallelDims
    report: Callable[..., None]  # the run guard's (EngineRunGuard.report)

    def reshard(self, module: Optional[nn.Module]) -> None:
        """FSDP2 units a forward-only pass left gathered are resharded, so parameters are the sharded
        ones the optimizer and checkpoints name."""
        if module is not None and self.data_parallel is not None:
            self.data_parallel.reshard(module)

    def optim_views(self, module: nn.Module) -> Any:
        return ckpt.optimizer_params(module, self.data_parallel, self.parallel_dims)

    def model_state(self, module: nn.Module, *, full: bool) -> dict[str, Any]:
        """Sharded (DTensors) on every rank; ``full``: plain tensors on rank 0 and ``{}`` elsewhere (collective)."""
        self.reshard(module)
        if not full:
            return module.state_dict()
        return ckpt.full_model_state(module, self.data_parallel, self.parallel_dims)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict[str, Any]:
        """By parameter name with global DTensors; ``full``: PyTorch's own format with full plain tensors on
        rank 0 and ``{}`` elsewhere (collective)."""
        self.reshard(module)
        state = ckpt.optimizer_state_dict(optimizer, self.optim_views(module))
        pipeline = self.parallel.pipeline if self.parallel is not None else None
        if pipeline is not None:  # each stage's optimizer names only its own parameters
            state["param_groups"] = pipeline.merge_param_group_names(state["param_groups"])
        if full:
            return ckpt.full_optimizer_state(state, module, self.parallel_dims)
        return state

    def save_checkpoint(self, path: Path, token: str, checkpoint: dict[str, Any], *, sharded: bool, module: Optional[nn.Module], step: int) -> None:
        """Write Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, the rest) atomically, with
        checksums; ``path`` and ``token`` are rank 0's, broadcast by the front end (collective)."""
        self.guard.settle()  # the step guard's check in flight first: no checkpoint holds a non-finite step
        if module is not None:
            # What integrations record about the model (transformers: each model's class and config).
            checkpoint.update(ckpt.model_info(module))
        self.report(f"saving checkpoint {path}", exempt=True)  # I/O may outlast watchdog_timeout
        ckpt.save_checkpoint(path, checkpoint, sharded=sharded, token=token, run=self.checkpoint_run)
        self.report(f"checkpoint {path} saved (global step {step})")

    def load_checkpoint(
        self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: Optional[bool] = None,
        convert: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
    ) -> dict[str, Any]:
        """Load model and optimizer state in place (sharded DCP folder of any layout, or one full file) and
        return the rest of the checkpoint. ``strict`` (default ``module.strict_loading``): missing or unexpected
        model keys raise; ``convert``: a single file's layout into Lightning's (``checkpoint.load_checkpoint_in_place``)."""
        self.report(f"loading checkpoint {path}", exempt=True)
        self.reshard(module)
        # A load may run under torch.inference_mode(): tensors DCP reads there could not be copied into
        # parameters ("Cannot set version_counter for inference tensor").
        with torch.inference_mode(False), torch.no_grad():
            return ckpt.load_checkpoint_in_place(
                path, module, optimizers, self.optim_views(module), data_parallel=self.data_parallel,
                pipeline=self.parallel.pipeline if self.parallel is not None else None, strict=strict, convert=convert,
            )


__all__ = ["EngineCheckpoints"]
