"""Splitting a LightningModule into pipeline stages and keeping this rank's (the entry point).

:func:`apply_pipeline_parallel` splits the layers of the module's
:class:`~lightning_para.parallel.pipeline.spec.PipelineSpec` into ``pp * virtual_stages``
contiguous stages (balanced by parameter count, by measured time, or at explicit indices),
places them on the ``pp`` ranks the way the schedule wants, and *removes every other stage's
layers from this rank's module*, so a rank holds only its own stages. The kept layers keep
their names (``blocks.3.mlp.weight`` stays that), so checkpoints stay layout-independent: a
pp=2 checkpoint loads into pp=1 and back.

The returned :class:`~lightning_para.parallel.pipeline.runner.PipelineRunner` then runs each
Lightning step through torch's schedule. The modules of this package:

* ``spec``: the contract (``PipelineSpec``) and the module holding one stage;
* ``split`` (here): the split, keeping only this rank's stages; ``spec/split.py``: where the stages start (pure);
* ``runner``: Lightning steps through the schedule, losses, gradients, stats;
* ``schedules``: the schedule registry, validation, action orders, bubble formulas (a leaf);
* ``measure``: per-action clocks and saved-activation bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module  # private: see docs/architecture.md
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_para._dtensor import parameter_owners
from lightning_para.parallel.pipeline.runner import PipelineRunner
from lightning_para.spec.schedules import stage_to_rank
from lightning_para.spec.split import balanced_split, explicit_split
from lightning_para.parallel.pipeline.spec import PipelineSpec, PipelineStageModule, named_layers_of, pipeline_spec_of


class _DroppedLayer(nn.Module):
    """Stands where another rank's layer was: keeps container indices, holds no memory."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.dropped_name, self.stage = name, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer `{self.dropped_name}` lives on pipeline stage {self.stage} of another rank. Under pp>1 the"
            " strategy runs the model through `configure_pipeline()`; do not call the module's forward directly."
        )

    def extra_repr(self) -> str:
        return f"{self.dropped_name!r} on stage {self.stage}"


# ----------------------------------------------------------------------------- the split
def measure_layer_times(layers: Sequence[nn.Module], example: Any, repeats: int = 3) -> list[float]:
    """Forward seconds of each layer on ``example`` (the fastest of ``repeats`` runs).

    Backward costs about twice the forward of the same layer, so forward time ranks the layers.
    """
    best = [float("inf")] * len(layers)
    with torch.no_grad():
        for _ in range(repeats):
            x = example
            for i, layer in enumerate(layers):
                start = time.perf_counter()
                x = layer(*x) if isinstance(x, tuple) else layer(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _layer_costs(module: nn.Module, spec: PipelineSpec, layers: list[nn.Module], balance: str, device: torch.device) -> list[float]:
    if balance == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    example = spec.example_input if spec.example_input is not None else getattr(module, "example_input_array", None)
    if example is None:
        raise ValueError(
            "`pipeline_balance='time'` times each layer on an example input: set `example_input` in the"
            " PipelineSpec or `self.example_input_array` on the LightningModule (a stage-0 input)."
        )
    if any(p.is_meta for p in module.parameters()):
        raise ValueError("`pipeline_balance='time'` needs real weights to time; create the model without empty_init.")
    module.to(device)
    example = tuple(t.to(device) for t in example) if isinstance(example, tuple) else example.to(device)
    times = torch.tensor(measure_layer_times(layers, example), dtype=torch.float64, device=device)
    if dist.is_initialized():
        # Timings are noisy per rank; every rank must cut at the same places, so average them.
        dist.all_reduce(times)
        times /= dist.get_world_size()
    return times.tolist()


def _stage_device(pp_mesh: DeviceMesh) -> torch.device:
    if pp_mesh.device_type in ("cpu", "meta"):  # meta: the dry run (lightning_para/simulate/) builds stages without memory
        return torch.device(pp_mesh.device_type)
    return torch.device(pp_mesh.device_type, torch.get_device_module(pp_mesh.device_type).current_device())


def apply_pipeline_parallel(
    module: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    microbatches: int,
    virtual_stages: int = 1,
    pipeline_split: Optional[Sequence[int]] = None,
    pipeline_balance: str = "params",
) -> PipelineRunner:
    """Split ``module`` into pipeline stages over the 1-D ``pp_mesh``, keep only this rank's, and
    return their runner. ``microbatches`` is the validated count
    (:func:`~lightning_para.spec.schedules.validate_pipeline_config`).

    Raises ``ValueError`` (before any send/recv) if the module lacks the contract, has fewer
    layers than stages, or ties parameters across stages.
    """
    pp = pp_mesh.size()
    spec = pipeline_spec_of(module)
    named = named_layers_of(module, spec.layers)
    num_stages = pp * virtual_stages
    if len(named) < num_stages:
        raise ValueError(
            f"pp={pp} x virtual_stages={virtual_stages} = {num_stages} stages, but"
            f" `configure_pipeline()` lists {len(named)} layers and every stage needs at least one."
            f" Lower pp or virtual_stages, or list the model in more (smaller) layers."
        )
    device = _stage_device(pp_mesh)
    layers = [layer for _, layer in named]
    if pipeline_split is not None:
        starts = explicit_split(pipeline_split, len(named), num_stages)
    else:
        starts = balanced_split(_layer_costs(module, spec, layers, pipeline_balance, device), num_stages)
    stage_of_layer = [max(s for s in range(num_stages) if starts[s] <= i) for i in range(len(named))]
    _reject_tied_across_stages(module, named, stage_of_layer)

    placement = stage_to_rank(schedule, pp, virtual_stages)
    pp_rank = pp_mesh.get_local_rank()
    own = [s for s in range(num_stages) if placement[s] == pp_rank]
    _drop_layers(module, {id(layer): _DroppedLayer(name, stage)
                          for (name, layer), stage in zip(named, stage_of_layer) if stage not in own})
    _materialize_distributed_module(module, device)  # only this rank's layers are left to build
    module.to(device)
    if getattr(module, "example_input_array", None) is not None:
        # No rank can run the whole module's forward now; Lightning's model summary (rank 0 only)
        # would try it with this input, raise, and leave the other ranks waiting.
        module.example_input_array = None
    stage_modules = [
        PipelineStageModule(s, [named[i] for i in range(len(named)) if stage_of_layer[i] == s], module) for s in own
    ]
    return PipelineRunner(
        spec=spec, pp_mesh=pp_mesh, schedule=schedule, microbatches=microbatches,
        virtual_stages=virtual_stages, stage_modules=stage_modules, placement=placement,
        layer_names=[n for n, _ in named], stage_of_layer=stage_of_layer, device=device,
    )


def _reject_tied_across_stages(module: nn.Module, named: list[tuple[str, nn.Module]], stage_of_layer: list[int]) -> None:
    stage_of = dict(zip((name for name, _ in named), stage_of_layer))

    def layer_of(fqn: str) -> Optional[str]:
        return next((n for n in stage_of if fqn == n or fqn.startswith(n + ".")), None)

    for owners in parameter_owners(module).values():
        placed = [(f"{fqn}.{pname}" if fqn else pname, stage_of[layer]) for fqn, pname in owners if (layer := layer_of(fqn))]
        for name, stage in placed[1:]:
            if stage != placed[0][1]:
                raise ValueError(
                    f"`{placed[0][0]}` (stage {placed[0][1]}) and `{name}` (stage {stage}) are the same tied"
                    " parameter on two pipeline stages; its two gradients would never meet. Untie them (e.g. give"
                    " the head its own weight), or choose `pipeline_split` so both layers share a stage."
                )


def _drop_layers(module: nn.Module, placeholders: dict[int, "_DroppedLayer"]) -> None:
    """Replace every reference inside ``module`` to each layer (by ``id``) in ``placeholders`` by its
    :class:`_DroppedLayer`, in one walk (a walk per layer is quadratic in depth)."""
    for parent in module.modules():  # a parent's children are replaced before the walk would enter them
        # private: see docs/architecture.md
        for child_name, child in list(parent._modules.items()):  # every name, duplicates included
            if id(child) in placeholders:
                setattr(parent, child_name, placeholders[id(child)])


__all__ = ["apply_pipeline_parallel", "balanced_split", "explicit_split", "measure_layer_times"]
