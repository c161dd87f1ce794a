"""The two memory records of one rank: :class:`MeasuredMemory` (counted from its tensors: ``strategy.memory_breakdown()``
between steps, the dry run with the step's activations and peak, the profiler) and :class:`PredictedMemory` (the
planner's, or the ZeRO paper's formulas').

Both name the same parts (``params``, ``grads``, ``optimizer``, ``activations``), so the one comparator
(:mod:`lightning_para.instrument.compare`) reads them alike; the one way held bytes are counted is
:func:`lightning_para.memory.measure_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class _ModelStates:
    """What both records say alike: the ZeRO paper's model states (``params``, ``grads``, ``optimizer``)."""

    params: float
    grads: float
    optimizer: float

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer state: the ZeRO paper's "model states"."""
        return self.params + self.grads + self.optimizer

    def states(self) -> dict[str, float]:
        """``params``, ``grads``, ``optimizer`` and their sum (the ZeRO paper's model states)."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.model_states}


@dataclass(frozen=True)
class MeasuredMemory(_ModelStates):
    """Bytes one rank holds, counted from its tensors (each storage once).

    ``params``, ``grads`` and ``optimizer`` (fp32 masters kept apart from the parameters, and the optimizer's
    state) are the states held between optimizer steps. The dry run also measures a step: ``activations`` (what the
    in-flight microbatches hold when their forwards are done), ``peak``, and the caching allocator's reserved peak
    replayed from the step's allocations (``simulate/allocator.py``) with the default settings and with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; ``None`` where not measured.
    """

    params: float
    grads: float
    optimizer: float
    activations: Optional[float] = None
    peak: Optional[float] = None
    reserved: Optional[float] = None
    reserved_expandable: Optional[float] = None


@dataclass(frozen=True)
class PredictedMemory(_ModelStates):
    """Bytes one rank is predicted to hold: by the planner at the step's peak (``plan.rank_memory``) or between
    optimizer steps (``plan.shape.resident_states``: states only), or by the ZeRO paper's formulas (states
    only: ``parallel.data.memory``)."""

    params: float
    grads: float
    optimizer: float  # fp32 masters and optimizer state
    activations: float = 0.0
    buffers: float = 0.0  # ZeRO-3 gathered weights, autocast's 16-bit weight copies, Muon's routing index
    # Of `activations`: the larger of two transients (`transient`), what recomputing one layer in backward brings
    # back ("full", "selective_op"; else 0) and the logits the training step holds while the loss runs (the last
    # stage, eager torch code); the rest is what the in-flight microbatches hold when their forwards are done
    # (what the dry run measures).
    recomputed: float = 0.0
    loss_logits: float = 0.0
    # ParaStrategy's separate fp32 master (bf16-true, 16-true; ZeRO 0-2) keeps its fp32 gradient of the last step
    # beside the 16-bit one until `zero_grad`, which Lightning calls after the forward: both are held at the forward's
    # peak (docs/planner.md, "Memory terms"). Outside the ZeRO paper's model states.
    master_grads: float = 0.0
    # ParaStrategy's ring attention (cp_method="ring", eager torch code) computes fp32 scores per (query chunk, key
    # chunk) pair in tiles of query rows: two tiles (P and dP) live during a layer's backward, beside what that
    # layer's recomputation brought back (parallel/context/ring.py).
    ring_scores: float = 0.0
    # The loss's backward (the last stage, eager torch code): the gradients of the log-probabilities and of the
    # logits, two logits-sized tensors in the activation dtype (one for the vocab-parallel loss, fp32 after an
    # upcast), while the log-probabilities are still saved (docs/planner.md, "Memory terms"). By then Lightning's `zero_grad` has freed the last step's gradients, which the
    # forward's peak holds, unless this step's earlier microbatches have accumulated their own
    # (`loss_backward_freed`: the gradient bytes not held then).
    loss_backward: float = 0.0
    loss_backward_freed: float = 0.0
    # The optimizer step, when the activations are gone (`optimizer_step_total`): the states as the rank keeps them
    # between steps (`resident`: ZeRO-1/2 hold gradient shards by then), plus the larger of AdamW's multi-tensor
    # temporaries (torch's default on a GPU: an fp32 copy of every element the rank steps, `_foreach_sqrt` of the
    # second moments) and ZeRO-1/2's gather of the updated weights (one receive buffer of all of them, in the
    # weights' dtype). Counted by the dry run; the peak where the states outweigh the activations (short sequences,
    # an MoE rank's experts).
    optimizer_step_total: float = 0.0
    # A pipeline rank's gradients come into being chunk by chunk, at each chunk's first backward of the step
    # (autograd allocates `.grad` after `zero_grad(set_to_none=True)`): at the peak of activations plus gradients
    # (`plan.pipeline.lazy_gradient_peak` walks the schedule's order) these bytes of `grads` do not exist yet.
    # GPipe, and an interleaved schedule whose warm-up covers every microbatch (the Llama 3 16K-GPU rows), peak
    # when every forward is done and before most gradients exist. 0 without a pipeline, with accumulation over
    # several flushes, for the zero-bubble schedules and under `Training.persistent_grad_buffer`.
    grads_not_yet_allocated: float = 0.0
    # ZeRO-2's "reduce_each_microbatch" under a pipeline: one chunk's whole gradients during its backward, until
    # reduce-scattered, beyond the activations its backward has freed by then, plus the last bucket still on the
    # wire (`lazy_gradient_peak(freed_after_backward=True)`); a transient of backward, with a layer's recomputation.
    reducing: float = 0.0

    @property
    def held_after_forwards(self) -> float:
        """``activations`` less the peak's transient part: what the in-flight microbatches hold when their forwards
        are done (the dry run's measured ``activations``)."""
        return self.activations - self.transient


    @property
    def held_grads(self) -> float:
        """Gradient bytes at the peak: the ZeRO paper's plus a separate master's fp32 gradients (or the last step's
        set aside under a pipeline), less those this step's schedule has not made yet."""
        return self.grads + self.master_grads - self.grads_not_yet_allocated

    @property
    def transient(self) -> float:
        """The peak's transient part of ``activations``: one layer's recomputation (with ring attention's score
        blocks and a chunk's gradients being reduced in its backward), the loss's logits, or the loss's backward
        less the gradients it finds freed."""
        return max(self.recomputed + self.ring_scores + self.reducing, self.loss_logits,
                   self.loss_backward - self.loss_backward_freed)

    @property
    def total(self) -> float:
        """The peak: the forward and backward's (model states, activations, gathered buffers), or the optimizer
        step's (``optimizer_step_total``), which comes after the activations are freed."""
        during_step = self.params + self.held_grads + self.optimizer + self.activations + self.buffers
        return max(during_step, self.optimizer_step_total)


__all__ = ["MeasuredMemory", "PredictedMemory"]
