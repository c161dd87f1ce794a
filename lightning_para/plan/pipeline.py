"""The pipeline as the cost model sees it: the layer split and what each pipeline rank holds (:func:`pipeline_ranks`),
and the peaks a rank's compute order reaches (:func:`held_activations_peak`, :func:`lazy_gradient_peak`).

The schedules own their math (:mod:`lightning_para.spec.schedules`: rules, bubble, fill, in-flight microbatches,
compute order); the split is :mod:`lightning_para.spec.split`'s. ``p`` pipeline ranks, ``m`` microbatches per
pipeline flush, ``v`` stages (model chunks) per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from lightning_para.plan.model import ModelDesc, PipelineUnit
from lightning_para.plan.tensors import ParamTensor, part_tensors, total_numel
from lightning_para.spec.schedules import check_planned, in_flight_microbatches, stage_to_rank
from lightning_para.spec.split import balanced_split, explicit_split


def unit_split(costs: Sequence[float], chunks: int, explicit: Optional[Sequence[int]] = None) -> list[int]:
    """Start index of each pipeline chunk over the contract's entries: ``explicit`` starts
    (ParaStrategy's ``pipeline_split``), else contiguous parts minimizing the largest part's
    parameter count, exactly as ParaStrategy splits (``pipeline_balance="params"``).

    With the embedding and the output head as entries of their own, the end chunks get fewer
    layers, as Llama 3 balanced its stages (Grattafiori et al. 2024, Sec. 3.3.2: 126 = 7 + 14 x 8
    + 7 over 16 stages).
    """
    if chunks > len(costs):
        raise ValueError(f"{chunks} pipeline chunks cannot split {len(costs)} layers: each needs at least one.")
    if explicit is not None:
        return explicit_split(explicit, len(costs), chunks)
    return list(_balanced_split(tuple(costs), chunks))


@functools.lru_cache(maxsize=1024)
def _balanced_split(costs: tuple[float, ...], chunks: int) -> tuple[int, ...]:
    # The exact split is O(chunks x layers^2), and a search prices many layouts with the same split.
    return tuple(balanced_split(costs, chunks))


@dataclass(frozen=True)
class ChunkShare:
    """One of a rank's pipeline chunks (its virtual stages, in the rank's order): what its activations hold."""

    layers: tuple[int, ...]
    embedding: bool = False
    last_stage: bool = False  # the model's last chunk: the head's output and the loss
    sends_forward: bool = False  # its output goes to another rank


@dataclass(frozen=True)
class RankLayers:
    """What one pipeline rank holds: its layer indices, the embedding, the final norm and/or the
    output head, how many chunk boundaries it sends across, and its peak in-flight microbatches."""

    rank: int
    layers: tuple[int, ...]
    embedding: bool
    head: bool
    sends_forward: int  # chunks whose output goes to another rank
    sends_backward: int  # chunks whose input gradient goes to another rank
    in_flight: float
    final_norm: bool = False
    last_stage: bool = False  # holds the last chunk: computes the loss
    chunks: tuple[ChunkShare, ...] = ()  # per local chunk (several under interleaved schedules)


def pipeline_ranks(
    model: ModelDesc,
    schedule: str,
    pp: int,
    virtual_stages: int,
    microbatches: int,
    split: Optional[Sequence[int]] = None,
) -> list[RankLayers]:
    """Each pipeline rank's share of ``model``: the contract's entries (:meth:`ModelDesc.units`)
    split into ``pp * virtual_stages`` chunks (:func:`unit_split`) and placed on ranks the way
    ParaStrategy's schedule places them (loop, or ZB-V's V)."""
    units = model.units()
    if pp == 1:
        return [RankLayers(
            rank=0, layers=tuple(range(model.layers)), embedding=True, head=True, sends_forward=0, sends_backward=0,
            in_flight=1.0, final_norm=True, last_stage=True,
        )]
    check_planned(schedule)  # once: the ranks below read the schedule's own math directly
    chunks = pp * virtual_stages
    costs = [float(total_numel(unit_tensors(model, unit))) for unit in units]
    starts = unit_split(costs, chunks, split) + [len(units)]
    placement = stage_to_rank(schedule, pp, virtual_stages)
    result = []
    for rank in range(pp):
        owned = sorted(c for c in range(chunks) if placement[c] == rank)
        held = [units[i] for c in owned for i in range(starts[c], starts[c + 1])]
        result.append(
            RankLayers(
                rank=rank,
                layers=tuple(i for unit in held for i in unit.layers),
                embedding=any(u.embedding for u in held),
                head=any(u.head for u in held),
                # Only boundaries to another rank communicate (ZB-V's rank p-1 holds chunks p-1 and p).
                sends_forward=sum(c != chunks - 1 and placement[c + 1] != rank for c in owned),
                sends_backward=sum(c != 0 and placement[c - 1] != rank for c in owned),
                in_flight=in_flight_microbatches(schedule, pp, microbatches, virtual_stages, rank),
                final_norm=any(u.final_norm for u in held),
                last_stage=chunks - 1 in owned,
                chunks=tuple(
                    ChunkShare(
                        layers=tuple(i for u in units[starts[c]:starts[c + 1]] for i in u.layers),
                        embedding=any(u.embedding for u in units[starts[c]:starts[c + 1]]),
                        last_stage=c == chunks - 1,
                        sends_forward=c != chunks - 1 and placement[c + 1] != rank,
                    ) for c in owned
                ),
            )
        )
    return result


def unit_tensors(model: ModelDesc, unit: PipelineUnit, tp: int = 1, ep: int = 1) -> list[ParamTensor]:
    """The parameter tensors of one contract entry (whole: ParaStrategy splits before tensor parallelism)."""
    return part_tensors(
        model, unit.layers, embedding=unit.embedding, final_norm=unit.final_norm, head_matrix=unit.head, tp=tp, ep=ep
    )


def held_activations_peak(order: Sequence[tuple[str, int]], chunk_activations: Sequence[float]) -> float:
    """The most activation bytes a rank holds while it runs ``order`` (:func:`compute_order`), with
    ``chunk_activations[c]`` held per microbatch by its chunk ``c`` (chunks differ: the embedding or the head)."""
    counts, peak = [0] * len(chunk_activations), 0.0
    for kind, chunk in order:
        counts[chunk] += 1 if kind == "F" else -1
        if kind == "F":
            peak = max(peak, sum(n * a for n, a in zip(counts, chunk_activations)))
    return peak


def lazy_gradient_peak(order: Sequence[tuple[str, int]], layers_per_chunk: Union[int, Sequence[int]],
                       chunk_activations: Union[float, Sequence[float]], chunk_gradients: Union[float, Sequence[float]],
                       freed_after_backward: bool = False) -> float:
    """The peak of activations plus this step's gradients while a rank runs ``order`` (:func:`compute_order`),
    when a chunk's gradients come into being at its first backward (autograd allocates ``.grad`` after
    ``zero_grad(set_to_none=True)``: torch's DDP and FSDP, ParaStrategy; not Megatron-LM's persistent buffer).

    ``chunk_activations``: bytes one microbatch leaves held by one chunk; ``chunk_gradients``: one chunk's gradient
    bytes. A backward runs the chunk's layers last first: during each, its saved tensors are still held and its
    gradients exist (the first time), so the largest value is at the first or the last layer.
    ``freed_after_backward``: each backward's gradients are reduce-scattered and freed at its end (ZeRO-2's
    ``"reduce_each_microbatch"``): they exist during every backward, never after.
    Each of the three is one value for every chunk, or one per chunk.
    """
    chunks = 1 + max(chunk for _, chunk in order)

    def per_chunk(value: Union[float, Sequence[float]]) -> list[float]:
        return [float(v) for v in value] if isinstance(value, Sequence) else [float(value)] * chunks

    activations, gradients = per_chunk(chunk_activations), per_chunk(chunk_gradients)
    layers = [max(1, int(n)) for n in per_chunk(layers_per_chunk)]
    held, grads, peak = 0.0, 0.0, 0.0
    started: set[int] = set()
    for kind, chunk in order:
        if kind == "F":
            held += activations[chunk]
            peak = max(peak, held + grads)
            continue
        first = chunk not in started or freed_after_backward
        new = gradients[chunk] if first else 0.0
        layer_activations, layer_gradients = activations[chunk] / layers[chunk], gradients[chunk] / layers[chunk]
        at_first_layer = held + grads + (layer_gradients if first else 0.0)
        at_last_layer = held - (activations[chunk] - layer_activations) + grads + new
        peak = max(peak, at_first_layer, at_last_layer)
        started.add(chunk)
        grads += 0.0 if freed_after_backward else new
        held -= activations[chunk]
    return peak
