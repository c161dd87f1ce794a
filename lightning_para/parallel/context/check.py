"""The first-step check: does the model compute under cp what it computes on the whole sequence?

A model that numbers its tokens from the local length (``arange(x.shape[1])`` for RoPE or a
learned position table), shifts labels inside a chunk or builds a mask from the local chunk
trains a *different* model under cp, silently. Nothing in its code says so, so the strategy
tests it once, before the first cp step:

1. a short prefix of the batch (every tensor of >= 2 dims cut to ``P`` tokens along dim 1;
   ``P`` is at most ``PREFIX_CHUNK_TOKENS`` tokens per chunk, ``2cp`` chunks) runs through the
   same Lightning step twice, in eval mode and without gradients, with ``self.log`` muted and
   the random state restored afterwards:

   * on the whole prefix, on every rank, with ordinary attention (adapters inactive, position-aware
     modules told a one-rank shard);
   * split over cp as in training (the batch hook, the adapters, ring / all-to-all attention);

2. the query, key and value of every attention call of the cp run must equal this rank's rows of
   the whole-prefix run. Attention is where positions act (RoPE rotates q and k; a learned
   position table changes the hidden states before the first q), so wrong positions show
   there, whatever the model, and one comparison covers every layer.

Cost: two forwards without gradients of ``batch x P`` tokens (``P <= 16 cp`` by default), the
attention of the cp run's collectives, and one all-reduce of a number, at the first step only.
Pipeline-parallel layouts skip it (stages see activations, not the batch).

This module imports nothing from the rest of ``lightning_para`` outside ``parallel/context``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_para.parallel.context.documents import document_attention
from lightning_para.parallel.context.sharding import ContextParallelShard, shard_sequence

__all__ = ["PREFIX_CHUNK_TOKENS", "PositionCheck", "SDPARecorder", "prefix_length", "run_position_check"]

PREFIX_CHUNK_TOKENS = 8  # tokens per chunk of the check's prefix: 2cp chunks (load-balanced)
# Largest relative difference (max |cp - full| / max |full|) of any attention input that still
# counts as equal: fp32 reorders sums (~1e-7 per op, ~1e-6 after a few layers); bf16/fp16
# round each op to ~4e-3. A wrong position moves RoPE's fastest pair by a radian: O(1).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
LOW_PRECISION_TOLERANCE = 5e-2

_SDPA = F.scaled_dot_product_attention
_QKV = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    + [inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL), inspect.Parameter("kw", inspect.Parameter.VAR_KEYWORD)]
)


def attention_inputs(args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """``(query, key, value)`` of an SDPA call, detached copies (``None`` if they cannot be read)."""
    try:
        bound = _QKV.bind(*args, **kwargs)
    except TypeError:
        return None
    q, k, v = (bound.arguments[n] for n in ("query", "key", "value"))
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return None
    return q.detach().clone(), k.detach().clone(), v.detach().clone()


class SDPARecorder(TorchFunctionMode):
    """Record the q, k, v of every ``F.scaled_dot_product_attention`` (or ``document_attention``) call; change
    nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Optional[tuple[Tensor, Tensor, Tensor]]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA or func is document_attention:
            self.calls.append(attention_inputs(args, kwargs))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class PositionCheck:
    """What the first-step check found on this rank (the error is the maximum over every rank).

    Attributes:
        prefix: tokens of the prefix it ran.
        calls: attention calls compared.
        error: the largest relative difference of an attention input, over every rank.
        where: ``"call 0 (the first attention), query"`` for the largest one on this rank.
        tolerance: the largest difference that counts as equal.
    """

    prefix: int
    calls: int
    error: float
    where: str
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def prefix_length(seq_len: int, shard: ContextParallelShard, multiple: int = 1) -> int:
    """Tokens of the check's prefix: ``2cp`` (or ``cp``) chunks of at most ``PREFIX_CHUNK_TOKENS``
    tokens, a multiple of ``multiple`` per rank (sequence parallelism splits the local tokens over tp),
    at most the sequence; 0 if no such prefix exists."""
    chunks = 2 * shard.cp if shard.load_balance else shard.cp
    unit = chunks * multiple
    per_chunk = max(1, min(seq_len // unit, PREFIX_CHUNK_TOKENS))
    length = unit * per_chunk
    return length if length <= seq_len else 0


def _sequence_length(batch: Any) -> Optional[int]:
    if isinstance(batch, Tensor):
        return batch.shape[1] if batch.dim() >= 2 else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _sequence_length(value)
        if found is not None:
            return found
    return None


def _cut(batch: Any, seq_len: int, length: int) -> Any:
    """Every tensor of >= 2 dims whose dim 1 is the sequence, cut to its first ``length`` tokens."""
    if isinstance(batch, Tensor):
        return batch[:, :length] if batch.dim() >= 2 and batch.shape[1] == seq_len else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _cut(v, seq_len, length) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_cut(v, seq_len, length) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cut(v, seq_len, length) for v in batch)
    return batch


@contextlib.contextmanager
def _quiet(module: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients, ``self.log``/``self.log_dict`` muted, the random state restored afterwards."""
    was_training = module.training
    muted = [name for name in ("log", "log_dict") if callable(getattr(module, name, None))]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for name in muted:
            module.__dict__[name] = lambda *args, **kwargs: None  # an instance attribute shadows the method
        module.train(False)
        try:
            yield
        finally:
            module.train(was_training)
            for name in muted:
                module.__dict__.pop(name, None)


def _same_heads(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query k/v with repeated heads on one side only (transformers repeats them when it passes a
    mask, and not without one): repeat the other side's heads likewise (SDPA's ``enable_gqa`` convention)."""
    if a.dim() == 4 and b.dim() == 4 and a.shape[1] != b.shape[1]:
        few, many = (a, b) if a.shape[1] < b.shape[1] else (b, a)
        if few.shape[1] and many.shape[1] % few.shape[1] == 0:
            few = few.repeat_interleave(many.shape[1] // few.shape[1], dim=1)
            return (few, many) if a.shape[1] < b.shape[1] else (many, few)
    return a, b


def _relative(a: Tensor, b: Tensor) -> float:
    """``max |a - b| / max |b|`` in float64 (inf if the shapes differ, 0 for an all-zero pair)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    if diff != diff:  # NaN on one side only
        return 0.0 if bool(torch.isnan(a).eq(torch.isnan(b)).all()) else float("inf")
    return diff / scale if scale > 0 else diff


def run_position_check(
    batch: Any,
    *,
    shard: ContextParallelShard,
    module: nn.Module,
    run_full: Callable[[Any], Any],
    run_split: Callable[[Any], list[Optional[tuple[Tensor, Tensor, Tensor]]]],
    told: list[nn.Module],
    sequence_multiple: int = 1,
    device: str = "cpu",
) -> Optional[PositionCheck]:
    """Run the check on a prefix of ``batch`` (see the module docstring); ``None`` if the batch has no sequence.

    ``run_full(prefix)`` runs the step on the whole prefix (plain attention); ``run_split(prefix)``
    splits the prefix as in training, runs the step under cp and returns the recorded attention
    inputs. ``told`` are the modules with ``set_context_parallel``: they are told a one-rank shard
    for the whole-prefix run and their shard again after it. One all-reduce (MAX) over the default
    process group, so every rank gets the same answer (call it on every rank).
    """
    seq_len = _sequence_length(batch)
    length = prefix_length(seq_len, shard, sequence_multiple) if seq_len is not None else 0
    worst, where, calls, tolerance = 0.0, "", 0, 0.0
    if length:
        prefix = _cut(batch, seq_len, length)
        whole = ContextParallelShard(0, 1, shard.load_balance)
        with _quiet(module):
            state = torch.get_rng_state()
            recorder = SDPARecorder()
            try:
                for sub in told:
                    sub.set_context_parallel(whole)
                with recorder:
                    run_full(prefix)
            finally:
                for sub in told:
                    sub.set_context_parallel(shard)
            torch.set_rng_state(state)
            split_calls = run_split(prefix)
        calls = len(split_calls)
        if len(recorder.calls) != len(split_calls):
            worst, where = float("inf"), (
                f"the whole prefix made {len(recorder.calls)} attention calls and the cp run {len(split_calls)}"
            )
        for i, (full, local) in enumerate(zip(recorder.calls, split_calls)):
            if full is None or local is None:
                continue
            for name, f, l in zip(("query", "key", "value"), full, local):
                if f.dim() != 4 or f.shape[2] != l.shape[2] * shard.cp:
                    err = float("inf")
                else:
                    expected = shard_sequence(f, shard.cp_rank, shard.cp, dim=2, load_balance=shard.load_balance)
                    err = _relative(*_same_heads(l, expected))
                tolerance = max(tolerance, TOLERANCE.get(f.dtype, LOW_PRECISION_TOLERANCE))
                if err > worst:
                    worst, where = err, f"{name} of attention call {i} (0 is the first)"
    flag = torch.tensor([min(worst, 1e30), float(length)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag[1].item() == 0:
        return None
    return PositionCheck(
        prefix=length, calls=calls, error=float(flag[0].item()), where=where or "-", tolerance=tolerance or 1e-3
    )
