"""Tensor-parallel plans: where they come from, how patterns match, automatic discovery.

A plan maps module-name patterns to styles (a shorthand from
:data:`~lightning_para.parallel.tp_styles.SHORTHANDS` or a ``ParallelStyle``). Precedence:

1. ``ParaStrategy(tp_plan=...)``: patterns relative to the LightningModule; replaces 2 and 3
   (``tp_plan="auto"`` forces 3).
2. Declared: any module (the LightningModule or a submodule such as a block class) may define
   ``tensor_parallel_plan(self) -> dict``; its patterns are relative to that module, so a
   ``Block`` class can declare ``{"attn.c_attn": "fused_qkv", ...}`` once for every block.
3. Automatic (:func:`auto_plan`): common transformer layouts by name, then by shape.

Pattern syntax: dot-separated module names; each segment is an ``fnmatch`` glob within one
name (``blocks.*.attn.q_proj``, ``h.[0-3].mlp.c_fc``); ``**`` matches any number of
segments (``**.c_fc``). The patterns of one plan must not give one module two styles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Optional, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_para._dtensor import parameter_owners
from lightning_para.moe import MoE
from lightning_para.parallel.tensor.adapters import tensor_parallel_adapter

Style = Union[str, ParallelStyle]
PLAN_HOOK = "tensor_parallel_plan"

# Leaf names, lower case. Sources: nanoGPT/GPT-2, HF Llama/Mistral/Qwen/Phi, torchtitan, Megatron.
_FUSED_QKV = {"c_attn", "qkv", "qkv_proj", "wqkv", "in_proj", "att_proj", "w_qkv", "to_qkv"}
_INTERLEAVED_QKV = {"query_key_value"}  # GPT-NeoX/BLOOM: [head0 q k v, head1 q k v, ...] -> plain colwise
_QKV = {"q_proj", "k_proj", "v_proj", "q", "k", "v", "wq", "wk", "wv", "query", "key", "value",
        "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin", "c_q", "c_k", "c_v"}
_OUT = {"o_proj", "out_proj", "wo", "o", "c_proj", "proj", "dense", "to_out", "out_lin", "output_proj",
        "fc2", "fc_out", "down_proj", "w2", "dense_4h_to_h", "lin2", "down", "c_fc2", "proj_out"}
_MLP_IN = {"c_fc", "fc1", "fc_in", "up_proj", "gate_proj", "w1", "w3", "dense_h_to_4h", "lin1", "wi",
           "wi_0", "wi_1", "up", "gate", "c_fc1", "fc", "proj_in"}
_FUSED_GATE_UP = {"gate_up_proj", "w13", "w12"}
_HEAD_NAMES = {"lm_head", "output", "head", "embed_out", "out_head", "unembed", "logits"}
_TOKEN_EMBEDDING_NAMES = {"wte", "tok_embeddings", "embed_tokens", "word_embeddings", "token_embedding", "tok_emb",
                          "embedding", "embeddings", "token_embeddings", "emb"}
_MOE_CLASS = re.compile(r"moe|mixtureofexperts", re.IGNORECASE)
_SUBLAYER_NAMES = _FUSED_QKV | _INTERLEAVED_QKV | _QKV | _OUT | _MLP_IN | _FUSED_GATE_UP

# Integer attributes of an attention module that attention code reshapes with (divided by tp).
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nheads", "n_local_heads", "heads")
KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_local_kv_heads", "kv_heads")
WIDTH_ATTRS = ("n_embd", "hidden_size", "embed_dim", "d_model", "all_head_size", "inner_dim", "dim")


def is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith("Norm") or "LayerNorm" in name


def is_moe(module: nn.Module) -> bool:
    """Our MoE layer, or a module whose class name says it is one (expert parallelism splits those, not tp)."""
    return isinstance(module, MoE) or bool(_MOE_CLASS.search(type(module).__name__))


# ----------------------------------------------------------------------------- patterns
def match(pattern: str, fqn: str) -> bool:
    """Segment-wise glob match of a module name (``**`` spans any number of segments)."""

    def rec(p: list[str], n: list[str]) -> bool:
        if not p:
            return not n
        if p[0] == "**":
            return any(rec(p[1:], n[i:]) for i in range(len(n) + 1))
        return bool(n) and fnmatchcase(n[0], p[0]) and rec(p[1:], n[1:])

    return rec(pattern.split(".") if pattern else [], fqn.split(".") if fqn else [])


def expand(
    root: nn.Module, plan: Mapping[str, Style], prefix: str = "", source: str = "plan", names: Optional[list[str]] = None,
) -> dict[str, Style]:
    """Module FQNs (relative to the model root) -> style, for every pattern of ``plan``.

    ``prefix`` is the FQN of the module that declared the plan; ``names``: the root's module names a pattern may
    match (default: all). Raises ``ValueError`` for a pattern that matches nothing (a typo) or for two styles on
    one module.
    """
    names = [n for n, _ in root.named_modules() if n] if names is None else names
    out: dict[str, Style] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, (str, ParallelStyle)):
            raise ValueError(f"A {source} maps module-name patterns (str) to styles (str or ParallelStyle); got {pattern!r}: {style!r}.")
        full = f"{prefix}.{pattern}" if prefix and pattern else (prefix or pattern)
        hits = [n for n in names if match(full, n)]
        if not hits:
            raise ValueError(
                f"The {source} pattern {pattern!r} matches no module. Module names look like:"
                f" {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}."
            )
        for n in hits:
            if n in out and out[n] is not style and out[n] != style:
                raise ValueError(f"Module {n!r} gets two tensor-parallel styles from the {source}: {out[n]!r} and {style!r}.")
            out[n] = style
    return out


def declared_plan(root: nn.Module) -> dict[str, Style]:
    """Merge ``tensor_parallel_plan()`` of the root and every submodule (each relative to itself)."""
    out: dict[str, Style] = {}
    names = [n for n, _ in root.named_modules() if n]
    for name, module in root.named_modules():
        hook = getattr(type(module), PLAN_HOOK, None)
        if hook is None:
            continue
        plan = module.tensor_parallel_plan()
        # Its patterns are relative to it: only its own modules can match (one plan per block stays linear in depth).
        under = [n for n in names if n == name or n.startswith(name + ".")] if name else names
        source = f"tensor_parallel_plan() of {name or 'the root module'}"
        for fqn, style in expand(root, plan or {}, name, source, under).items():
            if fqn in out and out[fqn] != style:
                raise ValueError(f"Module {fqn!r} gets two styles from declared plans: {out[fqn]!r} and {style!r}.")
            out[fqn] = style
    return out


def resolve_plan(root: nn.Module, override: Any = None) -> tuple[dict[str, Style], str]:
    """The FQN -> style plan for ``root`` and where it came from (``override``, ``declared``, ``auto``)."""
    if override is not None and override != "auto":
        if not isinstance(override, Mapping):
            raise ValueError(f"`tp_plan` must be a dict of module-name pattern -> style, or 'auto'; got {type(override).__name__}.")
        return expand(root, override, "", "tp_plan"), "override"
    if override is None and any(getattr(type(m), PLAN_HOOK, None) for m in root.modules()):
        return declared_plan(root), "declared"
    return auto_plan(root), "auto"


@dataclass
class ModulePlan:
    """A plan resolved once on the whole model and keyed by module *identity*.

    Each planned module appears once, under its first (canonical) name in the whole model,
    however many names reach it later: user wrappers, ``ModuleList``\ s of references, a
    pipeline stage that holds it under another parent. :meth:`for_part` gives the plan of any
    part of the model (a pipeline stage) in that part's own names.
    """

    source: str  # "override", "declared" or "auto"
    entries: list[tuple[str, nn.Module, Style]] = field(default_factory=list)  # (canonical name, module, style)

    @property
    def by_name(self) -> dict[str, Style]:
        return {name: style for name, _, style in self.entries}

    def for_part(self, part: nn.Module) -> dict[str, Style]:
        """``{name in part: style}`` for the planned modules that ``part`` holds (each once)."""
        names: dict[int, str] = {}
        for name, module in part.named_modules():
            names.setdefault(id(module), name)
        return {names[id(m)]: style for _, m, style in self.entries if id(m) in names and names[id(m)]}


def plan_modules(root: nn.Module, override: Any = None) -> ModulePlan:
    """Resolve the plan of the whole model (see :func:`resolve_plan`) and key it by module."""
    plan, source = resolve_plan(root, override)
    return ModulePlan(source, [(name, root.get_submodule(name), style) for name, style in plan.items()])


# ----------------------------------------------------------------------------- head attributes
def head_attributes(module: nn.Module, q_width: int) -> dict[str, int]:
    """The head-count / width attributes of an attention module (to divide by tp)."""
    found: dict[str, int] = {}
    for attr in HEAD_ATTRS + KV_HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[attr] = value
    for attr in WIDTH_ATTRS:
        value = getattr(module, attr, None)
        # Only a width that *is* the attention width: other widths (e.g. a model dim that
        # differs from n_head * head_dim) are not per-rank quantities.
        if isinstance(value, int) and not isinstance(value, bool) and value == q_width:
            found[attr] = value
    return found


def config_head_counts(module: nn.Module) -> dict[str, int]:
    """Head counts an attention module reads from its model config (Hugging Face: ``self.config``).

    Checked against tp but never divided: the config object is shared by every layer and by
    code outside the attention (the model computes ``num_key_value_groups`` from it once).
    """
    config = getattr(module, "config", None)
    found: dict[str, int] = {}
    for attr in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[attr] = value
    return found


# ----------------------------------------------------------------------------- automatic plan
def _leaf(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1].lower()


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _in_block(root: nn.Module, fqn: str) -> bool:
    """Whether ``fqn`` lies inside an entry of an ``nn.ModuleList``/``nn.Sequential`` (a block)."""
    parts = fqn.split(".")
    for i in range(1, len(parts)):
        if isinstance(root.get_submodule(".".join(parts[:i])), (nn.ModuleList, nn.Sequential)):
            return True
    return False


def auto_plan(root: nn.Module) -> dict[str, str]:
    """Derive a plan for common transformer layouts (see docs/tensor_parallel.md, "Automatic plan").

    Modules it cannot classify are left out; the unplanned-Linear check then lists them.
    """
    modules = dict(root.named_modules())
    plan: dict[str, str] = {}
    moe_roots = [n for n, m in modules.items() if n and is_moe(m)]
    for n in moe_roots:
        if not any(n.startswith(r + ".") for r in moe_roots if r != n):
            plan[n] = "gather_sequence"  # experts are split by expert parallelism, not tp

    def in_moe(fqn: str) -> bool:
        return any(fqn == r or fqn.startswith(r + ".") for r in moe_roots)

    # --- attention modules a registered adapter knows (LitGPT: head counts in a shared config):
    # the adapter gives their children's styles; the generic rules below leave them alone.
    adapted: dict[str, str] = {}
    for n, m in modules.items():
        adapter = tensor_parallel_adapter(m) if n and not in_moe(n) else None
        if adapter is not None:
            adapted[n] = "attention"
            plan.update({f"{n}.{child}": style for child, style in adapter.plan(m).items()})

    def in_adapted(fqn: str) -> bool:
        return any(fqn.startswith(a + ".") for a in adapted)

    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear) and not in_moe(n) and not in_adapted(n)}
    embeddings = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding) and not in_moe(n)}

    head, token = _head_and_token(root, linears, embeddings)
    hidden = embeddings[token].embedding_dim if token is not None else None
    if token is not None:
        plan[token] = "vocab_parallel"
    if head is not None:
        plan[head] = "lm_head"

    sublayers = _sublayers(linears, head, hidden, plan)
    plan.update(sublayers)
    sublayers.update(adapted)
    plan.update(adapted)

    def in_sublayer(fqn: str) -> bool:
        return any(fqn.startswith(s + ".") for s in sublayers)

    # --- other embeddings of the model width feed the residual stream (position, token type)
    for e, emb in embeddings.items():
        if e != token and emb.embedding_dim == hidden and not in_sublayer(e):
            plan[e] = "sequence_slice"

    # --- norms on the residual stream; inside attention, norms over head_dim (q/k norms) run on
    # this rank's heads. Other parameter-holding modules inside a sublayer are left for the check.
    for n, m in modules.items():
        if not n or not is_norm(m) or in_moe(n):
            continue
        if not in_sublayer(n):
            plan[n] = "norm"
        elif sublayers.get(_parent(n)) == "attention" and _norms_head_dim(m, modules[_parent(n)]):
            plan[n] = "head_norm"
    return plan


def _head_and_token(root: nn.Module, linears: dict[str, nn.Linear], embeddings: dict[str, nn.Embedding]
                    ) -> tuple[Optional[str], Optional[str]]:
    """The output head and the token embedding, found by structure: a Linear whose weight is tied to an Embedding,
    else a Linear (hidden -> vocabulary) matching an Embedding (vocabulary, hidden): head names first, then outside
    the blocks, then anywhere (a user's pipeline wrapper may hold the head inside a ModuleList). A Linear named like
    a projection (q_proj, c_fc...) never is the head, even when vocabulary == width."""
    owners = {pid: [fqn for fqn, _ in held] for pid, held in parameter_owners(root).items()}
    head, token = None, None
    for n, lin in linears.items():
        tied = [o for o in owners[id(lin.weight)] if o != n and o in embeddings]
        if tied:
            head, token = n, tied[0]
            break
    if head is None:
        candidates = [n for n in linears if _leaf(n) not in _SUBLAYER_NAMES]
        for n in sorted(candidates, key=lambda n: (_leaf(n) not in _HEAD_NAMES, _in_block(root, n))):
            lin = linears[n]
            pair = [e for e, emb in embeddings.items() if emb.num_embeddings == lin.out_features and emb.embedding_dim == lin.in_features]
            if pair:
                head, token = n, pair[0]
                break
    if token is None and embeddings:
        named = [e for e in embeddings if _leaf(e) in _TOKEN_EMBEDDING_NAMES]
        token = named[0] if named else max(embeddings, key=lambda e: embeddings[e].num_embeddings)
    if head is None:
        # A pipeline stage may hold the head without the embedding: then the name decides.
        vocab = embeddings[token].num_embeddings if token is not None else None
        named = [
            n for n, lin in linears.items()
            if _leaf(n) in _HEAD_NAMES and not _in_block(root, n) and vocab in (None, lin.out_features)
        ]
        head = named[0] if named else None
    return head, token


def _sublayers(linears: dict[str, nn.Linear], head: Optional[str], hidden: Optional[int], plan: dict[str, str]
               ) -> dict[str, str]:
    """The sublayers (``{parent: "attention" | "mlp"}``): a parent whose Linears are all classified, with >=1
    colwise and >=1 rowwise; their Linears' styles go into ``plan``."""
    by_parent: dict[str, list[str]] = {}
    for n in linears:
        if n != head:
            by_parent.setdefault(_parent(n), []).append(n)
    sublayers: dict[str, str] = {}
    for parent, names in by_parent.items():
        styles = {n: _classify(n, linears[n], hidden) for n in names}
        if any(s is None for s in styles.values()):
            continue  # left unplanned: the unplanned-Linear check names them
        cols = [n for n, s in styles.items() if s != "rowwise"]
        rows = [n for n, s in styles.items() if s == "rowwise"]
        if not cols or not rows or not parent:
            continue
        is_attention = any(_leaf(n) in _QKV | _FUSED_QKV | _INTERLEAVED_QKV for n in names)
        if is_attention and any(_leaf(n) in _MLP_IN | _FUSED_GATE_UP for n in names):
            continue  # attention and MLP projections in one module: no single sublayer input
        plan.update(styles)
        sublayers[parent] = "attention" if is_attention else "mlp"
    return sublayers


def _norms_head_dim(norm: nn.Module, attention: nn.Module) -> bool:
    """A norm whose weight has the attention's ``head_dim`` elements (q_norm/k_norm), not its width."""
    head_dim = getattr(attention, "head_dim", None)
    weight = getattr(norm, "weight", None)
    return isinstance(head_dim, int) and weight is not None and tuple(weight.shape) == (head_dim,)


def _classify(fqn: str, lin: nn.Linear, hidden: Any) -> Any:
    leaf = _leaf(fqn)
    if leaf in _FUSED_QKV:
        return "fused_qkv"
    if leaf in _FUSED_GATE_UP:
        return "fused_gate_up"
    if leaf in _QKV or leaf in _INTERLEAVED_QKV or leaf in _MLP_IN:
        return "colwise"
    if leaf in _OUT:
        return "rowwise"
    # Unknown name: by shape against the model width (in == hidden -> colwise, out == hidden -> rowwise).
    if hidden is not None and lin.in_features == hidden and lin.out_features != hidden:
        return "colwise"
    if hidden is not None and lin.out_features == hidden and lin.in_features != hidden:
        return "rowwise"
    return None


__all__ = [
    "ModulePlan", "auto_plan", "config_head_counts", "declared_plan", "expand", "head_attributes", "is_moe", "is_norm",
    "match", "plan_modules", "resolve_plan",
]
