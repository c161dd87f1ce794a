"""The model arguments that ``lightning-para plan`` and ``lightning-para dryrun`` share.

``--model`` names a preset (:data:`lightning_para.plan.presets.PRESETS`) or a Hugging Face
``config.json``; the shape arguments (``--layers --hidden --heads --kv-heads --ffn --vocab
--experts --experts-per-token --expert-ffn``) either describe a model on their own or replace
those fields of ``--model``'s. :func:`resolve_model` turns them into one
:class:`~lightning_para.plan.model.ModelDesc`, with errors that name the argument.
"""

from __future__ import annotations

import argparse
from typing import Optional

from lightning_para.plan.hf_config import from_hf_config
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.presets import PRESETS, preset

# (argument, ModelDesc field, minimum value)
SHAPE_ARGUMENTS: tuple[tuple[str, str, int], ...] = (
    ("layers", "layers", 1),
    ("hidden", "hidden", 1),
    ("heads", "heads", 1),
    ("kv_heads", "kv_heads", 1),
    ("ffn", "ffn", 1),
    ("vocab", "vocab", 1),
    ("experts", "num_experts", 0),
    ("experts_per_token", "top_k", 1),
    ("expert_ffn", "moe_ffn", 1),
)
REQUIRED_WITHOUT_MODEL = ("layers", "hidden", "heads", "ffn", "vocab")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def model_name(text: str) -> str:
    """``--model``: a preset name or a Hugging Face ``config.json`` path (argparse exits 2 otherwise)."""
    if text in PRESETS or text.endswith(".json"):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(map(repr, sorted(PRESETS)))}, or a config.json path)"
    )


def add_shape_arguments(parser: argparse.ArgumentParser, extra: str = "") -> None:
    """The shape arguments, as one argument group of ``parser`` (``--model`` is the caller's)."""
    group = parser.add_argument_group(
        "model shape",
        "Without --model: a Llama-style model (SwiGLU, RMSNorm, RoPE, untied, no biases) of these shapes;"
        " --layers, --hidden, --heads, --ffn and --vocab are required. With --model: each one given replaces"
        " that field of the preset or config.json (the rest are kept; the head dim is derived again as"
        " hidden / heads unless the config.json states head_dim)." + extra,
    )
    group.add_argument("--layers", type=int, help="transformer layers (num_hidden_layers)")
    group.add_argument("--hidden", type=int, help="hidden size (hidden_size)")
    group.add_argument("--heads", type=int, help="attention heads (num_attention_heads)")
    group.add_argument("--kv-heads", type=int, help="key/value heads, GQA (num_key_value_heads; default: --heads)")
    group.add_argument("--ffn", type=int, help="dense MLP width (intermediate_size)")
    group.add_argument("--vocab", type=int, help="vocabulary size (vocab_size)")
    group.add_argument("--experts", type=int, help="routed experts per MoE layer (0: dense)")
    group.add_argument("--experts-per-token", type=int, help="routed experts per token, top-k (num_experts_per_tok)")
    group.add_argument("--expert-ffn", type=int, help="width of one routed expert (moe_intermediate_size; default: --ffn)")


def shape_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The shape arguments given, by argument name (``kv_heads``, ``experts_per_token``, ...)."""
    return {name: getattr(args, name) for name, _, _ in SHAPE_ARGUMENTS if getattr(args, name, None) is not None}


def resolve_model(model: Optional[str], shapes: dict[str, int]) -> ModelDesc:
    """One :class:`ModelDesc` from ``--model`` (a preset, a config.json path or ``None``) and the
    shape arguments given (:func:`shape_overrides`). Raises ``ValueError`` naming the argument."""
    minimum = {name: low for name, _, low in SHAPE_ARGUMENTS}
    for name, value in shapes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum[name]:
            raise ValueError(f"`{_flag(name)} {value}` must be an integer >= {minimum[name]}.")
    if model is None:
        missing = [_flag(n) for n in REQUIRED_WITHOUT_MODEL if n not in shapes]
        if missing:
            raise ValueError(
                "Give `--model` (a preset or a config.json path), or the model's shape: "
                + " ".join(_flag(n) for n in REQUIRED_WITHOUT_MODEL) + f" (missing: {' '.join(missing)})."
            )
        base: Optional[ModelDesc] = None
        source = ""
    elif model.endswith(".json"):
        try:
            base = from_hf_config(model)
        except OSError as err:
            raise ValueError(f"`--model {model}`: cannot read it ({err}).") from None
        source = f" (from `--model {model}`)"
    elif model in PRESETS:
        base = preset(model)
        source = f" (from `--model {model}`)"
    else:
        raise ValueError(f"`--model {model}` is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json path.")

    def value(name: str, field: str) -> Optional[int]:
        if name in shapes:
            return shapes[name]
        return getattr(base, field) if base is not None else None

    def said(name: str, field: str) -> str:
        """How an error names a value: the argument given, or where it came from."""
        v = value(name, field)
        return f"`{_flag(name)} {v}`" if name in shapes else f"`{field}={v}`{source}"

    hidden, heads = value("hidden", "hidden"), value("heads", "heads")
    # The head dim is derived from hidden / heads unless the base states it (a config.json's head_dim,
    # DeepSeek-V3's MLA); a shape change re-derives it.
    explicit_head_dim = base is not None and base.head_dim is not None and "head_dim" not in base._derived
    if not explicit_head_dim and hidden % heads:  # type: ignore[operator]
        raise ValueError(f"{said('hidden', 'hidden')} is not divisible by {said('heads', 'heads')}: "
                         "the head dim is hidden / heads. Change one of them.")
    kv_given = "kv_heads" in shapes or (base is not None and "kv_heads" not in base._derived)
    kv_heads = value("kv_heads", "kv_heads") if kv_given else heads
    if heads % kv_heads:  # type: ignore[operator]
        raise ValueError(f"{said('kv_heads', 'kv_heads')} must divide {said('heads', 'heads')} "
                         "(grouped-query attention shares each key/value head among heads / kv_heads heads).")
    experts = value("experts", "num_experts") or 0
    if experts == 0:
        for name in ("experts_per_token", "expert_ffn"):
            if name in shapes:
                raise ValueError(f"`{_flag(name)} {shapes[name]}` needs routed experts: give `--experts N` (N > 0).")
    else:
        top_k = value("experts_per_token", "top_k") or 0
        if top_k == 0:
            raise ValueError(f"`--experts {experts}` needs `--experts-per-token K` (the routed experts each token uses).")
        if top_k > experts:
            raise ValueError(f"{said('experts_per_token', 'top_k')} must be at most {said('experts', 'num_experts')}.")

    changes = {field: shapes[name] for name, field, _ in SHAPE_ARGUMENTS if name in shapes}
    if base is None:
        return ModelDesc(**changes, name="custom")
    if not changes:
        return base
    if experts == 0 and base.is_moe:  # `--experts 0`: the dense version of an MoE model
        changes.update(top_k=0, moe_ffn=None, shared_expert_ffn=0, first_k_dense=0)
    if base.attention_params is not None and {"hidden", "heads", "kv_heads"} & set(shapes):
        changes["attention_params"] = None  # a fixed attention count (MLA) no longer fits the new shape
    if base.pipeline_units is not None and "layers" in shapes:
        changes["pipeline_units"] = None
    label = ",".join(f"{name.replace('_', '-')}={v}" for name, v in shapes.items())
    return base.with_changes(**changes, name=f"{base.name}[{label}]")


__all__ = ["SHAPE_ARGUMENTS", "add_shape_arguments", "model_name", "resolve_model", "shape_overrides"]
