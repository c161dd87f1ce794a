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

The losses' sharing over the pipeline ranks is ``losses.py``; a checkpoint's per-stage handling
``checkpoint.py``; the schedules and measurements live in their own modules.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch.distributed.device_mesh import DeviceMesh

from lightning_para._dtensor import full_tensor
from lightning_para.moe import aux_loss_grad_scale, set_aux_loss_grad_scale
from lightning_para.parallel.pipeline.measure import PipelineStats, PipelineStepStats, StepRecorder, TimedPipelineStage, step_stats
from lightning_para.parallel.pipeline.build import build_schedule
from lightning_para.parallel.pipeline.contracts import GradientSync, StaticStageShapes
from lightning_para.parallel.pipeline.checkpoint import keep_own_stages, merge_param_group_names
from lightning_para.parallel.pipeline.losses import mean_loss, share_from_last, share_train_losses, stages_aux_loss
from lightning_para.spec.schedules import expected_bubble
from lightning_para.parallel.pipeline.spec import PipelineSpec, PipelineStageModule
from lightning_para.parallel.tensor.loss import loss_parallel_backward, loss_parallel_step


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
        # Parameters (excluded) -> a context manager with `peak_bytes`: the core engine gives `instrument`'s meter.
        self.activation_meter: Optional[Callable[[list[Tensor]], Any]] = None
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
        if self.measure_activations and self.activation_meter is None:
            raise RuntimeError("`measure_activations=True` needs `activation_meter` (instrument.SavedActivationMeter).")
        meter = self.activation_meter(params) if self.measure_activations else contextlib.nullcontext()
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
        return mean_loss(losses, self.device)

    def _moe_aux_loss(self) -> Optional[Tensor]:
        return stages_aux_loss(self.stage_modules, self.device)

    def _share_from_last(self, loss: Tensor) -> Tensor:
        return share_from_last(loss, has_last=self.has_last, group=self.group, device=self.device)

    def _share_train_losses(self, loss: Tensor, aux: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        shared, aux_sum, any_moe = share_train_losses(loss, aux, has_last=self.has_last, group=self.group,
                                                      device=self.device)
        if self._model_has_moe is None:  # the layout is fixed: read (and synchronise on) the flag once
            self._model_has_moe = bool(any_moe > 0)
        return shared, (aux_sum if self._model_has_moe else None)

    def _log(self, module: Any, prefix: str, loss: Tensor, **kwargs: Any) -> None:
        if self.spec.log_name is not None and getattr(module, "_trainer", None) is not None:
            module.log(f"{prefix}_{self.spec.log_name}", loss, **kwargs)

    # ---------------------------------------------------------------- measurement
    def _record_step(self, wall: float, meter: Any) -> None:
        self._history.append(step_stats(wall, self.recorder, meter))
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
        """Optimizer param groups naming every stage's parameters (collective over ``pp``; see
        :func:`~lightning_para.parallel.pipeline.checkpoint.merge_param_group_names`)."""
        return merge_param_group_names(groups, self.layer_names, pp=self.pp, group=self.group)

    def check_full_checkpoint(self, checkpoint: dict[str, Any], has_optimizers: bool) -> None:
        """Keep a single-file checkpoint's weights of this rank's stages; refuse its optimizer state."""
        keep_own_stages(checkpoint, has_optimizers, self.stage_modules, self.layer_names)


__all__ = ["GradientSync", "PipelineRunner", "StaticStageShapes"]
