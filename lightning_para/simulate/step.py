"""One rank's training step on the meta device: under a pipeline the real pipeline runner and torch's schedule (the
stages' shapes given up front, as meta tensors cannot carry torch's run-time shape exchange), else the module's
forward, loss and backward; the real stage modules, hooks, loss and data-parallel engine either way."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_para.instrument.live_bytes import LiveBytes
from lightning_para.mesh import ParallelDims
from lightning_para.moe import moe_layers
from lightning_para.parallel.pipeline.contracts import StaticStageShapes
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step
from lightning_para.parallel.tensor.loss import causal_lm_loss
from lightning_para.parallelize import ParallelModel
from lightning_para.spec import schedules


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Microbatches whose activations a pipeline rank holds at its peak (GPipe: all of them; 1F1B: ``pp - rank``):
    the schedule's own :func:`~lightning_para.spec.schedules.in_flight_microbatches`, rounded up."""
    return math.ceil(schedules.in_flight_microbatches(schedule, pp, microbatches, virtual_stages, pp_rank))


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


def train_step(
    module: nn.Module, parallel: ParallelModel, dims: ParallelDims, seq_len: int, micro_batch: int, hidden: int,
    live: LiveBytes, dtype: torch.dtype,
) -> tuple[float, set[int]]:
    """Run this rank's forwards and backwards of one training step: under a pipeline, the real
    :class:`~lightning_para.parallel.pipeline.runner.PipelineRunner` over the step's microbatches in its schedule's
    order (gradients set aside until :func:`finish_step`), else one forward, loss and backward of the module as
    Lightning's ``training_step`` and ``backward`` run them. Returns the activation bytes held at the most, after a
    forward (this step's gradients and the stages' weights left out), and the storages a later step does not make
    again (the pipeline stages' receive buffers, made as the schedule starts). ``dtype``: the activations' (a later
    pipeline stage receives its input in it)."""
    runner = parallel.pipeline
    rows = micro_batch * (runner.microbatches if runner is not None else 1)
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    batch: tuple[Tensor, Tensor] = (tokens, tokens)
    context = parallel.context
    if context is not None:
        # Context parallelism as the strategy runs it: this rank's head-tail chunks of the sequence (the
        # module's `context_parallel_batch` hook or the default split), and the step inside the cp step
        # mode, where SDPA is ring / all-to-all attention and the cross-entropy covers the whole sequence.
        batch = context.split_batch(module, batch)
    stages = list(runner.stage_modules) if runner is not None else [module]
    held = 0.0
    before, made_once = set(live.live), set()

    def after_forward() -> None:
        # ZeRO-3 keeps some units gathered from forward to backward (the last block, the head): weights, not
        # activations (the planner prices them with the gathered buffers); the stages' parameters are the gathered
        # tensors while they are. Gradients (accumulated, or summed shards) are not either. (Read after the forward:
        # FSDP2 registers the gathered tensors as the parameters while it keeps them.)
        nonlocal held
        if not made_once:  # what the schedule made before its first forward: its receive buffers
            made_once.update(set(live.live) - before)
        weights = [p for s in stages for p in s.parameters()]
        grads = [p.grad for p in weights if p.grad is not None] + reduced_shards(parallel)
        held = max(held, float(live.current - live.held_by(weights) - live.held_by(grads)))

    # Tensors autograd saves are the activations; some are made where the dispatch mode does not see
    # them (DTensor redistributes its inputs inside its own dispatch: under sequence parallelism the
    # all-gathered inputs of the q/k/v and MLP projections). Count every saved local storage too.
    def pack(t: Tensor) -> Tensor:
        live.track(t)
        return t

    step_mode = context.mode() if context is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), step_mode:
        if runner is not None:
            _pipeline_step(module, parallel, dims, batch, micro_batch, hidden, dtype, after_forward)
        else:
            _module_step(module, parallel, batch, live, after_forward)
    return held, made_once if runner is not None else set()


def _pipeline_step(
    module: nn.Module, parallel: ParallelModel, dims: ParallelDims, batch: tuple[Tensor, Tensor], micro_batch: int,
    hidden: int, dtype: torch.dtype, after_forward: Callable[[], None],
) -> None:
    """The pipeline runner's training step, as ``ParaStrategy`` routes ``training_step`` to it: meta tensors have
    no values for torch's run-time shape exchange, so the stages' shapes are given up front
    (:class:`~lightning_para.parallel.pipeline.runner.StaticStageShapes`)."""
    runner = parallel.pipeline
    assert runner is not None
    # The activation a stage passes on: one microbatch's hidden states, its sequence split over tp under
    # sequence parallelism.
    sp = parallel.config.sequence_parallel and dims.tp > 1
    stream_len = batch[0].shape[1] // dims.tp if sp else batch[0].shape[1]
    has_moe = any(True for stage in runner.stage_modules for _ in moe_layers(stage))
    runner.use_static_shapes(StaticStageShapes(
        activation=lambda: torch.empty(micro_batch, stream_len, hidden, dtype=dtype, device="meta", requires_grad=True),
        model_has_moe=has_moe,  # this rank's stages: it only decides whether the MoE aux loss is logged
    ))
    # Held activations after each forward, and on the last stage after its loss too (the log-probabilities).
    runner.add_action_observer(lambda action, stage, microbatch: after_forward() if action in ("F", "L") else None)
    runner.run("training_step", module, batch, gradient_sync=parallel.data_parallel, accumulate=1)


def _module_step(
    module: nn.Module, parallel: ParallelModel, batch: tuple[Tensor, Tensor], live: LiveBytes,
    after_forward: Callable[[], None],
) -> None:
    """One forward, loss and backward of the whole module (no pipeline): ZeRO-3 (FSDP2) reduce-scatters each unit's
    gradients in its backward, as a step without accumulation does; ZeRO-1/2 sync after it (:func:`finish_step`)."""
    tokens, targets = batch
    loss_fn = getattr(module, "loss_fn", None) or causal_lm_step_loss
    data_parallel = parallel.data_parallel
    deferred = data_parallel is not None and not data_parallel.fully_sharded
    with data_parallel.no_sync() if deferred else contextlib.nullcontext():
        with loss_parallel_step(parallel.loss_parallel):
            loss = loss_fn(module(tokens), targets)
        after_forward()
        live.forward_peak = live.peak
        live.mark("forward_end")
        with loss_parallel_backward(parallel.loss_parallel):
            loss.backward()


def finish_step(parallel: ParallelModel) -> None:
    """The step's gradients after its schedule: the pipeline's join ``.grad`` and sync over dp as
    ``ParaStrategy.backward`` has the runner do it; without a pipeline the data-parallel sync itself."""
    data_parallel = parallel.data_parallel
    if parallel.pipeline is not None:
        parallel.pipeline.finish_backward(data_parallel)
    elif data_parallel is not None:
        data_parallel.sync_now()
    if data_parallel is not None:
        data_parallel.flush()


def reduced_shards(parallel: ParallelModel) -> list[Tensor]:
    """The shards ZeRO-2's "reduce_each_microbatch" has summed so far (``Bucket.pending``): gradients the rank holds."""
    engine = getattr(parallel.data_parallel, "engine", None)
    return [b.pending for b in engine.buckets if b.pending is not None] if engine is not None else []



__all__ = ["causal_lm_step_loss", "finish_step", "in_flight_microbatches", "reduced_shards", "train_step"]
