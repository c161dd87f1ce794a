"""A model set up for a layout once: materialised (meta parameters allocated and reset, or pretrained weights read
sharded), parallelized in place (:func:`~lightning_para.parallelize`), and remembered, so a second ``fit``/``setup``
of the same module reuses its layout (a module is parallelized in place, once)."""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from lightning_para.checkpoint.pretrained import load_pretrained_into, materialize_for_loading, pending_weights, real_buffers
from lightning_para.config import ParallelConfig
from lightning_para.core.precision import PrecisionCore
from lightning_para.instrument.saved_activations import SavedActivationMeter
from lightning_para.mesh import ParallelDims
from lightning_para.parallelize import ParallelModel, parallelize

# The layout each module was parallelized with. Weak: it keeps no module alive.
_PARALLELIZED: "weakref.WeakKeyDictionary[nn.Module, ParallelModel]" = weakref.WeakKeyDictionary()


def parallel_model_of(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig, device: torch.device, precision: PrecisionCore,
    before: Optional[Callable[[nn.Module], None]], report: Callable[..., None],
) -> tuple[ParallelModel, bool]:
    """``module`` parallelized for ``dims``/``config`` and whether that happened now (a module parallelized
    before keeps its layout; a different one raises ``ValueError``). ``before(module)`` runs on the materialised
    model, before any dimension.

    Parameters made under ``init_module(empty_init=True)`` are on the meta device: allocated on ``device`` and
    reset deterministically before sharding; or, when the module asks for pretrained weights
    (:mod:`lightning_para.checkpoint.pretrained`), read after parallelizing, each rank its own slices (ZeRO 0-2
    replicate them over dp: empty storage before, no random init)."""
    existing = _PARALLELIZED.get(module)
    if existing is not None:
        _check_same_layout(existing, dims, config)
        if before is not None:
            before(module)
        return existing, False
    weights = pending_weights(module) if any(p.is_meta for p in module.parameters()) else None
    kept_buffers = real_buffers(module) if weights is not None else {}
    if not dims.pp_enabled:  # the pipeline split builds only this rank's stages
        if weights is None:
            materialize(module, device)
        elif config.zero < 3:
            materialize_for_loading(module, device, kept_buffers)
    if before is not None:
        before(module)
    parallel = parallelize(module, dims, config, param_dtype=precision.param_dtype, master_dtype=precision.master_dtype)
    if weights is not None:
        materialize_for_loading(module, device, kept_buffers)
        report("setup: load pretrained weights, each rank its own slices", exempt=True)
        load_pretrained_into(module, weights)
    _PARALLELIZED[module] = parallel
    if parallel.pipeline is not None:
        parallel.pipeline.activation_meter = SavedActivationMeter
    return parallel, True


def _check_same_layout(existing: ParallelModel, dims: ParallelDims, config: ParallelConfig) -> None:
    if (existing.dims.shape, existing.config.zero) != (dims.shape, config.zero):
        old = existing.dims
        raise ValueError(
            "This module was already parallelized by another ParaStrategy with a different layout"
            f" (pp={old.pp}, dp={old.dp}, tp={old.tp}, ep={old.ep}, cp={old.cp}, dp_replicate={old.dp_replicate},"
            f" zero={existing.config.zero}). Create a new module instance (or load a checkpoint into one) for a new layout."
        )


def materialize(module: nn.Module, device: torch.device) -> None:
    """Meta parameters (``init_module(empty_init=True)``) allocated on ``device`` and reset by each submodule's
    ``reset_parameters`` (seeded: every rank gets the same values); the rest moved there."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to_empty(device=device)  # on the root: shared parameters stay shared
        missing = set()
        for sub in module.modules():
            if next(iter((*sub.parameters(recurse=False), *sub.buffers(recurse=False))), None) is None:
                continue
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                missing.add(type(sub).__name__)
        if missing:
            warnings.warn(
                "Parameter initialization incomplete: these modules' parameters or buffers hold uninitialized memory"
                f" because they define no `reset_parameters()`: {', '.join(sorted(missing))}"
            )
    module.to(device)


__all__ = ["materialize", "parallel_model_of"]
