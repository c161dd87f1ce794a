"""Tensor parallelism with sequence parallelism on ``torch.distributed.tensor.parallel``.

:func:`apply_tensor_parallel` turns a module's plan (see :mod:`.tp_plan` and
``docs/tensor_parallel.md``) into torch ``ParallelStyle``\\ s over the 1-D ``tp`` mesh:

1. resolve the plan (strategy override > declared ``tensor_parallel_plan()`` > automatic);
2. validate it *without communication* (:func:`check_plan`): styles fit module types, every
   split dimension divides by tp, no ``nn.Linear`` is left unplanned, sequence-parallel
   regions are closed, tied weights get one layout. Every rank sees the same model, so
   every rank raises the same ``ValueError`` before any collective -- nothing hangs;
3. apply the styles, re-tie tied weights (torch registers a new parameter per module), and
   hook gradients whose layout differs from their parameter's: ``Partial`` ones
   (sequence-parallel norm weights: each rank saw other tokens) are summed over tp right
   after accumulation, before ZeRO, clipping or the optimizer read them.

Loss parallel: with ``loss_parallel=True`` the head's logits stay a DTensor sharded over the
vocabulary; :func:`step_context` makes ``F.cross_entropy`` on them run torch's vocab-parallel
kernel and return an ordinary tensor, and :func:`backward_context` wraps backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.overrides import TorchFunctionMode

from lightning_para.parallel.tp_plan import HEAD_ATTRS, KV_HEAD_ATTRS, Style, head_attributes, resolve_plan
from lightning_para.parallel.tp_styles import COVERS_DESCENDANTS, LINEAR_STYLES, SHORTHANDS, make_style


@dataclass
class TensorParallelInfo:
    """What :func:`apply_tensor_parallel` did (kept on the module as ``_para_tp``)."""

    plan: dict[str, Style]
    source: str  # "override", "declared" or "auto"
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    head_attributes: dict[str, dict[str, int]] = field(default_factory=dict)


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, config: Any) -> TensorParallelInfo:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following its plan (see module docstring)."""
    tp = tp_mesh.size()
    sp, lp = bool(config.sequence_parallel), bool(config.loss_parallel)
    plan, source = resolve_plan(module, config.tp_plan)
    heads = check_plan(module, plan, tp, sequence_parallel=sp)
    tied = _tied_groups(module)

    # Megatron-SP keeps the sequence shard of each sublayer input and all-gathers it again in
    # backward. Activation checkpointing recomputes the whole block anyway, so the two are not
    # combined (the recomputed forward would install the hooks a second time).
    keep_shard = sp and config.activation_checkpointing is None and config.sp_save_input_shard
    for fqn, style in plan.items():
        if isinstance(style, str):
            style = make_style(
                style, sequence_parallel=sp, loss_parallel=lp, head_attributes=heads.get(fqn), keep_shard=keep_shard
            )
        parallelize_module(module.get_submodule(fqn), tp_mesh, style)

    _retie(module, tied)
    for p in module.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_to_param_layout)
    info = TensorParallelInfo(plan, source, tp, sp, lp, heads)
    object.__setattr__(module, "_para_tp", info)
    for fqn in plan:  # found from the LightningModule even when `module` is a pipeline stage
        object.__setattr__(module.get_submodule(fqn), _LOSS_PARALLEL_ATTR, lp)
    return info


# ----------------------------------------------------------------------------- validation
def check_plan(module: nn.Module, plan: Mapping[str, Style], tp: int, *, sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """Validate ``plan`` for ``tp`` ranks; returns the head attributes to divide per attention module.

    Raises ``ValueError`` (identically on every rank: no communication here).
    """
    modules = dict(module.named_modules())
    problems: list[str] = []
    splits: list[tuple[str, str, int]] = []  # (what, where, size) that tp must divide
    heads: dict[str, dict[str, int]] = {}

    for fqn, style in plan.items():
        m = modules[fqn]
        if not isinstance(style, str):
            continue
        if style in LINEAR_STYLES and not isinstance(m, nn.Linear):
            problems.append(f"{fqn!r} is a {type(m).__name__}, but {style!r} applies to nn.Linear.")
        elif style == "vocab_parallel" and not isinstance(m, nn.Embedding):
            problems.append(f"{fqn!r} is a {type(m).__name__}, but 'vocab_parallel' applies to nn.Embedding.")
        elif style in ("colwise", "lm_head"):
            splits.append(("vocabulary size" if style == "lm_head" else "output features", fqn, m.out_features))
        elif style == "rowwise":
            splits.append(("input features (e.g. FFN size)", fqn, m.in_features))
        elif style in ("fused_qkv", "fused_gate_up"):
            parts = 3 if style == "fused_qkv" else 2
            if m.out_features % parts:
                problems.append(f"{fqn!r} has {m.out_features} output features, not {parts} equal blocks for {style!r}.")
            splits.append((f"width of each of the {parts} fused blocks", fqn, m.out_features // parts))
        elif style == "vocab_parallel":
            splits.append(("vocabulary size", fqn, m.num_embeddings))
        elif style == "attention":
            heads[fqn] = head_attributes(m, _attention_width(fqn, m, plan))
            for attr, value in heads[fqn].items():
                what = "key/value heads" if attr in KV_HEAD_ATTRS else "attention heads" if attr in HEAD_ATTRS else "attention width"
                splits.append((f"{what} `{attr}`", fqn, value))
    if problems:
        raise ValueError("Invalid tensor-parallel plan:\n  " + "\n  ".join(problems))

    bad = [(what, where, size) for what, where, size in splits if size % tp]
    if bad:
        valid = _divisors(math.gcd(*[s for _, _, s in splits]))
        # One line per distinct dimension (the same size repeats in every block); heads first.
        first: dict[tuple[str, int], list[str]] = {}
        for what, where, size in sorted(bad, key=lambda b: "heads" not in b[0]):
            first.setdefault((what, size), []).append(where)
        lines = "\n  ".join(
            f"{what} of {where[0]!r}{f' (and {len(where) - 1} more)' if len(where) > 1 else ''} = {size}"
            for (what, size), where in first.items()
        )
        raise ValueError(
            f"tp={tp} does not divide these dimensions:\n  {lines}\nChoose tp in {valid} (the values that divide"
            " every split dimension of this model), or change the model sizes."
        )
    _check_coverage(modules, plan, sequence_parallel)
    _check_tied(module, plan, sequence_parallel)
    return heads


# The layout each shorthand gives a module's weight (tied weights must agree before anything is sharded).
_WEIGHT_LAYOUT = {"vocab_parallel": "Shard(0)", "lm_head": "Shard(0)", "colwise": "Shard(0)", "rowwise": "Shard(1)",
                  "fused_qkv": "_StridedShard(0)", "fused_gate_up": "_StridedShard(0)"}


def _check_tied(module: nn.Module, plan: Mapping[str, Style], sequence_parallel: bool) -> None:
    for group in _tied_groups(module):
        layouts = set()
        for fqn, _ in group:
            style = plan.get(fqn)
            if style is not None and not isinstance(style, str):
                return  # a custom style: checked after it is applied (`_retie`)
            replicated = "Replicate()" if style == "norm" and sequence_parallel else "plain tensor"
            layouts.add(_WEIGHT_LAYOUT.get(style, replicated))
        if len(layouts) > 1:
            names = ", ".join(f"{fqn}.{name} ({plan.get(fqn, 'unplanned')})" for fqn, name in group)
            raise ValueError(
                f"Tied parameters {names} would get different tensor-parallel layouts. Plan the embedding as"
                " 'vocab_parallel' and the output head as 'lm_head' (both split the vocabulary), or untie them."
            )


def _attention_width(fqn: str, attention: nn.Module, plan: Mapping[str, Style]) -> int:
    """Output width of the query projection under an attention module (n_head * head_dim)."""
    for child_fqn, style in plan.items():
        if child_fqn.startswith(fqn + ".") and style in ("colwise", "fused_qkv"):
            lin = attention.get_submodule(child_fqn[len(fqn) + 1 :])
            return lin.out_features // (3 if style == "fused_qkv" else 1)
    return -1


def _covered(fqn: str, plan: Mapping[str, Style]) -> bool:
    """An ancestor replicates this module on purpose (or a custom style handles it)."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        style = plan.get(".".join(parts[:i]))
        if style is not None and (not isinstance(style, str) or style in COVERS_DESCENDANTS):
            return True
    return False


def _sublayer_of(fqn: str, plan: Mapping[str, Style]) -> Any:
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        anc = ".".join(parts[:i])
        if plan.get(anc) in ("attention", "mlp"):
            return anc
    return None


def _check_coverage(modules: Mapping[str, nn.Module], plan: Mapping[str, Style], sequence_parallel: bool) -> None:
    unplanned, shard_params, sp_params, open_colwise = [], [], [], []
    for fqn, m in modules.items():
        if not fqn or fqn in plan or _covered(fqn, plan):
            if fqn in plan and sequence_parallel and plan[fqn] in ("colwise", "fused_qkv", "fused_gate_up"):
                if _sublayer_of(fqn, plan) is None:
                    open_colwise.append(fqn)
            continue
        if isinstance(m, nn.Linear):
            unplanned.append(f"{fqn} ({type(m).__name__} {m.in_features} -> {m.out_features})")
        elif any(True for _ in m.parameters(recurse=False)):
            if _sublayer_of(fqn, plan) is not None:
                shard_params.append(f"{fqn} ({type(m).__name__})")
            elif sequence_parallel:
                sp_params.append(f"{fqn} ({type(m).__name__})")
    if unplanned:
        mha = sorted(fqn for fqn, m in modules.items() if isinstance(m, nn.MultiheadAttention))
        hint = (
            f"\nnn.MultiheadAttention ({', '.join(mha)}) is not split by tensor parallelism: plan it as"
            " 'gather_sequence' to run it whole on every tp rank, or use separate q/k/v Linears."
            if mha else ""
        )
        raise ValueError(
            "Tensor parallel: these nn.Linear modules are not in the plan, and would silently stay whole on"
            " every tp rank:\n  " + "\n  ".join(unplanned) + "\nPlan them with ParaStrategy(tp_plan={pattern: style})"
            " or a `tensor_parallel_plan()` method on the model, e.g. {'blocks.*.attn.q_proj': 'colwise',"
            " 'blocks.*.attn.o_proj': 'rowwise', 'blocks.*.attn': 'attention'}; use 'replicate' to keep one whole on"
            f" purpose. Styles: {', '.join(SHORTHANDS)}. See docs/tensor_parallel.md.{hint}"
        )
    if shard_params:
        raise ValueError(
            "Tensor parallel: these modules hold parameters inside an 'attention'/'mlp' sublayer, where activations"
            " are split over tp, so their gradients would differ per rank:\n  " + "\n  ".join(shard_params)
            + "\nGive them a ParallelStyle in the plan, or move them out of the sublayer."
        )
    if sp_params:
        raise ValueError(
            "Sequence parallel: these modules hold parameters but have no style, so they would see only this"
            " rank's tokens and get partial gradients:\n  " + "\n  ".join(sp_params)
            + "\nPlan norms as 'norm', embeddings added to the residual stream as 'sequence_slice', modules that"
            " need the whole sequence as 'gather_sequence'."
        )
    if open_colwise:
        raise ValueError(
            "Sequence parallel: these column-parallel Linears have no 'attention'/'mlp' parent in the plan, so"
            " nothing gathers their sequence-sharded input:\n  " + "\n  ".join(open_colwise)
            + "\nPlan their parent module as 'attention' or 'mlp'."
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------- tied weights and gradients
def _tied_groups(module: nn.Module) -> list[list[tuple[str, str]]]:
    """(module fqn, parameter name) of every parameter shared by several modules."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, m in module.named_modules(remove_duplicate=False):
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((fqn, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(module: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every member of a tied group at one parameter again (e.g. wte.weight is lm_head.weight)."""
    for group in groups:
        params = [getattr(module.get_submodule(fqn), name) for fqn, name in group]
        first = params[0]
        layouts = {str(p.placements) if isinstance(p, DTensor) else "plain tensor" for p in params}
        if len(layouts) > 1:
            names = ", ".join(f"{fqn}.{name}" for fqn, name in group)
            raise ValueError(
                f"Tied parameters {names} get different tensor-parallel layouts ({sorted(layouts)}). Plan the"
                " embedding as 'vocab_parallel' and the output head as 'lm_head' (both split the vocabulary), or untie them."
            )
        for fqn, name in group[1:]:
            setattr(module.get_submodule(fqn), name, first)


def _grad_to_param_layout(param: torch.Tensor) -> None:
    """Give a gradient its parameter's layout right after accumulation.

    Sequence-parallel norm weights get ``Partial`` gradients (each rank saw other tokens):
    this sums them over tp (an all-reduce of the weight size). Any other mismatch (a
    replicated gradient for a sharded weight) is a local slice. ZeRO, clipping and the
    optimizer then read a gradient whose local tensor matches the parameter's.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def fsdp_shard_placement_fn(dp: int) -> Any:
    """FSDP2 ``shard_placement_fn`` for tensor-parallel parameters (ZeRO-3 over dp on top of TP).

    FSDP2 shards dim 0 by default. On a fused projection's ``_StridedShard(0)`` weight, a dp
    chunk of the tp-local rows mixes q, k and v rows and no placement describes it, so full
    tensors and checkpoints would be wrong. Those weights are sharded along dim 1 instead.
    """
    from torch.distributed.tensor import Shard

    from lightning_para.parallel.tp_styles import is_strided

    def placement(param: nn.Parameter) -> Any:
        if not is_strided(param):
            return None
        if param.dim() < 2 or param.shape[1] % dp:
            raise ValueError(
                f"ZeRO-3 with a fused tensor-parallel projection shards its weight {tuple(param.shape)} along dim 1,"
                f" which needs dp={dp} to divide {param.shape[1] if param.dim() > 1 else 'a second dim'}."
                " Choose a dp that divides the model width, or plan the projection as separate q/k/v Linears."
            )
        return Shard(1)

    return placement


# ----------------------------------------------------------------------------- loss parallel
def _loss_parallel() -> Any:
    """torch's ``loss_parallel()``, unless already active: it is not re-entrant (leaving an
    inner one would switch the loss ops off for the enclosing one)."""
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    active = all(op in handlers for op in customized_loss_ops)
    return contextlib.nullcontext() if active else loss_parallel()


class _CrossEntropyOnShards(TorchFunctionMode):
    """``F.cross_entropy`` on vocab-sharded DTensor logits: torch's loss-parallel kernel, plain result.

    The result is an ordinary tensor (differentiable, identical on every tp rank), so user code
    can add auxiliary losses to it, log it and call ``.item()``. ``label_smoothing`` is not
    supported by the parallel kernel: those calls gather the logits instead.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], DTensor):
            logits = args[0]
            if kwargs.get("label_smoothing", 0.0):
                return func(logits.full_tensor(), *args[1:], **kwargs)
            with _loss_parallel():
                out = func(*args, **kwargs)
            if not isinstance(out, DTensor):  # an enclosing mode of this kind already converted it
                return out
            return out.to_local() if all(p.is_replicate() for p in out.placements) else out.full_tensor()
        return func(*args, **kwargs)


_LOSS_PARALLEL_ATTR = "_para_tp_loss_parallel"


def uses_loss_parallel(module: nn.Module) -> bool:
    """Whether a module (or a submodule, e.g. a pipeline stage's layer) runs loss parallel."""
    cached = module.__dict__.get("_para_uses_loss_parallel")
    if cached is None:
        cached = any(getattr(m, _LOSS_PARALLEL_ATTR, False) for m in module.modules())
        object.__setattr__(module, "_para_uses_loss_parallel", cached)
    return cached


@contextlib.contextmanager
def step_context(module: nn.Module) -> Generator[None, None, None]:
    """Around a training/validation/test/predict step (or a pipeline's last stage) of a
    tensor-parallel module. Backward needs :func:`backward_context`."""
    if not uses_loss_parallel(module):
        yield
        return
    with _CrossEntropyOnShards():
        yield


@contextlib.contextmanager
def backward_context(module: nn.Module) -> Generator[None, None, None]:
    """Around backward: the loss-parallel kernels' backward must see the same custom ops."""
    if not uses_loss_parallel(module):
        yield
        return
    with _loss_parallel():
        yield


def localize_output(output: Any, full: bool = False) -> Any:
    """Scalar DTensors in a step's output (a loss) become plain tensors; ``full`` gathers every DTensor."""
    if isinstance(output, DTensor):
        return output.full_tensor() if full or output.dim() == 0 else output
    if isinstance(output, dict):
        return {k: localize_output(v, full) for k, v in output.items()}
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return type(output)(localize_output(v, full) for v in output)
    return output


__all__ = [
    "TensorParallelInfo", "apply_tensor_parallel", "check_plan", "step_context", "backward_context", "localize_output",
    "fsdp_shard_placement_fn",
]
