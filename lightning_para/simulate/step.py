"""One rank's training step on the meta device: its forwards and backwards in the schedule's order, through the
real stage modules, hooks, loss and data-parallel engine (the pipeline runner's schedule itself is not used: its
start-up handshake reads tensor values, which meta tensors do not have)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_para.instrument.live_bytes import LiveBytes
from lightning_para.mesh import ParallelDims
from lightning_para.parallel.pipeline import schedules
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step
from lightning_para.parallel.tensor.loss import causal_lm_loss
from lightning_para.parallelize import ParallelModel


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int) -> int:
    """Microbatches whose activations a pipeline rank holds at its peak, for the schedules the dry run runs
    forward-then-backward (GPipe: all of them; 1F1B: ``pp - rank``): the schedule's own
    :func:`~lightning_para.parallel.pipeline.schedules.in_flight_microbatches`."""
    if pp > 1 and schedule not in ("gpipe", "1f1b"):
        raise ValueError(
            f"The dry run runs `schedule='1f1b'`, `'gpipe'` or `'interleaved'`, not {schedule!r}; set schedule to one of them."
        )
    return int(schedules.in_flight_microbatches(schedule, pp, microbatches, 1, pp_rank))


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
    order: Sequence[tuple[str, int]], live: LiveBytes, dtype: torch.dtype,
) -> float:
    """Run this rank's forwards and backwards in ``order`` (``("F" or "B", local chunk)`` each: 1F1B's and GPipe's
    in-flight microbatches all forward then all backward, or the interleaved schedule's whole order). Returns the
    activation bytes held at the most, after a forward (this step's gradients and the stages' weights left out).
    ``dtype``: the activations' (a later pipeline stage receives its input in it)."""
    runner = parallel.pipeline
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    if runner is None:
        stages, firsts, lasts = [module], [True], [True]
        loss_fn = getattr(module, "loss_fn", None) or causal_lm_step_loss
    else:
        stages, loss_fn = list(runner.stage_modules), runner.spec.loss_fn
        firsts = [m.stage_index == 0 for m in stages]
        lasts = [m.stage_index == runner.num_stages - 1 for m in stages]
        # The runner gives `split_batch` the whole batch before the schedule runs; transformers' pipeline_spec
        # remembers its label count there (the weight of each microbatch's loss). Shapes only on meta.
        per_chunk = sum(1 for kind, chunk in order if kind == "F" and chunk == 0)
        whole = torch.zeros(micro_batch * per_chunk, seq_len, dtype=torch.long, device="meta")
        runner.spec.split_batch((whole, whole))
    targets = tokens
    context = parallel.context
    if context is not None:
        # Context parallelism as the strategy runs it: this rank's head-tail chunks of the sequence (the
        # module's `context_parallel_batch` hook or the default split), and each forward inside the cp step
        # mode, where SDPA is ring / all-to-all attention and the cross-entropy covers the whole sequence.
        tokens, targets = context.split_batch(module, (tokens, tokens))
    sp = parallel.config.sequence_parallel and dims.tp > 1
    local_len = tokens.shape[1]
    stream_len = local_len // dims.tp if sp and runner is not None else local_len
    data_parallel = parallel.data_parallel
    # ZeRO-1/2 hold the microbatches' gradients and sync once after them (the caller's `sync_now`), as the
    # pipeline runner does; ZeRO-3 (FSDP2, no pipeline: one microbatch) reduce-scatters each unit's gradients
    # in its backward, as a step without accumulation does.
    # ZeRO-2's "reduce_each_microbatch" reduces each microbatch's gradients after its backward, as the runner does.
    deferred = data_parallel is not None and not data_parallel.fully_sharded
    each_microbatch = reduces_each_microbatch(parallel)
    if each_microbatch:
        sync = data_parallel.each_microbatch()
    else:
        sync = data_parallel.no_sync() if deferred else contextlib.nullcontext()
    outputs: dict[int, list[Tensor]] = {chunk: [] for chunk in range(len(stages))}
    last_forward = max(i for i, (kind, _) in enumerate(order) if kind == "F")
    held = 0.0
    # Tensors autograd saves are the activations; some are made where the dispatch mode does not see
    # them (DTensor redistributes its inputs inside its own dispatch: under sequence parallelism the
    # all-gathered inputs of the q/k/v and MLP projections). Count every saved local storage too.
    def pack(t: Tensor) -> Tensor:
        live.track(t)
        return t

    with sync, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for index, (kind, chunk) in enumerate(order):
            stage = stages[chunk]
            if kind == "F":
                if firsts[chunk]:
                    x: Tensor = tokens
                else:
                    x = torch.empty(micro_batch, stream_len, hidden, dtype=dtype, device="meta", requires_grad=True)
                with loss_parallel_step(parallel.loss_parallel), \
                        (context.mode() if context else contextlib.nullcontext()):
                    y = stage(x)
                    if lasts[chunk]:
                        y = loss_fn(y, targets)
                outputs[chunk].append(y)
                # ZeRO-3 keeps some units gathered from forward to backward (the last block, the head): weights,
                # not activations (the planner prices them with the gathered buffers); the stages' parameters are
                # the gathered tensors while they are. Gradients (accumulated, or summed shards) are not either.
                # (Read after the forward: FSDP2 registers the gathered tensors as the parameters while it keeps them.)
                weights = [p for s in stages for p in s.parameters()]
                grads = [p.grad for p in weights if p.grad is not None] + reduced_shards(parallel)
                held = max(held, float(live.current - live.held_by(weights) - live.held_by(grads)))
                if index == last_forward:
                    live.forward_peak = live.peak
                    live.mark("forward_end")
                continue
            # Each microbatch's output (and with it its graph) is dropped after its backward, as torch's pipeline
            # stage pops it from its forward cache: what the graph itself keeps beside its saved tensors is freed
            # per microbatch, not when the last one is done.
            y = outputs[chunk].pop(0)
            with loss_parallel_backward(parallel.loss_parallel):
                if y.dim() == 0:
                    y.backward()
                else:
                    y.backward(torch.empty_like(y))
            del y
            if each_microbatch:
                data_parallel.reduce_part(chunk)
    return held


def reduces_each_microbatch(parallel: ParallelModel) -> bool:
    return parallel.pipeline is not None and parallel.data_parallel is not None \
        and parallel.data_parallel.reduces_each_microbatch


def reduced_shards(parallel: ParallelModel) -> list[Tensor]:
    """The shards ZeRO-2's "reduce_each_microbatch" has summed so far (``Bucket.pending``): gradients the rank holds."""
    engine = getattr(parallel.data_parallel, "engine", None)
    return [b.pending for b in engine.buckets if b.pending is not None] if engine is not None else []



__all__ = ["causal_lm_step_loss", "in_flight_microbatches", "reduced_shards", "reduces_each_microbatch", "train_step"]
