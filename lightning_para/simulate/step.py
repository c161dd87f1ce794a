"""One rank's training step on the meta device, driven through the engine's step and backward
(:class:`~lightning_para.core.ParaEngine`) as ``ParaStrategy`` drives them: context parallelism's chunks, the pipeline
runner and torch's schedule (the stages' shapes given up front, as meta tensors cannot carry torch's run-time shape
exchange) or the module's forward and loss under tensor parallelism's loss-parallel contexts, then the backward."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_para.core import ParaEngine
from lightning_para.instrument.live_bytes import LiveBytes
from lightning_para.moe import moe_layers
from lightning_para.parallel.pipeline import PipelineRunner
from lightning_para.parallel.pipeline.contracts import StaticStageShapes
from lightning_para.parallel.tensor.loss import causal_lm_loss
from lightning_para.parallelize import ParallelModel


def causal_lm_step_loss(logits: Any, tokens: Tensor) -> Tensor:
    """The loss of a model without ``loss_fn`` whose forward takes token ids and returns the logits (a
    transformers causal LM in a LightningModule, e.g. :class:`~lightning_para.recipes.HFCausalLM`):
    transformers' causal-LM loss (``ForCausalLMLoss``), labels = the tokens shifted inside, as ``model(labels=...)``
    computes it: position ``t`` predicts token ``t + 1``, the last position is ignored, the logits go to fp32."""
    logits = getattr(logits, "logits", logits)  # a transformers ModelOutput
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            "The dry run trains a model with a `loss_fn(logits, targets)` method, a `configure_pipeline()` (pp > 1),"
            " or whose forward(input_ids) returns (batch, seq, vocab) logits; this one returned"
            f" {type(logits).__name__}{tuple(logits.shape) if isinstance(logits, Tensor) else ''}."
        )
    return causal_lm_loss(logits, tokens, logits.shape[-1])


@dataclass
class StepPeaks:
    """What one step held: the activations at the most after a forward (this step's gradients and the stages'
    weights left out), the live peak when a pipeline's schedule ended and when the gradients were final, and the
    storages a later step does not make again (the stages' receive buffers)."""

    activations: float = 0.0
    schedule: int = 0
    backward: int = 0
    made_once: set[int] = field(default_factory=set)


def train_step(
    engine: ParaEngine, module: nn.Module, seq_len: int, micro_batch: int, hidden: int, live: LiveBytes,
    dtype: torch.dtype,
) -> StepPeaks:
    """Run this rank's forwards and backwards of one training step through ``engine``: under a pipeline the
    real :class:`~lightning_para.parallel.pipeline.runner.PipelineRunner` over the step's microbatches in its
    schedule's order, else one forward, loss and backward of the module as Lightning's ``training_step`` and
    ``backward`` run them; then the gradients are final (data parallelism's sync). ``dtype``: the activations'
    (a later pipeline stage receives its input in it)."""
    parallel = engine.parallel_model
    runner = parallel.pipeline
    tokens = torch.zeros(micro_batch * (runner.microbatches if runner else 1), seq_len, dtype=torch.long, device="meta")
    stages = list(runner.stage_modules) if runner is not None else [module]
    peaks, before = StepPeaks(), set(live.live)

    def after_forward() -> None:
        # ZeRO-3 keeps some units gathered from forward to backward (the last block, the head): weights, not
        # activations (the planner prices them with the gathered buffers); the stages' parameters are the gathered
        # tensors while they are. Gradients (accumulated, or summed shards) are not either. (Read after the forward:
        # FSDP2 registers the gathered tensors as the parameters while it keeps them.)
        if runner is not None and not peaks.made_once:  # what the schedule made before its first forward
            peaks.made_once.update(set(live.live) - before)
        weights = [p for s in stages for p in s.parameters()]
        grads = [p.grad for p in weights if p.grad is not None] + parallel.data_parallel.pending_gradients()
        peaks.activations = max(peaks.activations, float(live.current - live.held_by(weights) - live.held_by(grads)))

    if runner is not None:
        _static_stage_shapes(runner, parallel, seq_len // parallel.dims.cp, micro_batch, hidden, dtype)
        # Held activations after each forward, and on the last stage after its loss too (the log-probabilities).
        runner.add_action_observer(lambda action, stage, microbatch: after_forward() if action in ("F", "L") else None)
    if parallel.context is not None:  # meta tensors have no values for cp's first-step checks
        parallel.context.checked = True

    # Tensors autograd saves are the activations; some are made where the dispatch mode does not see
    # them (DTensor redistributes its inputs inside its own dispatch: under sequence parallelism the
    # all-gathered inputs of the q/k/v and MLP projections). Count every saved local storage too.
    def pack(t: Tensor) -> Tensor:
        live.track(t)
        return t

    # ZeRO 0-2 without a pipeline sync once after the backward, not bucket by bucket during it: the measured
    # peaks of the GPU runs (`tests/unit/test_allocator_model.py`) were matched this way.
    data_parallel = parallel.data_parallel
    deferred = runner is None and not data_parallel.fully_sharded
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            data_parallel.no_sync() if deferred else contextlib.nullcontext():
        loss = engine.step(
            "training_step", module, ((tokens, tokens),), {}, contextlib.nullcontext(), call=_module_loss(module),
            accumulate=1, check_cp=False, observe=False,
        )
        if runner is None:
            after_forward()
            live.forward_peak = live.peak
            live.mark("forward_end")
        else:  # the schedule ran forwards and backwards: its gradients are set aside until `backward`
            peaks.schedule = live.peak
            live.mark("schedule_end")
        engine.before_backward(accumulate=1)
        engine.backward(loss, lambda loss: loss.backward())
    if deferred:
        data_parallel.sync_now()
    engine.finalize_gradients()
    peaks.backward = live.peak
    return peaks


def _module_loss(module: nn.Module) -> Callable[[tuple[Tensor, Tensor]], Tensor]:
    """The ``training_step`` of the dry run's model: its ``loss_fn`` (or transformers' causal-LM loss) of its logits."""
    loss_fn = getattr(module, "loss_fn", None) or causal_lm_step_loss
    return lambda batch: loss_fn(module(batch[0]), batch[1])


def _static_stage_shapes(
    runner: PipelineRunner, parallel: ParallelModel, seq_len: int, micro_batch: int, hidden: int, dtype: torch.dtype,
) -> None:
    """Meta tensors have no values for torch's run-time shape exchange, so the stages' shapes are given up front
    (:class:`~lightning_para.parallel.pipeline.runner.StaticStageShapes`): the activation a stage passes on is one
    microbatch's hidden states of this rank's ``seq_len`` tokens, split over tp under sequence parallelism."""
    tp = parallel.dims.tp
    stream_len = seq_len // tp if parallel.config.sequence_parallel and tp > 1 else seq_len
    runner.use_static_shapes(StaticStageShapes(
        activation=lambda: torch.empty(micro_batch, stream_len, hidden, dtype=dtype, device="meta", requires_grad=True),
        # this rank's stages: it only decides whether the MoE aux loss is logged
        model_has_moe=any(True for stage in runner.stage_modules for _ in moe_layers(stage)),
    ))


__all__ = ["StepPeaks", "causal_lm_step_loss", "train_step"]
