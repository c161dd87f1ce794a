"""One pipeline rank of one layout, resolved once (:class:`RankShape`: its tensors, parameters, ZeRO groups, tokens
and the activation formulas' arguments), which every term of its price reads; and the states it keeps between
optimizer steps (:func:`resident_states`, a :class:`~lightning_para.spec.memory.PredictedMemory`, the predicted
record the dry run and the profiler compare their measurements with)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lightning_para.plan.cluster import Training
from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.pipeline import RankLayers
from lightning_para.plan.tensors import ParamTensor, layer_tensors, muon_steps, part_tensors, shard_numel, total_numel
from lightning_para.spec.dims import PRICED
from lightning_para.spec.memory import PredictedMemory


def bucket_bytes(group_size: int, grad_bytes: int) -> float:
    """Gradient bucket for ZeRO-0/1/2 over ``group_size`` ranks: ``max(40M, 1M * n)`` elements,
    Megatron-LM's rule (``megatron/core/distributed``), so that each ring collective moves enough
    bytes per step to amortize its ``n - 1`` hop latencies. Rendered as ``bucket_size_mb``."""
    return max(40e6, 1e6 * group_size) * grad_bytes


def activation_kwargs(training: Training, layout: Layout) -> tuple[dict, dict]:
    """Keyword arguments of the activation formulas for this layout: ``(every term's, a layer's)``."""
    kwargs = {"tp": layout.tp, "sequence_parallel": layout.sequence_parallel, "cp": layout.cp}
    torch_code = training.activation_profile == "torch"
    # ParaStrategy saves each sublayer's input shard under SP (`sp_save_input_shard`, Megatron-SP) unless
    # activation checkpointing is on (parallelize.py): then "selective" keeps the gathered input.
    gathered = torch_code and (not layout.sp_save_input_shard or layout.activation_checkpointing in ("selective", "selective_op"))
    layer_kwargs = {**kwargs, "sp_saves_gathered_inputs": gathered, "swiglu_tensors": 4 if torch_code else 3,
                    "expert_parallel": layout.ep > 1}
    return kwargs, layer_kwargs


@dataclass(frozen=True)
class RankShape:
    """One pipeline rank ``part`` of ``layout`` for one optimizer step of ``per_step`` microbatches in ``flushes``
    pipeline flushes, resolved once: its tensors (local shapes after tp/ep), its dense, expert and largest layer's
    parameters, its ZeRO groups, its tokens per microbatch and the activation formulas' arguments.
    ``training.micro_batch`` must be resolved (an int)."""

    model: ModelDesc
    training: Training
    layout: Layout
    part: RankLayers
    per_step: int = 1
    flushes: int = 1
    tensors: tuple[ParamTensor, ...] = field(init=False)
    dense: float = field(init=False)
    expert: float = field(init=False)
    largest: float = field(init=False)  # the largest layer's parameters

    def __post_init__(self) -> None:
        model, layout, part = self.model, self.layout, self.part
        # A tied head on another rank than the embedding keeps its own copy (Megatron-LM does too).
        own_matrix = part.head and (not model.tied_embeddings or not part.embedding)
        tensors = tuple(part_tensors(model, part.layers, embedding=part.embedding, final_norm=part.final_norm,
                                     head_matrix=own_matrix, tp=layout.tp, ep=layout.ep))
        largest = max((total_numel(layer_tensors(model, i, layout.tp, layout.ep)) for i in part.layers), default=0)
        for name, value in (("tensors", tensors), ("dense", float(total_numel(t for t in tensors if not t.expert))),
                            ("expert", float(total_numel(t for t in tensors if t.expert))), ("largest", float(largest))):
            object.__setattr__(self, name, value)

    @cached_property
    def groups(self) -> dict[str, tuple[int, int]]:
        """``(size, span)`` of each of the planner's groups (:meth:`Layout.group`)."""
        return {name: self.layout.group(name) for name in PRICED}

    @property
    def shards(self) -> tuple[int, int]:
        """Ranks sharing ZeRO state: ``(dense, expert)``, the planner's ``dp`` and ``edp`` groups."""
        return self.groups["dp"][0], self.groups["edp"][0]

    @property
    def tokens(self) -> float:
        """Tokens of one microbatch on this rank (its sequence shard under cp)."""
        return self.training.micro_batch * self.training.seq_len / self.layout.cp

    @property
    def torch_code(self) -> bool:
        """ParaStrategy's eager torch code is priced (not Megatron-LM's fused kernels)."""
        return self.training.activation_profile == "torch"

    @cached_property
    def activation_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return activation_kwargs(self.training, self.layout)


def resident_states(shape: RankShape) -> PredictedMemory:
    """Parameters, gradients and optimizer state one rank holds *between* optimizer steps, as
    ParaStrategy keeps them (what ``strategy.memory_breakdown()`` measures after a step).

    It differs from the ZeRO paper's peak (:class:`PredictedMemory` of ``memory``) where the
    implementation frees or re-types tensors once a step is done:

    * ZeRO-1 and 2 keep only the reduced gradient *shard* (the full gradients are freed into the
      reduce-scatter buckets), in the dtype of the optimizer's tensor: fp32;
    * a separate fp32 master (``bf16-true``, ``16-true``) holds the fp32 gradient, and the model's
      ``p.grad`` shows the reduced 16-bit gradient beside it until the next backward
      (``ZeroDataParallel._finish``: the bucket's reduced shard under ZeRO-1/2, the whole reduced
      bucket under ZeRO-0), so such a rank holds ``4 + 2`` gradient bytes per element it steps
      (the dry run counts these 6 bytes: tests/unit/test_dryrun.py); without a
      separate master (``32-true``, ``*-mixed``) a ZeRO-1/2 master is a view of the parameter's own
      rows and its gradient is the one shown (no extra bytes);
    * ZeRO-3 (FSDP2) keeps its sharded parameters in fp32 (they are the master), gradients too;
    * shards are ``ceil(rows / N)`` rows of each tensor, padding included (:mod:`.tensors`);
    * Adam keeps a 4-byte ``step`` tensor per parameter tensor next to its two moments.
    """
    training, layout, tensors = shape.training, shape.layout, shape.tensors
    precision = training.bytes
    separate_master = precision.master > 0 and layout.zero < 3
    fp32, state = 4, training.optimizer_state_bytes
    muon = training.optimizer == "muon"  # AdamW's moments and step counter for what Muon does not step
    counters = 4 * sum(1 for t in tensors if training.optimizer == "adam" or (muon and not muon_steps(t)))
    params = grads = optimizer = 0.0
    for expert, shards in zip((False, True), shape.shards):
        group = [t for t in tensors if t.expert == expert]
        if not group:
            continue
        full, shard = total_numel(group), shard_numel(group, shards)
        held = shard if layout.zero >= 1 else full  # what the optimizer steps on this rank
        if layout.zero == 3:
            params += fp32 * shard
            grads += fp32 * shard
        else:
            params += precision.weight * full
            if separate_master:  # the master's fp32 gradient and the 16-bit one `p.grad` shows
                grads += (fp32 + precision.grad) * held
            else:
                grads += (fp32 if layout.zero >= 1 else precision.grad) * held
        optimizer += state * held + (precision.master * held if separate_master else 0)
        if muon:
            adamw = [t for t in group if not muon_steps(t)]
            optimizer += 4 * (shard_numel(adamw, shards) if layout.zero >= 1 else total_numel(adamw))
    return PredictedMemory(params, grads, optimizer + counters)


def zero3_ends(shape: RankShape) -> tuple[list[ParamTensor], bool]:
    """The tensors outside the blocks (embedding, final norm, head; tied or not) and whether they
    form one grouped unit: always under ``zero3_units="blocks"``, never under ``"blocks_and_ends"``,
    and under ``"auto"`` when they hold no more than the largest block, experts included
    (``parallel/data/fsdp.py``'s rule, on the same local sizes)."""
    layout = shape.layout
    layers = [layer_tensors(shape.model, i, layout.tp, layout.ep) for i in shape.part.layers]
    in_layers = {t for layer in layers for t in layer}
    ends = [t for t in shape.tensors if t not in in_layers]
    if layout.zero3_units != "auto":  # the user's choice: "blocks" groups the ends, "blocks_and_ends" does not
        return ends, layout.zero3_units == "blocks"
    grouped = bool(layers) and total_numel(ends) <= max(total_numel(layer) for layer in layers)
    return ends, grouped


def zero3_kept_ends(shape: RankShape) -> float:
    """Parameters outside the blocks that ZeRO-3 holds gathered from forward to backward: all of
    them when they form one grouped unit, else the head and final norm."""
    ends, grouped = zero3_ends(shape)
    return float(total_numel(ends if grouped else (t for t in ends if not t.name.startswith("embedding"))))


__all__ = ["RankShape", "activation_kwargs", "bucket_bytes", "resident_states", "zero3_ends", "zero3_kept_ends"]
