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
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_para.parallel.context.adapters import ContextParallelRuntime, context_parallel_adapters
from lightning_para.parallel.context.attention import SDPA_CONTRACT, ContextParallelSDPA
from lightning_para.parallel.context.check import PositionCheck, run_position_check
from lightning_para.parallel.context.documents import document_attention
from lightning_para.parallel.context.sharding import ContextParallelShard, unshard_sequence

__all__ = ["ContextParallel", "ContextParallelShard", "ContextParallelStepMode", "apply_context_parallel"]

BATCH_HOOK = "context_parallel_batch"
MODULE_HOOK = "set_context_parallel"
_SDPA = F.scaled_dot_product_attention
_CROSS_ENTROPY = F.cross_entropy
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


class ContextParallelStepMode(ContextParallelSDPA):
    """The mode around a step under cp: SDPA becomes context-parallel, cross-entropy covers the sequence.

    ``tp`` is only used in error messages (Ulysses' head split happens on each tp rank's heads).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        method: str,
        load_balance: bool,
        tp: int = 1,
        runtime: Optional[ContextParallelRuntime] = None,
    ) -> None:
        super().__init__(group, method=method, load_balance=load_balance)
        self.cp = dist.get_world_size(group)
        self.tp = tp
        self.runtime = runtime  # adapters' hooks act only while a step mode is entered

    def key_valid(self) -> Optional[Tensor]:
        """The padding an adapter found in this forward's attention mask (``runtime.key_valid``)."""
        return self.runtime.key_valid if self.runtime is not None else None

    def document_ids(self) -> Optional[Tensor]:
        """The documents an adapter found in this forward's inputs (``runtime.document_ids``)."""
        return self.runtime.document_ids if self.runtime is not None else None

    def __enter__(self) -> "ContextParallelStepMode":
        if self.runtime is not None:
            self.runtime.enter()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self.runtime is not None:
                self.runtime.exit()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _CROSS_ENTROPY:
            return self._cross_entropy(func, args, kwargs)
        if (func is _SDPA or func is document_attention) and self.method == "all_to_all":
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
        self.positions_checked = False  # whether the first-step position check ran (.check)
        self.runtime = ContextParallelRuntime(self.shard, self.group)
        self.adapted: list[tuple[str, str]] = []  # (module name, adapter name) set by apply_context_parallel
        self.told: list[str] = []  # modules with set_context_parallel, told their shard
        self._detach: list[Callable[[], None]] = []
        self._local_len: Optional[int] = None

    @property
    def cp(self) -> int:
        return self.shard.cp

    @staticmethod
    def tell(module: nn.Module, shard: ContextParallelShard) -> None:
        """Call ``module.set_context_parallel(shard)`` (the position contract for models without an adapter)."""
        getattr(module, MODULE_HOOK)(shard)

    def mode(self) -> ContextParallelStepMode:
        """A fresh mode for one step, or for one recomputation under activation checkpointing (torch-function
        modes are not active in backward, where a checkpointed block's forward runs again)."""
        return ContextParallelStepMode(
            self.group, method=self.method, load_balance=self.shard.load_balance, tp=self.tp, runtime=self.runtime
        )

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

    def check_positions(
        self, module: nn.Module, batch: Any, run: Callable[[Any], Any], *, sequence_multiple: int = 1
    ) -> Optional[PositionCheck]:
        """Before the first cp step: raise ``ValueError`` on every rank if the model computes something
        else under cp than on the whole sequence (:mod:`.check`). ``run(batch)`` runs the Lightning
        step on a batch (the strategy's step, without the cp split). Returns what was measured."""
        self.positions_checked = True
        told = [sub for sub in module.modules() if callable(getattr(sub, MODULE_HOOK, None))]

        def run_split(prefix: Any) -> list:
            local_len = self._local_len
            local = self.split_batch(module, prefix)
            self._local_len = local_len
            mode = self.mode()
            mode.recorded = []
            with mode:
                run(local)
            return mode.recorded

        result = run_position_check(
            batch, shard=self.shard, module=module, run_full=run, run_split=run_split, told=told,
            sequence_multiple=sequence_multiple, device=self.mesh.device_type,
        )
        if result is not None and not result.ok:
            raise ValueError(self._position_error(result))
        return result

    def _position_error(self, result: PositionCheck) -> str:
        adapted = ", ".join(f"{name or '<root>'} ({adapter})" for name, adapter in self.adapted)
        told = ", ".join(name or "<root>" for name in self.told)
        found = (
            (f" Adapters covered: {adapted}." if adapted else " No registered adapter claimed any submodule"
             f" (adapters: {', '.join(a.supports for a in context_parallel_adapters()) or 'none'}).")
            + (f" Told their shard through set_context_parallel: {told}." if told else "")
        )
        return (
            f"ParaStrategy(cp={self.cp}) would train a different model than one device: on a {result.prefix}-token"
            f" prefix of the first batch, the {result.where} differs between the cp run and the whole sequence by"
            f" {result.error:.3g} (relative; at most {result.tolerance:g} is rounding). Something in the model is"
            " computed from this rank's chunk of the sequence instead of the whole sequence: most often positions"
            " built from the local length (torch.arange(x.shape[1]) for RoPE or a position embedding), labels"
            " shifted inside a chunk, or a mask built from the chunk (document ids must be split like the tokens)."
            " Give the model its global positions with one of: a method `set_context_parallel(self, shard)` on the"
            " submodule that builds positions (keep the shard; use `shard.local_positions(x.shape[1],"
            " device=x.device)` instead of arange), or a LightningModule hook `context_parallel_batch(self,"
            " batch, shard)` that returns this rank's batch with `shard.position_ids(seq_len, batch_size=B)` for"
            " the model (docs/context_parallel.md,"
            f' "Positions: the contract").{found} Or set cp=1. (cp_check=False skips this check.)'
        )

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
    """Set up context parallelism over ``cp_mesh`` for ``module`` and return the :class:`ContextParallel`
    the strategy uses around each step.

    Walks the module tree once: a submodule that a registered adapter claims (:mod:`.adapters`;
    e.g. a Hugging Face ``PreTrainedModel``) gets the adapter's hooks, and the adapter covers
    everything inside it; every submodule with a ``set_context_parallel(shard)`` method is told
    its rank's :class:`ContextParallelShard`. No communication."""
    context = ContextParallel(cp_mesh, method=method, load_balance=load_balance, tp=tp)
    adapters = context_parallel_adapters()
    claimed: list[str] = []
    for name, sub in module.named_modules():
        inside = any(name == c or name.startswith(c + ".") if c else True for c in claimed)
        if not inside:
            adapter = next((a for a in adapters if a.claims(sub)), None)
            if adapter is not None:
                context._detach.append(adapter.attach(sub, context.runtime))
                context.adapted.append((name, adapter.name))
                claimed.append(name)
        if callable(getattr(sub, MODULE_HOOK, None)):
            context.tell(sub, context.shard)
            context.told.append(name)
    return context
