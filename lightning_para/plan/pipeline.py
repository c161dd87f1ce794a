"""Pipeline schedules as the cost model sees them: rules, bubble, in-flight microbatches, layer split.

``p`` pipeline ranks, ``m`` microbatches per pipeline flush, ``v`` stages (model chunks) per rank.

=============  ==========================  ====================================================
schedule       bubble (idle / step time)   source
=============  ==========================  ====================================================
gpipe, 1f1b    (p-1) / (m+p-1)             GPipe (Huang et al. 2019); 1F1B: PipeDream-Flush
                                           (Narayanan et al. 2021a), Megatron-LM Sec. 2.2.1
interleaved    (p-1) / (v m + p-1)         Megatron-LM (Narayanan et al. 2021b), Sec. 2.2.2
zero_bubble    (p-1)/3 / (m + (p-1)/3)     ZB-H1 (Qi et al. 2024, Sec. 3), with t_F = t_B = t_W
zbv            0 (needs m >= 2p-1)         ZB-V (Qi et al. 2024, Sec. 6)
=============  ==========================  ====================================================

Microbatches whose activations a rank holds at its peak (in units of "one microbatch through
all of this rank's layers"; Korthikanti et al. 2022, Sec. 4.2.3):

* GPipe: all ``m`` (every forward runs before any backward);
* 1F1B and ZB-H1 (``v = 1``): rank ``i`` holds ``min(p - i, m)`` (ZB-H1 keeps 1F1B's peak);
* interleaved (and zero_bubble with ``v > 1``): rank ``i`` runs ``2 (p - i - 1) + (v - 1) p``
  warm-up chunk-forwards plus one in flight (Megatron-LM's ``get_num_warmup_microbatches``),
  each ``1/v`` of its layers: ``p + (p - 1) / v`` on rank 0, Korthikanti's ``1 + (p-1)/(p v)``
  times 1F1B;
* ZB-V: ``p`` on every rank, the same peak as 1F1B's rank 0 (Qi et al. 2024, Sec. 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def check_schedule(name: str) -> None:
    """``ValueError`` for a schedule name the planner does not know."""
    if name not in SCHEDULES:
        raise ValueError(f"`schedule={name!r}` is unknown. Choose one of {', '.join(map(repr, SCHEDULES))}.")


def schedule_problem(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> Optional[str]:
    """Why ``schedule`` cannot run with these degrees (``None`` if it can).

    The rules of ``torch.distributed.pipelining``'s schedules, which ParaStrategy runs: single-stage
    schedules take ``v = 1``; interleaved needs ``v >= 2``; ZB-V exactly ``v = 2`` and
    ``m >= 2p - 1``; 1F1B ``m >= p`` (its warm-up needs one microbatch per stage); the
    multi-stage loop schedules ``m`` a multiple of ``p`` (whole rounds).
    """
    check_schedule(schedule)
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return None if v == 1 else f"virtual_stages={v} needs pp > 1"
    if schedule in ("gpipe", "1f1b") and v != 1:
        return f"schedule '{schedule}' runs one stage per rank, not virtual_stages={v}"
    if schedule == "interleaved" and v < 2:
        return "schedule 'interleaved' needs virtual_stages >= 2"
    if schedule == "zbv" and v != 2:
        return f"schedule 'zbv' needs virtual_stages=2, not {v}"
    if schedule == "1f1b" and m < p:
        return f"schedule '1f1b' needs microbatches >= pp ({m} < {p})"
    if schedule == "zbv" and m < 2 * p - 1:
        return f"schedule 'zbv' needs microbatches >= 2*pp-1 ({m} < {2 * p - 1})"
    if schedule in ("interleaved", "zero_bubble") and (m < p or m % p):
        return f"schedule '{schedule}' needs microbatches a multiple of pp ({m} vs pp={p})"
    return None


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step on every pipeline rank for equal stage times (table above)."""
    check_schedule(schedule)
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / 3 / (m + (p - 1) / 3)
    return 0.0  # zbv, with m >= 2p - 1 (checked by schedule_problem)


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """Microbatches' worth of this rank's activations held at its peak (see the module docstring)."""
    check_schedule(schedule)
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 1.0  # gradient accumulation runs its microbatches one after another
    if schedule == "gpipe":
        return float(m)
    if schedule == "zbv":
        return float(min(p, m))
    if v == 1:  # 1f1b, zero_bubble (ZB-H1)
        return float(min(p - rank, m))
    chunk_forwards = min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    return chunk_forwards / v


def split_layers(layers: int, chunks: int) -> list[int]:
    """Layers per pipeline chunk, as even as possible; when uneven, the chunks at both ends
    (which also hold the embedding and the output head) get the fewer layers.

    This is Llama 3's balancing (Grattafiori et al. 2024, Sec. 3.3.2: one layer fewer on the
    first and the last stage, 126 = 7 + 14 x 8 + 7 over 16 stages).
    """
    if chunks > layers:
        raise ValueError(f"{chunks} pipeline chunks cannot split {layers} layers: each needs at least one.")
    base, extra = divmod(layers, chunks)
    # Middle chunks first: order by distance from the nearer end, farthest first.
    order = sorted(range(chunks), key=lambda c: (-min(c, chunks - 1 - c), c))
    counts = [base] * chunks
    for c in order[:extra]:
        counts[c] += 1
    return counts


def chunks_of_rank(schedule: str, pp: int, virtual_stages: int, rank: int) -> list[int]:
    """The model chunks (0 = embedding side) that pipeline rank ``rank`` holds.

    Loop placement (chunk ``c`` on rank ``c mod p``) except ZB-V's V shape, where rank ``r``
    holds chunks ``r`` and ``2p - 1 - r``, so rank 0 holds both the first and the last chunk.
    """
    if schedule == "zbv" and pp > 1:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual_stages)]


@dataclass(frozen=True)
class RankLayers:
    """What one pipeline rank holds: its layer indices, the embedding and/or the output head,
    how many chunk boundaries it sends across, and its peak in-flight microbatches."""

    rank: int
    layers: tuple[int, ...]
    embedding: bool
    head: bool
    sends_forward: int  # chunks whose output goes to another rank (not the last chunk)
    sends_backward: int  # chunks whose input gradient goes to another rank (not chunk 0)
    in_flight: float


def pipeline_ranks(layers: int, schedule: str, pp: int, virtual_stages: int, microbatches: int) -> list[RankLayers]:
    """Each pipeline rank's share of ``layers`` layers (see :func:`split_layers`)."""
    chunks = pp * virtual_stages if pp > 1 else 1
    counts = split_layers(layers, chunks)
    starts = [sum(counts[:c]) for c in range(chunks)]
    result = []
    for rank in range(pp):
        owned = chunks_of_rank(schedule, pp, virtual_stages, rank) if pp > 1 else [0]
        indices = tuple(i for c in sorted(owned) for i in range(starts[c], starts[c] + counts[c]))
        result.append(
            RankLayers(
                rank=rank,
                layers=indices,
                embedding=0 in owned,
                head=chunks - 1 in owned,
                sends_forward=sum(c != chunks - 1 for c in owned) if pp > 1 else 0,
                sends_backward=sum(c != 0 for c in owned) if pp > 1 else 0,
                in_flight=in_flight_microbatches(schedule, pp, microbatches, virtual_stages, rank),
            )
        )
    return result
