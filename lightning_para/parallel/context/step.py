"""Context parallelism inside Lightning steps: the batch split, the step mode, the loss over the sequence.

:func:`apply_context_parallel` returns a :class:`ContextParallel`, which the strategy uses around
every step (training, validation, test, predict, and the pipeline schedule's stages):

* **Batch split.** Each cp rank gets its load-balanced (head-tail) chunks of the batch:
  :meth:`ContextParallelShard.split_batch` by default splits every tensor with at least two
  dims along dim 1, the sequence. A LightningModule overrides that with a hook::

      def context_parallel_batch(self, batch, shard: ContextParallelShard):
          ids, labels = batch["input_ids"], batch["labels"]
          local = shard.split(ids)
          return {"input_ids": local, "labels": shard.split(labels),
                  "position_ids": shard.position_ids(ids.shape[1], batch_size=ids.shape[0]),
                  "attention_mask": torch.ones_like(local)}

* **Positions.** Any submodule (the LightningModule included) with a
  ``set_context_parallel(shard)`` method is told its rank's :class:`ContextParallelShard` once,
  at setup, so a module that builds positions from the local length can ask
  :meth:`ContextParallelShard.local_positions` for the global ones instead (the GPT recipe's
  RoPE and learned positions do).
* **Attention.** :class:`ContextParallelStepMode` routes ``F.scaled_dot_product_attention`` to
  ring or all-to-all attention (see :mod:`.attention` for the contract).
* **Loss over the whole sequence.** ``F.cross_entropy`` with ``reduction="mean"`` or ``"sum"``
  returns, on every cp rank, the loss of the *whole* sequence (one all-reduce of two numbers
  over cp), so logged and returned losses equal one device's. Its gradient is this rank's
  share scaled so that averaging gradients over ``dp x cp`` (what data parallelism does) gives
  the single-device gradient -- exact even when ``ignore_index`` leaves the cp ranks different
  numbers of tokens. Other losses keep their local value; their gradients are exact for a mean
  over tokens when every rank holds the same number of tokens.
* **Contract check.** A step in which no rank called SDPA raises ``ValueError`` (the model's
  attention would silently see only the local chunks).

This module imports nothing from the rest of ``lightning_para``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_para.parallel.context.attention import SDPA_CONTRACT, ContextParallelSDPA
from lightning_para.parallel.context.sharding import (
    position_ids_for_rank,
    shard_sequence,
    unshard_sequence,
    valid_cp_sizes,
)

__all__ = ["ContextParallel", "ContextParallelShard", "ContextParallelStepMode", "apply_context_parallel"]

BATCH_HOOK = "context_parallel_batch"
MODULE_HOOK = "set_context_parallel"
_SDPA = F.scaled_dot_product_attention
_CROSS_ENTROPY = F.cross_entropy
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


@dataclass(frozen=True)
class ContextParallelShard:
    """This rank's place in its cp group: what a batch hook or a position-aware module needs.

    Attributes:
        cp_rank: this rank's index in the cp group.
        cp: the cp degree.
        load_balance: the head-tail layout (chunks ``r`` and ``2cp-1-r`` of ``2cp``); otherwise
            the ``r``-th of ``cp`` contiguous slices.
    """

    cp_rank: int
    cp: int
    load_balance: bool = True

    def split(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's chunks of ``tensor`` along ``dim`` (``ValueError`` naming ``cp`` if they do not divide it)."""
        self.check_length(tensor.shape[dim])
        return shard_sequence(tensor, self.cp_rank, self.cp, dim=dim, load_balance=self.load_balance)

    def check_length(self, seq_len: int) -> None:
        """Raise ``ValueError`` naming ``cp`` and the valid choices unless ``seq_len`` can be split."""
        chunks = 2 * self.cp if self.load_balance else self.cp
        if seq_len % chunks == 0:
            return
        choices = sorted({1, *valid_cp_sizes(seq_len, load_balance=self.load_balance)})  # cp=1 splits nothing
        how = f"2*cp={chunks} equal chunks (load-balanced, for causal attention)" if self.load_balance else f"{chunks} equal chunks"
        hint = ", or set cp_load_balance=False (then cp alone must divide it)" if self.load_balance else ""
        raise ValueError(
            f"ParaStrategy(cp={self.cp}) splits every sequence (dim 1 of the batch tensors) into {how}, but a"
            f" sequence has {seq_len} tokens. Choose cp in {choices}, pad sequences to a multiple of {chunks}{hint}."
        )

    def split_batch(self, batch: Any) -> Any:
        """The default split: every tensor with at least two dims, along dim 1 (nested lists, tuples, dicts)."""
        if isinstance(batch, Tensor):
            return self.split(batch, 1) if batch.dim() >= 2 else batch
        if isinstance(batch, Mapping):
            return type(batch)({k: self.split_batch(v) for k, v in batch.items()})  # type: ignore[call-arg]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(self.split_batch(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.split_batch(v) for v in batch)
        return batch

    def position_ids(
        self, seq_len: int, *, batch_size: Optional[int] = None, device: Optional[torch.device] = None
    ) -> Tensor:
        """Global positions of this rank's tokens of a ``seq_len``-token sequence: ``[seq_len / cp]``,
        or ``[batch_size, seq_len / cp]`` (what HF models take as ``position_ids``)."""
        self.check_length(seq_len)
        positions = position_ids_for_rank(seq_len, self.cp_rank, self.cp, self.load_balance, device=device)
        return positions if batch_size is None else positions.expand(batch_size, -1)

    def local_positions(self, local_len: int, device: Optional[torch.device] = None) -> Tensor:
        """Global positions of a local shard of ``local_len`` tokens (for RoPE / position embeddings)."""
        return self.position_ids(local_len * self.cp, device=device)


class ContextParallelStepMode(ContextParallelSDPA):
    """The mode around a step under cp: SDPA becomes context-parallel, cross-entropy covers the sequence.

    ``tp`` is only used in error messages (Ulysses' head split happens on each tp rank's heads).
    """

    def __init__(self, group: dist.ProcessGroup, *, method: str, load_balance: bool, tp: int = 1) -> None:
        super().__init__(group, method=method, load_balance=load_balance)
        self.cp = dist.get_world_size(group)
        self.tp = tp

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _CROSS_ENTROPY:
            return self._cross_entropy(func, args, kwargs)
        if func is _SDPA and self.method == "all_to_all":
            self._check_ulysses_heads(args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def _check_ulysses_heads(self, args: tuple, kwargs: dict) -> None:
        q = args[0] if args else kwargs.get("query")
        k = args[1] if len(args) > 1 else kwargs.get("key")
        if not (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4 and k.dim() == 4):
            return  # the SDPA contract check reports it
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % self.cp or kv_heads % self.cp:
            common = math.gcd(heads, kv_heads)
            choices = [c for c in range(1, common + 1) if common % c == 0]
            per_rank = f" per tp rank (tp={self.tp})" if self.tp > 1 else ""
            raise ValueError(
                f"cp_method='all_to_all' (Ulysses) splits the attention heads over cp={self.cp}, but the attention"
                f" has {heads} query heads and {kv_heads} kv heads{per_rank}: num_heads={heads * self.tp} and"
                f" num_kv_heads={kv_heads * self.tp} must both be divisible by cp x tp = {self.cp * self.tp}."
                f" Choose cp in {choices}, or use cp_method='ring'."
            )

    def _cross_entropy(self, func: Callable[..., Tensor], args: tuple, kwargs: dict) -> Tensor:
        try:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return func(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        reduction = a["reduction"]
        legacy = a["size_average"] is not None or a["reduce"] is not None
        if legacy or reduction not in ("mean", "sum"):
            return func(*args, **kwargs)  # per-token losses ("none"): the caller reduces them
        a["reduction"] = "sum"
        local_sum = _plain(func(**a))
        if reduction == "mean":
            count = _tokens_counted(a["input"], a["target"], a["weight"], a["ignore_index"])
        else:
            count = torch.ones((), device=local_sum.device)
        stats = torch.stack([local_sum.detach().float(), count.to(local_sum.device).float()])
        dist.all_reduce(stats, group=self.group)
        total, tokens = stats[0], stats[1]
        value = total / tokens if reduction == "mean" else total
        scale = self.cp / tokens if reduction == "mean" else torch.tensor(float(self.cp), device=total.device)
        scaled = local_sum * scale.to(local_sum.dtype)
        # Value: the whole sequence's loss. Gradient: this rank's share, times cp / tokens, so the
        # dp x cp gradient average equals the gradient of the whole batch's loss.
        return value.to(local_sum.dtype) + (scaled - scaled.detach())


def _plain(loss: Tensor) -> Tensor:
    """A scalar loss as a plain tensor (loss parallel returns a replicated DTensor)."""
    if isinstance(loss, DTensor):
        return loss.to_local() if all(p.is_replicate() for p in loss.placements) else loss.full_tensor()
    return loss


def _tokens_counted(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int) -> Tensor:
    """The denominator of ``F.cross_entropy(..., reduction="mean")`` for this rank's tokens."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            target = target.full_tensor()
        if target.is_floating_point():  # class probabilities: the mean is over every position
            classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
            return torch.tensor(float(logits.numel() // classes), device=target.device)
        valid = target != ignore_index
        if weight is None:
            return valid.sum()
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        return (weight[target.masked_fill(~valid, 0)] * valid).sum()


class ContextParallel:
    """What the strategy needs of context parallelism around each step (made by :func:`apply_context_parallel`)."""

    def __init__(self, cp_mesh: DeviceMesh, *, method: str, load_balance: bool, tp: int = 1) -> None:
        self.mesh = cp_mesh
        self.group = cp_mesh.get_group()
        self.shard = ContextParallelShard(cp_mesh.get_local_rank(), cp_mesh.size(), load_balance)
        self.method = method
        self.tp = tp
        self.checked = False  # whether a step has shown that the model's attention goes through SDPA
        self._local_len: Optional[int] = None

    @property
    def cp(self) -> int:
        return self.shard.cp

    def mode(self) -> ContextParallelStepMode:
        """A fresh mode for one step, or for one recomputation under activation checkpointing (torch-function
        modes are not active in backward, where a checkpointed block's forward runs again)."""
        return ContextParallelStepMode(self.group, method=self.method, load_balance=self.shard.load_balance, tp=self.tp)

    def split_batch(self, module: nn.Module, batch: Any) -> Any:
        """This rank's part of ``batch``: the module's ``context_parallel_batch(batch, shard)`` hook, or the default."""
        hook = getattr(module, BATCH_HOOK, None)
        local = hook(batch, self.shard) if callable(hook) else self.shard.split_batch(batch)
        first = _first_sequence(local)
        self._local_len = first.shape[1] if first is not None else None
        return local

    def split_step_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A Lightning step's ``(batch, batch_idx, ...)`` with the batch replaced by this rank's part."""
        if args:
            return (self.split_batch(module, args[0]), *args[1:]), kwargs
        if "batch" in kwargs:
            return args, {**kwargs, "batch": self.split_batch(module, kwargs["batch"])}
        return args, kwargs

    def gather_output(self, output: Any) -> Any:
        """Predictions in natural order: tensors whose dim 1 is this rank's sequence length are all-gathered."""
        if isinstance(output, Tensor):
            if output.dim() >= 2 and output.shape[1] == self._local_len:
                return unshard_sequence(output, self.group, dim=1, load_balance=self.shard.load_balance)
            return output
        if isinstance(output, Mapping):
            return type(output)({k: self.gather_output(v) for k, v in output.items()})  # type: ignore[call-arg]
        if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
            return type(output)(self.gather_output(v) for v in output)
        return output

    def check_attention_reached(self, mode: ContextParallelStepMode) -> None:
        """After the first step: raise on every rank if no rank's model called SDPA (one all-reduce, once)."""
        if self.checked:
            return
        calls = torch.tensor([float(mode.calls)], device=self.mesh.device_type)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # pipeline stages without attention count on the others
        self.checked = True
        if calls.item() == 0:
            raise ValueError(
                f"ParaStrategy(cp={self.cp}) splits each sequence over {self.cp} ranks, but the model's forward never"
                " called torch.nn.functional.scaled_dot_product_attention, so its attention would only see this"
                f" rank's chunk. Context parallelism needs attention through SDPA: {SDPA_CONTRACT}. (Hugging Face"
                " models: load them with attn_implementation='sdpa'.) Or set cp=1."
            )


def _first_sequence(batch: Any) -> Optional[Tensor]:
    if isinstance(batch, Tensor):
        return batch if batch.dim() >= 2 else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_sequence(value)
        if found is not None:
            return found
    return None


def apply_context_parallel(
    module: nn.Module, cp_mesh: DeviceMesh, *, method: str = "ring", load_balance: bool = True, tp: int = 1
) -> ContextParallel:
    """Set up context parallelism over ``cp_mesh`` for ``module``: tell every submodule with a
    ``set_context_parallel(shard)`` method its :class:`ContextParallelShard`, and return the
    :class:`ContextParallel` the strategy uses around each step."""
    context = ContextParallel(cp_mesh, method=method, load_balance=load_balance, tp=tp)
    for sub in module.modules():
        hook = getattr(sub, MODULE_HOOK, None)
        if callable(hook):
            hook(context.shard)
    return context
