"""Pipeline parallelism for any LightningModule that states its layers, batch split and loss.

The contract (see ``docs/pipeline_parallel.md``)::

    class MyModel(L.LightningModule):
        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(
                layers=[self.embed, *self.blocks, self.head],   # submodules, in execution order
                split_batch=lambda batch: (batch["x"], batch["y"]),  # -> (stage-0 inputs, last-stage targets)
                loss_fn=lambda logits, y: F.cross_entropy(logits, y),  # mean loss of one microbatch
            )

Each layer is called as ``x = layer(x)``. :func:`apply_pipeline_parallel` splits the layer
list into ``pp * virtual_stages`` contiguous stages (balanced by parameter count, by measured
time, or at explicit indices), places them on the ``pp`` ranks the way the schedule wants,
and *removes every other stage's layers from this rank's module*, so a rank holds only its
own stages. The kept layers keep their names (``blocks.3.mlp.weight`` stays that), so
checkpoints stay layout-independent: a pp=2 checkpoint loads into pp=1 and back.

The returned :class:`~lightning_para.parallel.pipeline_runner.PipelineRunner` then runs each
Lightning step through torch's schedule. Modules of this feature:

* ``pipeline_parallel`` (here): the contract, the split, keeping only this rank's stages;
* ``pipeline_runner``: Lightning steps through the schedule, losses, gradients, stats;
* ``pipeline_schedules``: the schedule registry, validation, action orders, bubble formulas;
* ``pipeline_measure``: per-action clocks and saved-activation bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.pipeline_schedules import stage_to_rank, validate_pipeline_config

if TYPE_CHECKING:
    from lightning_para.parallel.pipeline_runner import PipelineRunner

CONTRACT = (
    "A LightningModule trained with pp>1 must implement `configure_pipeline(self) -> lightning_para.PipelineSpec`:"
    " PipelineSpec(layers=[...submodules in execution order, each called as x = layer(x)...],"
    " split_batch=lambda batch: (stage0_inputs, last_stage_targets), loss_fn=lambda outputs, targets: mean_loss)."
    " See docs/pipeline_parallel.md."
)


@dataclass
class PipelineSpec:
    """How a LightningModule runs as a pipeline.

    Args:
        layers: submodules of the LightningModule in execution order (e.g. embedding, blocks,
            final norm + head); each is called as ``x = layer(x)`` (a tuple is unpacked into
            the next layer's arguments). Every trainable parameter must belong to one layer.
        split_batch: ``batch -> (inputs, targets)``: what the first layer takes and what the
            loss compares the last layer's output with. Both are split along dim 0 into
            microbatches.
        loss_fn: ``(outputs, targets) -> loss`` for one microbatch, a mean over its samples;
            the step's loss is the mean over microbatches (equal to the full batch's mean).
        example_input: a stage-0 input for ``pipeline_balance="time"`` (default: the module's
            ``example_input_array``).
        log_name: the loss is logged as ``train_<log_name>``, ``val_<log_name>`` and
            ``test_<log_name>``; ``None`` logs nothing.
    """

    layers: Sequence[nn.Module]
    split_batch: Callable[[Any], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    example_input: Optional[Any] = None
    log_name: Optional[str] = "loss"


# The LightningModule keeps its `training_step` (what pp=1 runs, and Lightning requires one);
# under pp>1 the pipeline runs instead of it and of validation/test/predict_step.


class PipelineStageModule(nn.Module):
    """The layers of one stage under their original names (``blocks.3`` stays ``blocks.3``).

    So a TP plan or FSDP unit written against the LightningModule's names applies to the
    stage unchanged. Layers are looked up by name at every call, so wrappers applied to this
    module later (activation checkpointing) take effect.
    """

    def __init__(self, stage_index: int, named_layers: Sequence[tuple[str, nn.Module]], source: nn.Module) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.layer_names = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for depth, part in enumerate(path):
                if part not in parent._modules:
                    original = source.get_submodule(".".join(path[: depth + 1]))
                    parent.add_module(part, _empty_like_container(original))
                parent = parent._modules[part]
            parent.add_module(leaf, layer)

    def forward(self, *args: Any) -> Any:
        x: Any = args if len(args) != 1 else args[0]
        for name in self.layer_names:
            layer = self.get_submodule(name)
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x


def _empty_like_container(module: nn.Module) -> nn.Module:
    """An empty container of the same kind: block lists stay ``nn.ModuleList`` (activation
    checkpointing and tensor-parallel plans look for them); anything else is a plain holder."""
    for kind in (nn.ModuleList, nn.Sequential, nn.ModuleDict):
        if isinstance(module, kind):
            return kind()
    return nn.Module()


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
def pipeline_spec_of(module: nn.Module) -> PipelineSpec:
    """Call the module's ``configure_pipeline()`` and check what it returns (``ValueError`` if wrong)."""
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise ValueError(f"`{type(module).__name__}` has no `configure_pipeline()`. {CONTRACT}")
    spec = hook()
    if not isinstance(spec, PipelineSpec):
        raise ValueError(f"`configure_pipeline()` returned {type(spec).__name__}, not a PipelineSpec. {CONTRACT}")
    if not callable(spec.split_batch) or not callable(spec.loss_fn):
        raise ValueError(f"`PipelineSpec.split_batch` and `PipelineSpec.loss_fn` must be callables. {CONTRACT}")
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            "Pipeline parallelism runs the backward inside the schedule, so it needs"
            " `automatic_optimization=True`; manual optimization cannot call backward on a loss no rank holds."
        )
    return spec


def named_layers_of(module: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name in module, layer)`` for each pipeline layer, checked to be distinct, non-nested submodules."""
    if not layers:
        raise ValueError(f"`PipelineSpec.layers` is empty. {CONTRACT}")
    names: dict[int, str] = {}
    for name, sub in module.named_modules():
        names.setdefault(id(sub), name)
    result: list[tuple[str, nn.Module]] = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module) or names.get(id(layer), "") == "":
            raise ValueError(
                f"`PipelineSpec.layers[{i}]` ({type(layer).__name__}) is not a submodule of the LightningModule."
                " Register each layer as an attribute (or in an nn.ModuleList) and list those objects."
            )
        result.append((names[id(layer)], layer))
    seen = [name for name, _ in result]
    for i, name in enumerate(seen):
        for j, other in enumerate(seen):
            if i != j and (name == other or other.startswith(name + ".")):
                raise ValueError(
                    f"`PipelineSpec.layers` lists `{name}` and `{other}`: each layer must appear once and not"
                    " contain another listed layer."
                )
    in_layers = {id(p) for _, layer in result for p in layer.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_layers]
    if outside:
        raise ValueError(
            f"Trainable parameters outside every pipeline layer: {outside[:8]}. Each parameter must belong to"
            " one layer of `configure_pipeline().layers` (its stage trains it); move them into a layer."
        )
    return result


def balanced_split(costs: Sequence[float], num_stages: int) -> list[int]:
    """Start index of each stage: contiguous parts minimizing the largest part's cost.

    Dynamic programming over (stages, prefix): O(num_stages * L^2), exact.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-cost splitting the first i layers into k stages; cut[k][i]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def explicit_split(split: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Normalize ``pipeline_split`` (where stages 1.. start; a leading 0 is allowed) to all starts."""
    starts = [int(s) for s in split]
    if len(starts) == num_stages - 1:
        starts = [0, *starts]
    ok = len(starts) == num_stages and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
    if not ok or starts[-1] >= num_layers:
        raise ValueError(
            f"`pipeline_split={list(split)}` must give the first layer index of stages 1..{num_stages - 1}"
            f" ({num_stages - 1} strictly increasing indices in 1..{num_layers - 1}) for {num_stages} stages"
            f" over {num_layers} layers."
        )
    return starts


def measure_layer_times(layers: Sequence[nn.Module], example: Any, repeats: int = 3) -> list[float]:
    """Forward seconds of each layer on ``example`` (the fastest of ``repeats`` runs).

    Backward costs about twice the forward of the same layer, so forward time ranks the layers.
    """
    import time

    best = [float("inf")] * len(layers)
    with torch.no_grad():
        for _ in range(repeats):
            x = example
            for i, layer in enumerate(layers):
                start = time.perf_counter()
                x = layer(*x) if isinstance(x, tuple) else layer(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _layer_costs(module: nn.Module, spec: PipelineSpec, layers: list[nn.Module], config: ParallelConfig, device: torch.device) -> list[float]:
    if config.pipeline_balance == "params":
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


def _stage_device(dims: ParallelDims) -> torch.device:
    device_type = dims.mesh.device_type if dims.mesh is not None else "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def apply_pipeline_parallel(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> PipelineRunner:
    """Split ``module`` into pipeline stages, keep only this rank's, and return their runner.

    Raises ``ValueError`` (before any send/recv) if the module lacks the contract, has fewer
    layers than stages, or ties parameters across stages.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module

    from lightning_para.parallel.pipeline_runner import PipelineRunner

    microbatches = validate_pipeline_config(dims.pp, config.schedule, config.microbatches, config.virtual_stages)
    spec = pipeline_spec_of(module)
    named = named_layers_of(module, spec.layers)
    num_stages = dims.pp * config.virtual_stages
    if len(named) < num_stages:
        raise ValueError(
            f"pp={dims.pp} x virtual_stages={config.virtual_stages} = {num_stages} stages, but"
            f" `configure_pipeline()` lists {len(named)} layers and every stage needs at least one."
            f" Lower pp or virtual_stages, or list the model in more (smaller) layers."
        )
    device = _stage_device(dims)
    layers = [layer for _, layer in named]
    if config.pipeline_split is not None:
        starts = explicit_split(config.pipeline_split, len(named), num_stages)
    else:
        starts = balanced_split(_layer_costs(module, spec, layers, config, device), num_stages)
    stage_of_layer = [max(s for s in range(num_stages) if starts[s] <= i) for i in range(len(named))]
    _reject_tied_across_stages(named, stage_of_layer)

    placement = stage_to_rank(config.schedule, dims.pp, config.virtual_stages)
    pp_rank = dims.local_rank("pp")
    own = [s for s in range(num_stages) if placement[s] == pp_rank]
    for (name, _), stage in zip(named, stage_of_layer):
        if stage not in own:
            _drop_layer(module, name, stage)
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
        spec=spec, dims=dims, schedule=config.schedule, microbatches=microbatches,
        virtual_stages=config.virtual_stages, stage_modules=stage_modules, placement=placement,
        layer_names=[n for n, _ in named], stage_of_layer=stage_of_layer, device=device,
    )


def _reject_tied_across_stages(named: list[tuple[str, nn.Module]], stage_of_layer: list[int]) -> None:
    owner: dict[int, tuple[str, int]] = {}
    for (name, layer), stage in zip(named, stage_of_layer):
        for pname, p in layer.named_parameters():
            first = owner.setdefault(id(p), (f"{name}.{pname}", stage))
            if first[1] != stage:
                raise ValueError(
                    f"`{first[0]}` (stage {first[1]}) and `{name}.{pname}` (stage {stage}) are the same tied"
                    " parameter on two pipeline stages; its two gradients would never meet. Untie them (e.g. give"
                    " the head its own weight), or choose `pipeline_split` so both layers share a stage."
                )


def _drop_layer(module: nn.Module, name: str, stage: int) -> None:
    """Replace every reference to the layer ``name`` inside ``module`` by a :class:`_DroppedLayer`."""
    layer = module.get_submodule(name)
    placeholder = _DroppedLayer(name, stage)
    for parent in module.modules():
        for child_name, child in list(parent._modules.items()):
            if child is layer:
                parent._modules[child_name] = placeholder


__all__ = [
    "PipelineSpec",
    "PipelineStageModule",
    "apply_pipeline_parallel",
    "balanced_split",
    "explicit_split",
    "measure_layer_times",
    "named_layers_of",
    "pipeline_spec_of",
]
