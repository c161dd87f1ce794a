"""Validating a tensor-parallel plan before anything is sharded (no communication).

:func:`check_plan` checks that styles fit module types, every split dimension divides by tp,
no ``nn.Linear`` is left unplanned, sequence-parallel regions are closed and tied weights get
one layout. Every rank sees the same model, so every rank raises the same ``ValueError``
before any collective: nothing hangs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_para._dtensor import tied_parameter_groups
from lightning_para.spec.dims import divisors
from lightning_para.parallel.tensor.adapters import tensor_parallel_adapter
from lightning_para.parallel.tensor.columns import FusedBlocksColwise
from lightning_para.parallel.tensor.plan import HEAD_ATTRS, KV_HEAD_ATTRS, Style, config_head_counts, head_attributes
from lightning_para.parallel.tensor.styles import COVERS_DESCENDANTS, LINEAR_STYLES, SHORTHANDS


def check_plan(
    module: nn.Module, plan: Mapping[str, Style], tp: int, *, sequence_parallel: bool, unplanned: str = "error"
) -> dict[str, dict[str, int]]:
    """Validate ``plan`` for ``tp`` ranks; returns the head attributes to divide per attention module.

    ``unplanned="replicate"`` accepts ``nn.Linear`` modules the plan leaves out as whole on every tp
    rank, where that is correct (outside attention/MLP sublayers, without sequence parallel).
    Raises ``ValueError`` (identically on every rank: no communication here).
    """
    modules = dict(module.named_modules())
    problems: list[str] = []
    splits: list[tuple[str, str, int]] = []  # (what, where, size) that tp must divide
    heads: dict[str, dict[str, int]] = {}

    for fqn, style in plan.items():
        m = modules[fqn]
        if isinstance(style, FusedBlocksColwise):
            try:
                style.check(fqn, getattr(m, "out_features", -1), 1)  # the sizes; tp below, with the other splits
            except ValueError as error:
                problems.append(str(error))
            rows = style.rows
            if rows.layout == "interleaved":
                splits.append(("interleaved groups of the fused blocks", fqn, rows.groups))
            else:
                splits += [(f"units ({style.unit}) of fused block {i}", fqn, b // style.unit) for i, b in enumerate(rows.blocks)]
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
        elif style == "attention" and tensor_parallel_adapter(m) is not None:
            # Head counts a registered adapter reads from outside the module (LitGPT's shared config).
            heads[fqn] = {}
            for attr, value in tensor_parallel_adapter(m).head_counts(m).items():
                splits.append((f"attention heads `{attr}`", fqn, value))
        elif style == "attention":
            heads[fqn] = head_attributes(m, _attention_width(fqn, m, plan))
            for attr, value in heads[fqn].items():
                what = "key/value heads" if attr in KV_HEAD_ATTRS else "attention heads" if attr in HEAD_ATTRS else "attention width"
                splits.append((f"{what} `{attr}`", fqn, value))
            # Head counts in the model's config (Hugging Face attention reshapes with -1 and head_dim,
            # so only whole heads per rank keep it right): checked, never divided (the config is shared).
            for attr, value in config_head_counts(m).items():
                if attr not in heads[fqn]:
                    what = "key/value heads" if attr in KV_HEAD_ATTRS else "attention heads"
                    splits.append((f"{what} `config.{attr}`", fqn, value))
    if problems:
        raise ValueError("Invalid tensor-parallel plan:\n  " + "\n  ".join(problems))

    bad = [(what, where, size) for what, where, size in splits if size % tp]
    if bad:
        valid = divisors(math.gcd(*[s for _, _, s in splits]))
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
    _check_coverage(modules, plan, sequence_parallel, replicate_unplanned=unplanned == "replicate")
    _check_tied(module, plan, sequence_parallel)
    return heads


# The layout each shorthand gives a module's weight (tied weights must agree before anything is sharded).
_WEIGHT_LAYOUT = {"vocab_parallel": "Shard(0)", "lm_head": "Shard(0)", "colwise": "Shard(0)", "rowwise": "Shard(1)",
                  "fused_qkv": "_StridedShard(0)", "fused_gate_up": "_StridedShard(0)"}


def _check_tied(module: nn.Module, plan: Mapping[str, Style], sequence_parallel: bool) -> None:
    for group in tied_parameter_groups(module):
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
        if child_fqn.startswith(fqn + ".") and isinstance(style, FusedBlocksColwise):
            return style.rows.blocks[0] if style.rows.layout == "contiguous" else -1
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


def _check_coverage(
    modules: Mapping[str, nn.Module], plan: Mapping[str, Style], sequence_parallel: bool, replicate_unplanned: bool = False
) -> None:
    unplanned, shard_params, sp_params, open_colwise = [], [], [], []
    for fqn, m in modules.items():
        if not fqn or fqn in plan or _covered(fqn, plan):
            if fqn in plan and sequence_parallel and plan[fqn] in ("colwise", "fused_qkv", "fused_gate_up"):
                if _sublayer_of(fqn, plan) is None:
                    open_colwise.append(fqn)
            continue
        if isinstance(m, nn.Linear) and not replicate_unplanned:
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
            " purpose, or ParaStrategy(tp_unplanned='replicate') to keep every unplanned Linear whole on every tp"
            " rank (as Lightning's ModelParallelStrategy leaves modules your plan does not name)."
            f" Styles: {', '.join(SHORTHANDS)}. See docs/tensor_parallel.md.{hint}"
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


__all__ = ["check_plan"]
