"""Runs this rank's pipeline stages for each Lightning step, and measures them.

:class:`PipelineRunner` replaces ``training_step``/``validation_step``/``test_step``/
``predict_step`` under ``pp > 1`` (the strategy routes each step to :meth:`PipelineRunner.run`):

* training: torch's schedule runs forward *and* backward over the m microbatches; the loss
  function it calls is the user's times ``scale / (m * A)`` (fp16 loss scale, accumulation),
  so gradients equal one device's. They are set aside until ``ParaStrategy.backward`` (Lightning
  calls ``zero_grad`` in between) and synchronised over dp once, then. Under ZeRO-2 with
  ``zero_accumulation="reduce_each_microbatch"`` each stage's gradients are reduce-scattered after
  each of its microbatch backwards instead, and their summed shards are set aside the same way;
* the mean loss is all-reduced from the last stage to every pipeline rank, returned and
  logged as ``train_loss`` with ``sync_dist=True`` (the global batch's mean over dp, the same
  value on every rank), so progress bar, loggers and ``ModelCheckpoint(monitor=...)`` work;
  MoE layers (``lightning_para.moe``) in any stage send their aux-loss values in the same
  all-reduce, logged separately as ``train_aux_loss`` (as the MoE recipe logs it under pp=1);
  their aux gradients are scaled by the same ``scale / (m * A)``;
* validate/test/predict run a forward-only pipeline.

Why this module is long: the runner is where Lightning's step order (``training_step``, then
``zero_grad``, then ``backward``) meets a schedule that runs forward and backward at once, so the
losses, the gradients set aside, data parallelism's sync policy and the per-step measurements
share one object's state; the schedules and measurements themselves live in their own modules.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch.distributed.device_mesh import DeviceMesh

from lightning_para._dtensor import full_tensor
from lightning_para.moe import aux_loss, aux_loss_grad_scale, moe_layers, set_aux_loss_grad_scale
from lightning_para.parallel.pipeline.measure import (
    PipelineStats,
    PipelineStepStats,
    SavedActivationMeter,
    StepRecorder,
    TimedPipelineStage,
)
from lightning_para.parallel.pipeline.build import build_schedule
from lightning_para.parallel.pipeline.schedules import expected_bubble
from lightning_para.parallel.pipeline.spec import PipelineSpec, PipelineStageModule
from lightning_para.parallel.tensor.loss import loss_parallel_backward, loss_parallel_step


class GradientSync(Protocol):
    """What the runner needs of data parallelism (``lightning_para.parallel.data.DataParallel``):
    skip sync over the schedule, then sync once."""

    sync_enabled: bool
    reduces_each_microbatch: bool

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def sync_now(self) -> None: ...

    def each_microbatch(self) -> contextlib.AbstractContextManager[None]: ...

    def reduce_part(self, part: int) -> None: ...

    def commit_microbatches(self) -> None: ...


@dataclass(frozen=True)
class StaticStageShapes:
    """The pipeline's stage metadata given up front, instead of torch's run-time shape inference.

    torch's ``PipelineStage`` otherwise votes across the pipeline on how to infer the stages' input and output
    shapes, reads the vote's result (``.item()``), and sends each stage's output metadata to the next rank: steps a
    run without tensor values (the dry run, on meta tensors under the fake process group) cannot take.

    ``activation()`` makes one microbatch's activation passed between stages (its shape, dtype and
    ``requires_grad`` are what counts: a meta tensor is enough); ``model_has_moe``: whether any stage of the whole
    model has MoE layers (otherwise read once from the first step's loss all-reduce). Every pipeline rank must be
    given the same (each skips the vote).
    """

    activation: Callable[[], Tensor]
    model_has_moe: bool


class PipelineRunner:
    """Runs this rank's stages through the schedule for each Lightning step; measures each step.

    ``stage_modules`` are what tensor parallelism, activation checkpointing and ZeRO apply to.
    """

    MAX_CACHED_SHAPES = 4  # schedules are built per input shape (stage buffers are shape-specific)

    def __init__(
        self, *, spec: PipelineSpec, pp_mesh: DeviceMesh, schedule: str, microbatches: int, virtual_stages: int,
        stage_modules: list[PipelineStageModule], placement: dict[int, int], layer_names: list[str],
        stage_of_layer: list[int], device: torch.device,
    ) -> None:
        self.spec, self.schedule = spec, schedule
        self.pp, self.pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.microbatches, self.virtual_stages = microbatches, virtual_stages
        self.stage_modules = stage_modules
        self.placement, self.layer_names, self.stage_of_layer = placement, layer_names, stage_of_layer
        self.device = device
        self.num_stages = self.pp * virtual_stages
        self.group = pp_mesh.get_group()
        self.own_stages = [m.stage_index for m in stage_modules]
        self.has_first = 0 in self.own_stages
        self.has_last = self.num_stages - 1 in self.own_stages
        self.last_rank = placement[self.num_stages - 1]
        self.measure_activations = False
        # Per-action timing (idle fraction, timeline): free on CPU; on an accelerator only when asked
        # (the profiler turns it on for the steps it samples), since reading device events waits once a step.
        self.measure_timing = device.type == "cpu"
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.recorder = StepRecorder(device, enabled=self.measure_timing, rank=rank)
        self._eval_recorder = StepRecorder(device, enabled=False)
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._pending_grads: Optional[list[Optional[Tensor]]] = None
        self._reducing: Optional[GradientSync] = None  # data parallelism reducing each microbatch, during a schedule
        self._history: list[PipelineStepStats] = []
        self._raw_losses: list[Tensor] = []
        self._loss_factor = 1.0
        self._model_has_moe: Optional[bool] = None  # any stage (not only this rank's) has MoE layers
        self.loss_parallel = False  # set by `enable_loss_parallel` once tensor parallelism shards the head
        self.sequence_multiple = 1  # set by `require_sequence_multiple` under sequence parallelism
        self.static_shapes: Optional[StaticStageShapes] = None  # set by `use_static_shapes`
        self._action_observers: list[Callable[[str, int, int], None]] = []

    @property
    def inferring_shapes(self) -> bool:
        """A stage runs torch's shape inference now (its inputs are placeholders, not the batch's values)."""
        return self.recorder.inferring

    def enable_loss_parallel(self) -> None:
        """The last stage's logits are vocab-sharded DTensors (tensor parallelism): its loss runs loss-parallel."""
        self.loss_parallel = True

    def require_sequence_multiple(self, tp: int) -> None:
        """Sequence parallelism splits the sequence (dim 1 of the first-stage input) over ``tp``: every
        pipeline rank checks each batch before the schedule, so a bad length cannot leave a stage waiting."""
        self.sequence_multiple = tp

    def use_static_shapes(self, shapes: StaticStageShapes) -> None:
        """Give the stages' metadata up front (:class:`StaticStageShapes`): the schedule skips torch's run-time
        shape inference and its start-up exchange."""
        self.static_shapes = shapes
        self._model_has_moe = shapes.model_has_moe
        self._schedules.clear()

    def add_action_observer(self, observer: Callable[[str, int, int], None]) -> None:
        """Call ``observer(action, stage_index, microbatch)`` after each of this rank's schedule actions
        (``"F"`` forward, ``"L"`` the last stage's loss, ``"B"`` full backward, ``"I"``/``"W"`` the input/weight
        halves of a split one)."""
        self._action_observers.append(observer)

    def _after_action(self, action: str, stage_index: int, microbatch: int) -> None:
        for observer in self._action_observers:
            observer(action, stage_index, microbatch)

    # ---------------------------------------------------------------- Lightning steps
    def run(
        self, step_name: str, module: nn.Module, batch: Any, *, loss_scale: float = 1.0,
        gradient_sync: Optional[GradientSync] = None, accumulate: Optional[int] = None,
    ) -> Any:
        """Run one Lightning step (``training_step``, ``validation_step``, ...) of ``module`` through the pipeline.

        ``loss_scale`` is the fp16 loss scale the backward starts from (1 without loss scaling);
        ``gradient_sync`` is data parallelism, kept from syncing until :meth:`finish_backward`;
        ``accumulate``: the micro-steps whose gradients are summed before the optimizer steps (each
        gets 1/accumulate of the loss); ``None``: the module's Trainer's ``accumulate_grad_batches``.
        """
        if step_name == "training_step":
            return self._train_step(module, batch, loss_scale, gradient_sync, accumulate)
        if step_name in ("validation_step", "test_step"):
            return self._eval_step(module, batch, "val" if step_name == "validation_step" else "test")
        if step_name == "predict_step":
            return self._predict_step(batch)
        raise ValueError(f"The pipeline cannot run `{step_name}`.")

    def _train_step(
        self, module: Any, batch: Any, loss_scale: float, gradient_sync: Optional[GradientSync], accumulate: Optional[int]
    ) -> Tensor:
        inputs, targets = self._split(batch)
        trainer = getattr(module, "_trainer", None)
        if accumulate is None:
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        # Gradients of the batch mean, of 1/A of it under accumulation, times the fp16 loss scale:
        # exactly what Lightning's backward of `loss / A * scale` gives on one device.
        self._loss_factor = aux_loss_grad_scale(
            loss_scale=loss_scale, accumulate=accumulate, microbatches=self.microbatches
        )
        for stage in self.stage_modules:  # MoE layers feed their aux-loss gradient in backward, scaled like the loss
            set_aux_loss_grad_scale(stage, self._loss_factor)
        self._raw_losses = []
        schedule = self._schedule_for("train", inputs)
        params = self._trainable_params()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        meter = SavedActivationMeter(exclude=params) if self.measure_activations else contextlib.nullcontext()
        # Data-parallel sync happens once, in `finish_backward`, not after every microbatch; or, under
        # "reduce_each_microbatch", after each stage's backward of each microbatch (`_after_weight_gradients`).
        if gradient_sync is None:
            sync_policy = contextlib.nullcontext()
        elif gradient_sync.reduces_each_microbatch:
            sync_policy = self._reducing_each_microbatch(gradient_sync)
        else:
            sync_policy = gradient_sync.no_sync()
        with sync_policy, meter, self._step_contexts():
            self.recorder.enabled = self.measure_timing
            self.recorder.start_step()
            schedule.step(
                *(inputs if self.has_first else ()), target=targets if self.has_last else None, return_outputs=False
            )
        # The loss all-reduce ends the step on every pipeline rank at once, so each rank's idle
        # time includes waiting for the slowest stage to drain: the bubble of the papers' formulas.
        loss, aux = self._share_train_losses(self._mean(self._raw_losses), self._moe_aux_loss())
        wall = self.recorder.end_step()
        # Set this step's gradients aside: Lightning calls zero_grad between training_step and
        # backward; `finish_backward` adds them to `.grad` afterwards. (Under ZeRO-0 the previous
        # step's gradients stay alive during the schedule, as Lightning's semantics need.)
        self._pending_grads = [p.grad for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        if wall is not None:
            self._record_step(wall, meter)
        # One meaning on every layout: the LM loss of the global batch (mean over dp); the MoE aux apart.
        self._log(module, "train", loss, prog_bar=True, sync_dist=True)
        if aux is not None:
            self._log(module, "train_aux", aux, sync_dist=True)
        if trainer is not None and wall is not None:
            module.log("pipeline/idle_fraction", self._history[-1].idle_fraction, on_step=True)
        return loss

    def finish_backward(self, gradient_sync: Optional[GradientSync] = None) -> None:
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
        if gradient_sync is not None and gradient_sync.reduces_each_microbatch:
            gradient_sync.commit_microbatches()  # reduced during the schedule; summed shards join `.grad` now
        elif gradient_sync is not None and gradient_sync.sync_enabled:
            gradient_sync.sync_now()

    @contextlib.contextmanager
    def _reducing_each_microbatch(self, gradient_sync: GradientSync) -> Any:
        previous, self._reducing = self._reducing, gradient_sync
        try:
            with gradient_sync.each_microbatch():
                yield
        finally:
            self._reducing = previous

    def _after_weight_gradients(self, part: int) -> None:
        """A microbatch's weight gradients of this rank's stage ``part`` are complete (``TimedPipelineStage``)."""
        if self._reducing is not None:
            self._reducing.reduce_part(part)

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
        outputs = torch.cat([full_tensor(o) for o in last.output_chunks]) if last is not None else None
        box = [outputs]
        dist.broadcast_object_list(box, group=self.group, group_src=self.last_rank)
        return box[0]

    def _run_forward_only(self, inputs: tuple[Tensor, ...]) -> Optional[Any]:
        schedule = self._schedule_for("eval", inputs)
        self._eval_recorder.start_step()
        with self._step_contexts():
            schedule.step(*(inputs if self.has_first else ()), return_outputs=self.has_last)
        return next((s for s in schedule._stages if s.is_last), None)  # private: see docs/architecture.md

    def _step_contexts(self) -> contextlib.AbstractContextManager[None]:
        """The tensor-parallel step context (loss parallel on vocab-sharded logits), entered once:
        its torch-function mode must not nest, and only the last stage computes a loss."""
        return loss_parallel_step(self.loss_parallel)

    def _backward_context(self) -> Callable[[], Any]:
        return lambda: loss_parallel_backward(self.loss_parallel)

    # ---------------------------------------------------------------- helpers
    def _split(self, batch: Any) -> tuple[tuple[Tensor, ...], Any]:
        inputs, targets = self.spec.split_batch(batch)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if self.sequence_multiple > 1 and inputs[0].dim() > 1 and inputs[0].shape[1] % self.sequence_multiple:
            raise ValueError(
                f"sequence_parallel=True splits the sequence over tp={self.sequence_multiple}, but the sequence length"
                f" is {inputs[0].shape[1]} (the pipeline's first-stage input). Use sequence lengths that are multiples"
                f" of {self.sequence_multiple} (pad the batch), or set sequence_parallel=False."
            )
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
                backward_context=self._backward_context(), after_weight_gradients=partial(self._after_weight_gradients, i),
                after_action=self._after_action, **self._static_metadata(m.stage_index, inputs),
            )
            for i, m in enumerate(self.stage_modules)
        ]
        loss_fn = self._scaled_loss if mode == "train" else None
        self._schedules[key] = build_schedule(self.schedule, stages, self.microbatches, loss_fn)
        while len(self._schedules) > self.MAX_CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return self._schedules[key]

    def _static_metadata(self, stage_index: int, inputs: tuple[Tensor, ...]) -> dict[str, Any]:
        """A stage's example input and output (one microbatch's) when the shapes are static, for torch's stage."""
        if self.static_shapes is None:
            return {}
        activation = self.static_shapes.activation
        first = tuple(t.tensor_split(self.microbatches)[0] for t in inputs)  # torch's split along dim 0
        # The last stage's output goes to the loss, not to a rank: torch neither sends nor checks it.
        return {"input_args": first if stage_index == 0 else (activation(),), "output_args": (activation(),),
                "static_metadata": True}

    def _scaled_loss(self, outputs: Any, targets: Any) -> Tensor:
        if self.recorder.inferring:  # torch's shape inference, not a microbatch of this step
            return self.spec.loss_fn(outputs, targets) * self._loss_factor
        microbatch = len(self._raw_losses)
        with self.recorder.action(self.num_stages - 1, microbatch, "L"):
            loss = self.spec.loss_fn(outputs, targets)
            self._raw_losses.append(full_tensor(loss.detach()))
            scaled = loss * self._loss_factor
        self._after_action("L", self.num_stages - 1, microbatch)
        return scaled

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
        return torch.stack([full_tensor(loss).float() for loss in losses]).mean()

    def _moe_aux_loss(self) -> Optional[Tensor]:
        """This rank's MoE aux-loss values (each layer's mean over the microbatches), if it has MoE layers:
        ``loss_fn`` sees only the last stage, the aux losses live in every stage (``lightning_para.moe``)."""
        if not any(True for stage in self.stage_modules for _ in moe_layers(stage)):
            return None
        return sum(aux_loss(stage).to(device=self.device, dtype=torch.float32) for stage in self.stage_modules)

    def _share_from_last(self, loss: Tensor) -> Tensor:
        """The last stage's loss on every pipeline rank (the others add an exact 0.0)."""
        loss = loss.detach().to(device=self.device, dtype=torch.float32).clone()
        if not self.has_last:
            loss.zero_()
        dist.all_reduce(loss, group=self.group)
        return loss

    def _share_train_losses(self, loss: Tensor, aux: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """In one all-reduce over pp: the last stage's loss, the sum of every stage's MoE aux losses, and
        whether any stage has MoE layers (``None`` for the aux loss when none has)."""
        values = torch.zeros(3, dtype=torch.float32, device=self.device)
        if self.has_last:
            values[0] = loss.detach().float()
        if aux is not None:
            values[1] = aux.detach().float()
            values[2] = 1.0
        dist.all_reduce(values, group=self.group)
        if self._model_has_moe is None:  # the layout is fixed: read (and synchronise on) the flag once
            self._model_has_moe = bool(values[2] > 0)
        return values[0], (values[1] if self._model_has_moe else None)

    def _log(self, module: Any, prefix: str, loss: Tensor, **kwargs: Any) -> None:
        if self.spec.log_name is not None and getattr(module, "_trainer", None) is not None:
            module.log(f"{prefix}_{self.spec.log_name}", loss, **kwargs)

    # ---------------------------------------------------------------- measurement
    def _record_step(self, wall: float, meter: Any) -> None:
        busy = self.recorder.busy_time
        entry = PipelineStepStats(
            step_time_s=wall,
            busy_time_s=busy,
            idle_time_s=max(wall - busy, 0.0),
            idle_fraction=max(wall - busy, 0.0) / wall if wall > 0 else 0.0,
            step_start_unix=self.recorder.step_start_unix,
            events=tuple(self.recorder.events),
            peak_saved_activation_bytes=meter.peak_bytes if isinstance(meter, SavedActivationMeter) else None,
        )
        self._history.append(entry)
        del self._history[:-64]  # a bounded history; `stats()` summarizes it

    def stats(self) -> PipelineStats:
        """This rank's pipeline layout and its last training step's busy/idle time and action events
        (:class:`~lightning_para.parallel.pipeline.measure.PipelineStats`).

        Timing is recorded while :attr:`measure_timing` is on (always on CPU).
        """
        history = self._history
        warm = history[1:] if len(history) > 1 else history
        return PipelineStats(
            schedule=self.schedule,
            pp=self.pp,
            pp_rank=self.pp_rank,
            virtual_stages=self.virtual_stages,
            microbatches=self.microbatches,
            stages=list(self.own_stages),
            stage_layers={m.stage_index: list(m.layer_names) for m in self.stage_modules},
            expected_idle_fraction=expected_bubble(self.schedule, self.pp, self.microbatches, self.virtual_stages),
            steps=len(history),
            mean_idle_fraction=sum(h.idle_fraction for h in warm) / len(warm) if warm else None,
            last_step=history[-1] if history else None,
        )

    # ---------------------------------------------------------------- checkpoints
    def merge_param_group_names(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Optimizer param groups with the parameter names of *every* stage, in layer order.

        Each rank's optimizer holds only its stages' parameters; a checkpoint's groups must name
        the whole model's so consolidation numbers all of them (collective over ``pp``).
        """
        gathered: list[Any] = [None] * self.pp
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


__all__ = ["GradientSync", "PipelineRunner", "StaticStageShapes"]
