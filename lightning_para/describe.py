"""``describe_module(module)``: a :class:`ModelDesc` read off an ``nn.Module`` (meta device is fine).

Duck typing only, no model library imported. The rules, in order of trust:

1. **Layers** are the children of the longest ``nn.ModuleList`` (ties: the one with more
   parameters): nanoGPT's ``transformer.h``, Hugging Face's ``model.layers``, ...
2. **Vocabulary and hidden size** come from the token embedding, the ``nn.Embedding`` (outside
   the blocks) with the most rows; another embedding of width ``hidden`` is a learned position
   table. The output head is tied when an ``nn.Linear`` shares the embedding's weight tensor.
3. **Heads, kv heads, head dim, FFN width, experts, top-k** are read from attributes, first
   of the module's ``config`` (Hugging Face ``num_attention_heads``, ``num_key_value_heads``,
   ``intermediate_size``, ``num_local_experts``, ``num_experts_per_tok``, ...), then of the first
   block's submodules (nanoGPT ``n_head``, ``nn.MultiheadAttention.num_heads``, MoE layers'
   ``num_experts``/``top_k``).
4. **Shapes** fill in the rest: kv heads from the key (or fused QKV) projection, the FFN width
   from the down-projection (the ``nn.Linear`` back to ``hidden`` that is not the attention
   output), a gated MLP from two up-projections, expert widths from stacked ``[E, ., .]``
   weights or an ``experts`` ``ModuleList``.
5. **Pipeline entries** come from ``configure_pipeline()`` (lightning-para's pipeline contract)
   when the module has it: which entry holds the embedding, which layers, the final norm and
   the output head, so the planner splits stages exactly as ParaStrategy will.

The result's parameter count is compared with the module's: a difference over 1% gives a
warning naming both, since the planner's memory figures rest on it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from lightning_para.plan.model import ModelDesc, PipelineUnit

HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "nhead")
KV_HEADS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
FFN = ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner", "mlp_hidden", "dim_feedforward")
EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K = ("top_k", "num_experts_per_tok", "moe_top_k", "num_experts_per_token")
MOE_FFN = ("moe_intermediate_size", "expert_hidden", "moe_ffn_hidden_size")
FUSED_QKV = ("qkv", "c_attn", "query_key_value", "wqkv", "qkv_proj", "in_proj")
KEY_PROJ = ("k_proj", "c_k", "wk", "key", "k")
SHARED = ("shared_expert", "shared_experts", "shared_mlp")


def _int_attr(objects: Iterable[Any], names: tuple[str, ...]) -> Optional[int]:
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _with_configs(modules: Iterable[nn.Module]) -> Iterator[Any]:
    """Each module, preceded by its ``config`` (or Lightning ``hparams``) when it has one."""
    for module in modules:
        for name in ("config", "hparams"):
            config = getattr(module, name, None)
            if config is not None and not isinstance(config, nn.Module):
                yield config
        yield module


def _linears(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> list[tuple[str, nn.Linear]]:
    skipped = {id(m) for s in skip for m in s.modules()}
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear) and id(m) not in skipped]


def _find_blocks(module: nn.Module) -> nn.ModuleList:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"`module` ({type(module).__name__}) has no nn.ModuleList of transformer blocks; pass a ModelDesc instead."
        )
    return max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))


def _moe_part(block: nn.Module) -> Optional[nn.Module]:
    """The MoE submodule of a block: one that names its expert count, or holds ``experts``."""
    for module in block.modules():
        if _int_attr([module], EXPERTS) or isinstance(getattr(module, "experts", None), nn.Module):
            return module
    return None


def _expert_width(moe: nn.Module, hidden: int, num_experts: int) -> tuple[Optional[int], Optional[bool]]:
    """``(width, gated)`` of one routed expert, from stacked weights or an ``experts`` ModuleList."""
    experts = getattr(moe, "experts", moe)
    if isinstance(experts, nn.ModuleList) and len(experts):
        return _mlp_shape(experts[0], hidden, exclude_dim=None)
    widths, matrices = [], 0
    for name, param in experts.named_parameters():
        if param.dim() == 3 and param.shape[0] == num_experts:
            others = [d for d in param.shape[1:] if d != hidden] or [hidden]
            fused = "gate_up" in name
            widths.append(others[0] // 2 if fused else others[0])
            matrices += 2 if fused else 1
    return (min(widths), matrices >= 3) if widths else (None, None)


def _mlp_shape(module: nn.Module, hidden: int, exclude_dim: Optional[int], skip: tuple[nn.Module, ...] = ()):
    """``(width, gated)`` of the MLP in ``module``: the down-projection's input width, and whether
    two matrices (or one fused pair) project up to it."""
    linears = _linears(module, skip)
    downs = [m for _, m in linears if m.out_features == hidden and m.in_features not in (hidden, exclude_dim)]
    if not downs:
        downs = [m for _, m in linears if m.out_features == hidden and m.in_features != exclude_dim]
    if not downs:
        return None, None
    width = downs[-1].in_features
    ups = [m for _, m in linears if m.in_features == hidden and m.out_features in (width, 2 * width)]
    gated = len(ups) >= 2 or any(m.out_features == 2 * width for m in ups)
    return width, gated


def _loss_upcasts(module: nn.Module) -> bool:
    """Whether the module's loss is a transformers model's (a submodule whose class has transformers'
    ``loss_function``): its causal-LM loss casts the logits to fp32 first (``ForCausalLMLoss``), and so does
    the pipeline loss of ``integrations.transformers.pipeline_spec``; and the GPT recipe's with ``loss_fp32=True``."""
    return bool(getattr(module, "loss_fp32", False)) or any(hasattr(type(m), "loss_function") for m in module.modules())


def _norm_upcasts(block: nn.Module) -> bool:
    """Whether the block's RMSNorm is eager code that upcasts its input to fp32 and keeps it for backward
    (transformers' ``LlamaRMSNorm`` and its copies), not torch's fused ``nn.RMSNorm``/``F.rms_norm``."""
    for m in block.modules():
        if "rmsnorm" in type(m).__name__.lower() and not isinstance(m, nn.RMSNorm):
            try:
                source = inspect.getsource(type(m).forward)
            except (OSError, TypeError):  # no source (compiled, built in): assume the fused kernel
                return False
            return "rms_norm(" not in source and ("float32" in source or ".float()" in source)
    return False


def describe_module(module: nn.Module, *, name: Optional[str] = None) -> ModelDesc:
    """Infer a :class:`ModelDesc` from ``module`` (see the module docstring for the rules).

    Raises ``ValueError`` naming what could not be found, e.g. the number of heads.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"`module` must be a torch.nn.Module, got {type(module).__name__}.")
    blocks = _find_blocks(module)
    block_ids = {id(m) for m in blocks.modules()}
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in block_ids]
    if not embeddings:
        raise ValueError("`module` has no nn.Embedding outside its blocks: cannot read the vocabulary size.")
    token = max(embeddings, key=lambda m: m.num_embeddings)
    vocab, hidden = token.num_embeddings, token.embedding_dim
    positions = [m for m in embeddings if m is not token and m.embedding_dim == hidden]
    first = blocks[0]
    roots = list(_with_configs([module]))
    search = roots + list(_with_configs(first.modules()))

    heads, head_dim, kv_heads = _attention_heads(search, first, hidden)
    moe_flags = [_moe_part(block) is not None for block in blocks]
    moe_kwargs = _moe_kwargs(blocks, moe_flags, roots, hidden) if any(moe_flags) else {}
    dense_block = blocks[moe_flags.index(False)] if False in moe_flags else None

    ffn, gated = (None, None)
    if dense_block is not None:
        ffn, gated = _mlp_shape(dense_block, hidden, heads * head_dim)
    if moe_kwargs and gated is None:
        experts_module = _moe_part(blocks[moe_flags.index(True)])
        _, gated = _expert_width(experts_module, hidden, moe_kwargs["num_experts"])  # type: ignore[arg-type]
    ffn = ffn or _int_attr(roots, FFN) or moe_kwargs.get("moe_ffn")
    if ffn is None:
        raise ValueError("Cannot find the FFN width (no down-projection to hidden; looked for " + ", ".join(FFN) + ").")

    norm_kinds = {type(m).__name__.lower() for m in first.modules()}
    block_linears = _linears(first)
    desc = ModelDesc(
        layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, vocab=vocab,
        tied_embeddings=any(isinstance(m, nn.Linear) and m.weight is token.weight for m in module.modules()),
        gated_mlp=bool(gated), norm="rmsnorm" if any("rmsnorm" in k for k in norm_kinds) else "layernorm",
        norm_upcast=_norm_upcasts(first), loss_upcast=_loss_upcasts(module),
        bias=any(m.bias is not None for _, m in block_linears),
        learned_positions=positions[0].num_embeddings if positions else 0,
        dropout=any(isinstance(m, nn.Dropout) and m.p > 0 for m in blocks.modules()),
        name=name or type(module).__name__, **moe_kwargs,
    )
    units = _pipeline_units(module, blocks, token, vocab, desc)
    if units is not None:
        desc = replace(desc, pipeline_units=units)
    actual = sum(p.numel() for p in module.parameters())
    if actual and abs(desc.total_params() - actual) > 0.01 * actual:
        warnings.warn(
            f"describe_module: the description of {desc.name} counts {desc.total_params():,} parameters but the module"
            f" has {actual:,}; memory estimates may be off by the difference. Pass a ModelDesc to correct it.",
            stacklevel=2,
        )
    return desc


def _attention_heads(search: list[Any], first: nn.Module, hidden: int) -> tuple[int, int, int]:
    """``(heads, head_dim, kv_heads)`` from the configs' attributes, else (kv heads) from the key or fused q|k|v
    projection's width."""
    heads = _int_attr(search, HEADS)
    if heads is None:
        raise ValueError("Cannot find the number of attention heads (looked for " + ", ".join(HEADS) + ").")
    head_dim = _int_attr(search, ("head_dim",)) or hidden // heads
    kv_heads = _int_attr(search, KV_HEADS)
    if kv_heads is None:
        for linear_name, linear in _linears(first):
            leaf = linear_name.rsplit(".", 1)[-1].lower()
            if linear.in_features == hidden and leaf in FUSED_QKV:
                kv_heads = (linear.out_features - heads * head_dim) // (2 * head_dim)
                break
            if linear.in_features == hidden and leaf in KEY_PROJ:
                kv_heads = linear.out_features // head_dim
                break
    return heads, head_dim, kv_heads or heads


def _moe_kwargs(blocks: nn.Module, moe_flags: list[bool], roots: list[Any], hidden: int) -> dict[str, Any]:
    """:class:`ModelDesc`'s MoE fields from the first MoE block (experts, top-k, widths, capacity) and where the MoE
    blocks are (``first_k_dense`` + every ``moe_every``-th)."""
    moe = _moe_part(blocks[moe_flags.index(True)])
    moe_search = list(_with_configs(moe.modules())) + roots  # type: ignore[union-attr]
    num_experts = _int_attr(moe_search, EXPERTS)
    if num_experts is None and isinstance(getattr(moe, "experts", None), nn.ModuleList):
        num_experts = len(moe.experts)  # type: ignore[union-attr, arg-type]
    top_k = _int_attr(moe_search, TOP_K)
    if num_experts is None or top_k is None:
        raise ValueError("Found an MoE layer but not its number of experts and top-k (looked for "
                         + ", ".join(EXPERTS + TOP_K) + ").")
    moe_ffn, _ = _expert_width(moe, hidden, num_experts)  # type: ignore[arg-type]
    shared = next((getattr(moe, s) for s in SHARED if isinstance(getattr(moe, s, None), nn.Module)), None)
    indices = [i for i, flag in enumerate(moe_flags) if flag]
    every = indices[1] - indices[0] if len(indices) > 1 else 1
    if indices[0] < every - 1 or indices != list(range(indices[0], len(blocks), every)):
        warnings.warn(
            f"describe_module: MoE layers {indices} do not follow `first_k_dense` + every `moe_every`-th layer;"
            " the description approximates them.",
            stacklevel=3,
        )
        every = min(every, indices[0] + 1)
    kwargs = {
        "num_experts": num_experts, "top_k": top_k,
        "moe_ffn": moe_ffn or _int_attr(moe_search, MOE_FFN),
        "shared_expert_ffn": (_mlp_shape(shared, hidden, None)[0] or 0) if shared is not None else 0,
        "moe_every": every, "first_k_dense": indices[0] - (every - 1),
    }
    capacity = getattr(moe, "capacity_factor", None)
    if isinstance(capacity, (int, float)) and not isinstance(capacity, bool):
        kwargs["capacity_factor"] = float(capacity)
    return kwargs


def _pipeline_units(
    module: nn.Module, blocks: nn.ModuleList, token: nn.Embedding, vocab: int, desc: ModelDesc
) -> Optional[tuple[PipelineUnit, ...]]:
    """The entries of ``module.configure_pipeline()`` as :class:`PipelineUnit` s (``None``: no contract,
    or one the planner cannot map, with a warning saying why)."""
    configure = getattr(module, "configure_pipeline", None)
    if not callable(configure):
        return None
    try:
        spec = configure()
    except ValueError:  # e.g. a tied head, which cannot be pipelined: the default entries stand
        return None
    layers = list(getattr(spec, "layers", None) or [])
    block_ids = {id(m) for m in blocks.modules()}
    outside = [m for m in module.modules() if id(m) not in block_ids]
    head = next((m for m in outside if isinstance(m, nn.Linear) and m.out_features == vocab), None)
    norms = [m for m in outside if "norm" in type(m).__name__.lower() and any(True for _ in m.parameters())]
    final_norm = norms[-1] if norms else None
    units = []
    for entry in layers:
        inside = {id(m) for m in entry.modules()} if isinstance(entry, nn.Module) else set()
        units.append(PipelineUnit(
            layers=tuple(i for i, block in enumerate(blocks) if id(block) in inside),
            embedding=id(token) in inside,
            final_norm=final_norm is not None and id(final_norm) in inside,
            head=head is not None and id(head) in inside,
        ))
    try:
        return replace(desc, pipeline_units=tuple(units)).pipeline_units
    except ValueError as err:
        warnings.warn(
            f"describe_module: configure_pipeline() of {desc.name} does not map onto embedding / layers / head"
            f" ({err}); the planner splits the default entries instead.",
            stacklevel=3,
        )
        return None
