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

:class:`PipelineRunner` then replaces ``training_step``/``validation_step``/``test_step``/
``predict_step``: it runs torch's schedule over the microbatches (forward *and* backward when
training), returns the mean loss on every rank of the pipeline (all-reduced from the last
stage) and logs it as ``train_loss``/``val_loss``/``test_loss``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.pipeline_schedules import (
    SavedActivationMeter,
    StepRecorder,
    TimedPipelineStage,
    build_schedule,
    expected_bubble,
    stage_to_rank,
    validate_pipeline_config,
)

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


def apply_pipeline_parallel(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> "PipelineRunner":
    """Split ``module`` into pipeline stages, keep only this rank's, and return their runner.

    Raises ``ValueError`` (before any send/recv) if the module lacks the contract, has fewer
    layers than stages, or ties parameters across stages.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module

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


# ----------------------------------------------------------------------------- the runner
class PipelineRunner:
    """Runs this rank's stages through the schedule for each Lightning step; measures each step.

    ``stage_modules`` are what tensor parallelism, activation checkpointing and ZeRO apply to.
    """

    MAX_CACHED_SHAPES = 4  # schedules are built per input shape (stage buffers are shape-specific)

    def __init__(
        self, *, spec: PipelineSpec, dims: ParallelDims, schedule: str, microbatches: int, virtual_stages: int,
        stage_modules: list[PipelineStageModule], placement: dict[int, int], layer_names: list[str],
        stage_of_layer: list[int], device: torch.device,
    ) -> None:
        self.spec, self.dims, self.schedule = spec, dims, schedule
        self.microbatches, self.virtual_stages = microbatches, virtual_stages
        self.stage_modules = stage_modules
        self.placement, self.layer_names, self.stage_of_layer = placement, layer_names, stage_of_layer
        self.device = device
        self.num_stages = dims.pp * virtual_stages
        self.group = dims.group("pp")
        self.own_stages = [m.stage_index for m in stage_modules]
        self.has_first = 0 in self.own_stages
        self.has_last = self.num_stages - 1 in self.own_stages
        self.last_rank = placement[self.num_stages - 1]
        self.measure_activations = False
        sync = None if device.type == "cpu" else (lambda: torch.get_device_module(device.type).synchronize(device))
        self.recorder = StepRecorder(sync)
        self._eval_recorder = StepRecorder()
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._pending_grads: Optional[list[Optional[Tensor]]] = None
        self._history: list[dict[str, Any]] = []
        self._raw_losses: list[Tensor] = []
        self._loss_factor = 1.0

    # ---------------------------------------------------------------- Lightning steps
    def run(self, strategy: Any, step_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run one Lightning step (``training_step``, ``validation_step``, ...) through the pipeline."""
        batch = args[0] if args else kwargs["batch"]
        module = strategy.lightning_module
        if step_name == "training_step":
            return self._train_step(strategy, module, batch)
        if step_name in ("validation_step", "test_step"):
            return self._eval_step(module, batch, "val" if step_name == "validation_step" else "test")
        if step_name == "predict_step":
            return self._predict_step(batch)
        raise ValueError(f"The pipeline cannot run `{step_name}`.")

    def _train_step(self, strategy: Any, module: Any, batch: Any) -> Tensor:
        inputs, targets = self._split(batch)
        trainer = getattr(module, "_trainer", None)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        precision = strategy.precision_plugin
        scale = precision.scale if precision.uses_loss_scaling else 1.0
        # Gradients of the batch mean, of 1/A of it under accumulation, times the fp16 loss scale:
        # exactly what Lightning's backward of `loss / A * scale` gives on one device.
        self._loss_factor = scale / (self.microbatches * accumulate)
        self._raw_losses = []
        schedule = self._schedule_for("train", inputs)
        params = self._trainable_params()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        zero = strategy._parallel.zero if strategy._parallel is not None else None
        meter = SavedActivationMeter(exclude=params) if self.measure_activations else contextlib.nullcontext()
        # Data-parallel sync happens once, in `finish_backward`, not after every microbatch.
        with zero.no_sync() if zero is not None else contextlib.nullcontext(), meter, self._step_contexts():
            self.recorder.start_step()
            schedule.step(
                *(inputs if self.has_first else ()), target=targets if self.has_last else None, return_outputs=False
            )
        # The loss all-reduce ends the step on every pipeline rank at once, so each rank's idle
        # time includes waiting for the slowest stage to drain: the bubble of the papers' formulas.
        loss = self._share_from_last(self._mean(self._raw_losses))
        wall = self.recorder.end_step()
        # Set this step's gradients aside: Lightning calls zero_grad between training_step and
        # backward; `finish_backward` adds them to `.grad` afterwards.
        self._pending_grads = [p.grad for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        self._record_step(wall, meter)
        self._log(module, "train", loss, prog_bar=True)
        if trainer is not None:
            module.log("pipeline/idle_fraction", self._history[-1]["idle_fraction"], on_step=True)
        return loss

    def finish_backward(self, zero: Any) -> None:
        """Called by ``ParaStrategy.backward``: add this step's gradients to ``.grad``, then sync over dp."""
        pending, self._pending_grads = self._pending_grads, None
        if pending is None:
            raise RuntimeError("finish_backward() without a pipeline training step before it.")
        for p, g in zip(self._trainable_params(), pending):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        if zero is not None and zero.sync_enabled:
            zero.sync_now()

    def _eval_step(self, module: Any, batch: Any, prefix: str) -> Tensor:
        inputs, targets = self._split(batch)
        last = self._run_forward_only(inputs)
        if last is not None:
            chunks = targets.tensor_split(self.microbatches)
            with self._step_contexts():
                losses = [self.spec.loss_fn(out, tgt).detach() for out, tgt in zip(last.output_chunks, chunks)]
            loss = self._mean(losses)
        else:
            loss = self._mean([])
        loss = self._share_from_last(loss)
        self._log(module, prefix, loss, sync_dist=True)
        return loss

    def _predict_step(self, batch: Any) -> Any:
        inputs, _ = self._split(batch)
        last = self._run_forward_only(inputs)
        outputs = torch.cat([_plain(o) for o in last.output_chunks]) if last is not None else None
        box = [outputs]
        dist.broadcast_object_list(box, group=self.group, group_src=self.last_rank)
        return box[0]

    def _run_forward_only(self, inputs: tuple[Tensor, ...]) -> Optional[Any]:
        schedule = self._schedule_for("eval", inputs)
        self._eval_recorder.start_step()
        with self._step_contexts():
            schedule.step(*(inputs if self.has_first else ()), return_outputs=self.has_last)
        return next((s for s in schedule._stages if s.is_last), None)

    def _step_contexts(self) -> contextlib.ExitStack:
        """The tensor-parallel step context (loss parallel on vocab-sharded logits), entered once:
        its torch-function mode must not nest, and only the last stage computes a loss."""
        stack = contextlib.ExitStack()
        tensor_parallel = _tensor_parallel()
        if tensor_parallel is not None:
            stack.enter_context(tensor_parallel.step_context(self.stage_modules[-1]))
        return stack

    @staticmethod
    def _backward_context(module: nn.Module) -> Callable[[], Any]:
        tensor_parallel = _tensor_parallel()
        if tensor_parallel is None:
            return contextlib.nullcontext
        return lambda: tensor_parallel.backward_context(module)

    # ---------------------------------------------------------------- helpers
    def _split(self, batch: Any) -> tuple[tuple[Tensor, ...], Any]:
        inputs, targets = self.spec.split_batch(batch)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        size = inputs[0].shape[0]
        if size % self.microbatches:
            raise ValueError(
                f"A batch of {size} samples cannot be split into microbatches={self.microbatches} equal parts."
                f" Use a batch size that is a multiple of {self.microbatches}, and `drop_last=True` in the DataLoader"
                " so the last batch is not smaller."
            )
        return inputs, targets

    def _schedule_for(self, mode: str, inputs: tuple[Tensor, ...]) -> Any:
        key = (mode, *((tuple(t.shape), t.dtype) for t in inputs if isinstance(t, Tensor)))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        recorder = self.recorder if mode == "train" else self._eval_recorder
        stages = [
            TimedPipelineStage(
                m, m.stage_index, self.num_stages, self.device, group=self.group, recorder=recorder,
                backward_context=self._backward_context(m),
            )
            for m in self.stage_modules
        ]
        loss_fn = self._scaled_loss if mode == "train" else None
        self._schedules[key] = build_schedule(self.schedule, stages, self.microbatches, loss_fn)
        while len(self._schedules) > self.MAX_CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return self._schedules[key]

    def _scaled_loss(self, outputs: Any, targets: Any) -> Tensor:
        if self.recorder.inferring:  # torch's shape inference, not a microbatch of this step
            return self.spec.loss_fn(outputs, targets) * self._loss_factor
        with self.recorder.action(self.num_stages - 1, len(self._raw_losses), "L"):
            loss = self.spec.loss_fn(outputs, targets)
            self._raw_losses.append(_plain(loss.detach()))
            return loss * self._loss_factor

    def _trainable_params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.stage_modules:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _mean(self, losses: list[Tensor]) -> Tensor:
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack([_plain(loss).float() for loss in losses]).mean()

    def _share_from_last(self, loss: Tensor) -> Tensor:
        """The last stage's loss on every pipeline rank (the others add an exact 0.0)."""
        loss = loss.detach().to(device=self.device, dtype=torch.float32).clone()
        if not self.has_last:
            loss.zero_()
        dist.all_reduce(loss, group=self.group)
        return loss

    def _log(self, module: Any, prefix: str, loss: Tensor, **kwargs: Any) -> None:
        if self.spec.log_name is not None and getattr(module, "_trainer", None) is not None:
            module.log(f"{prefix}_{self.spec.log_name}", loss, **kwargs)

    # ---------------------------------------------------------------- measurement
    def _record_step(self, wall: float, meter: Any) -> None:
        busy = self.recorder.busy_time
        entry = {
            "step_time_s": wall,
            "busy_time_s": busy,
            "idle_time_s": max(wall - busy, 0.0),
            "idle_fraction": max(wall - busy, 0.0) / wall if wall > 0 else 0.0,
            "step_start_unix": self.recorder.step_start_unix,
            "events": list(self.recorder.events),
        }
        if isinstance(meter, SavedActivationMeter):
            entry["peak_saved_activation_bytes"] = meter.peak_bytes
        self._history.append(entry)
        del self._history[:-64]  # a bounded history; `stats()` summarizes it

    def stats(self) -> dict[str, Any]:
        """This rank's pipeline layout and its last training step's busy/idle time and action events.

        ``idle_time_s = step_time_s - busy_time_s``: waiting on sends/receives (and the
        schedule's own bookkeeping), up to the loss all-reduce that ends the step on all pipeline
        ranks together -- so it is the bubble the formulas describe; ``mean_idle_fraction`` averages the recorded steps after
        the first (which also infers shapes). ``events`` is described in
        :class:`~lightning_para.parallel.pipeline_schedules.StepRecorder`.
        """
        history = self._history
        warm = history[1:] if len(history) > 1 else history
        result: dict[str, Any] = {
            "schedule": self.schedule,
            "pp": self.dims.pp,
            "pp_rank": self.dims.local_rank("pp"),
            "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches,
            "stages": list(self.own_stages),
            "stage_layers": {m.stage_index: list(m.layer_names) for m in self.stage_modules},
            "expected_idle_fraction": expected_bubble(self.schedule, self.dims.pp, self.microbatches, self.virtual_stages),
            "steps": len(history),
            "mean_idle_fraction": sum(h["idle_fraction"] for h in warm) / len(warm) if warm else None,
        }
        if history:
            result.update(history[-1])
        return result

    # ---------------------------------------------------------------- checkpoints
    def merge_param_group_names(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Optimizer param groups with the parameter names of *every* stage, in layer order.

        Each rank's optimizer holds only its stages' parameters; a checkpoint's groups must name
        the whole model's so consolidation numbers all of them (collective over ``pp``).
        """
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, [list(g["params"]) for g in groups], group=self.group)
        by_length = sorted(enumerate(self.layer_names), key=lambda item: -len(item[1]))

        def layer_index(name: str) -> int:
            return next((i for i, layer in by_length if name == layer or name.startswith(layer + ".")), -1)

        merged = []
        for gi, group in enumerate(groups):
            names: list[str] = []
            for per_rank in gathered:
                names.extend(n for n in per_rank[gi] if n not in names)
            merged.append({**group, "params": sorted(names, key=layer_index)})  # stable: keeps in-layer order
        return merged

    def check_full_checkpoint(self, checkpoint: dict[str, Any], has_optimizers: bool) -> None:
        """Keep a single-file checkpoint's weights of this rank's stages; refuse its optimizer state."""
        if has_optimizers and checkpoint.get("optimizer_states"):
            raise ValueError(
                "Resuming a pipeline-parallel run needs a sharded checkpoint directory (the default"
                " `save_distributed_checkpoint=True`): a single-file checkpoint numbers optimizer state over the"
                " whole model, and no pipeline rank holds the whole model to map those numbers to parameters."
            )
        held = {name for m in self.stage_modules for name, _ in m.named_parameters()}
        others = set(self.layer_names) - {n for m in self.stage_modules for n in m.layer_names}
        state = checkpoint["state_dict"]
        for key in list(state):
            if key not in held and any(key.startswith(layer + ".") for layer in others):
                del state[key]

    def grad_copies(self, param: Tensor) -> int:
        """On how many pipeline ranks a parameter's gradient lives: always one (tied weights across stages are rejected)."""
        return 1


def _tensor_parallel() -> Any:
    try:
        from lightning_para.parallel import tensor_parallel
    except ImportError:  # a build without tensor parallelism
        return None
    return tensor_parallel


def _plain(t: Tensor) -> Tensor:
    """A full plain tensor (a DTensor loss or logits under tensor parallelism is gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


__all__ = [
    "PipelineRunner",
    "PipelineSpec",
    "PipelineStageModule",
    "apply_pipeline_parallel",
    "balanced_split",
    "explicit_split",
    "measure_layer_times",
    "named_layers_of",
    "pipeline_spec_of",
]
