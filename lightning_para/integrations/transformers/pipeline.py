"""``pipeline_spec(model)``: a ready :class:`~lightning_para.PipelineSpec` for a transformers causal LM.

Decoder-only causal LMs of transformers share one shape: ``model.embed_tokens``, ``model.layers``
(decoder layers), ``model.norm``, ``model.rotary_emb`` and ``lm_head`` (Llama, Mistral, Mixtral,
Qwen2/Qwen3 and their MoE variants, OLMoE, Phi-3, Gemma, ...). The model's own ``forward``
computes positions, the rotary table and the causal mask once, from ``inputs_embeds.shape``, and
passes them to every decoder layer. Under pipeline parallelism no rank runs that ``forward``, so:

* the pipeline layers are the model's **own modules** ``[embed_tokens, *layers, norm, lm_head]``,
  which keep their names (checkpoints stay ``save_pretrained``-compatible, tensor-parallel plans
  find them);
* each decoder layer gets a forward pre-hook that, when the layer is called without
  ``position_embeddings`` (as a pipeline layer, ``x = layer(x)``), computes what the model would:
  ``position_ids = arange(seq)``, ``rotary_emb(hidden, position_ids)`` and the causal (or
  sliding-window, per ``config.layer_types``) mask from the transformers mask helpers, with the
  model's config and attention implementation. Called by the model itself, the hook does
  nothing. Under sequence parallelism the stream is a global-shaped DTensor, so ``seq`` is the
  whole sequence here too;
* the loss is the model's own ``loss_function`` (labels shifted inside, ``-100`` ignored),
  weighted so that the microbatch mean equals the batch's token mean however padding falls.

Batches: a dict with ``input_ids`` (and optional ``labels``, ``attention_mask``), a pair
``(input_ids, labels)`` or ``input_ids`` alone (labels = input_ids), in the transformers
convention: labels are *not* shifted. Right padding is supported (padded labels become
``-100``; causal attention never lets a real token see a later pad), left padding is refused.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.integrations.transformers.context import context_parallel_runtime
from lightning_para.parallel.pipeline.spec import PipelineSpec
from lightning_para.parallel.tensor.loss import IGNORE_INDEX, causal_lm_loss
REQUIRED = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
# Config fields whose non-default values add computation in the model's forward that the pipeline
# layers do not reproduce (logit soft-capping, logit/embedding scaling).
UNSUPPORTED_CONFIG = {
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "logit_scale": None,
    "logits_scaling": 1.0, "embedding_multiplier": 1.0,
}


def check_causal_lm(model: nn.Module, what: str = "pipeline_spec") -> None:
    """Raise ``ValueError`` naming the class and what is missing unless ``model`` has the shape above."""
    missing = []
    for path in REQUIRED:
        try:
            model.get_submodule(path)
        except AttributeError:
            missing.append(path)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not missing and not isinstance(layers, nn.ModuleList):
        missing.append("model.layers as an nn.ModuleList")
    if not missing and not isinstance(model.get_submodule("lm_head"), nn.Linear):
        missing.append("lm_head as an nn.Linear")
    if getattr(model, "config", None) is None:
        missing.append("config (a transformers PretrainedConfig)")
    if missing:
        raise ValueError(
            f"{what} does not know the architecture `{type(model).__name__}`: it supports decoder-only causal LMs"
            f" of transformers shaped like LlamaForCausalLM ({', '.join(REQUIRED)}), and this model has no"
            f" {', '.join(missing)}. Pass the causal LM itself (e.g. `self.model` holding `AutoModelForCausalLM`),"
            " or write a `configure_pipeline()` for it (docs/pipeline_parallel.md)."
        )
    config = model.config
    extra = [f"config.{k}={getattr(config, k)!r}" for k, default in UNSUPPORTED_CONFIG.items()
             if getattr(config, k, default) not in (default, None)]
    if extra:
        raise ValueError(
            f"{what} cannot pipeline `{type(model).__name__}` with {', '.join(extra)}: the model's forward applies it"
            " outside its layers, which the pipeline stages would skip. Write a `configure_pipeline()` for it."
        )


class _LayerInputs:
    """What the model's forward hands every decoder layer, computed inside the stage that runs it.

    Cached per (batch, sequence, dtype, device) so a stage of many layers builds them once.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cache: dict[tuple, tuple[Any, Any, Tensor]] = {}

    def mask_kind(self, layer: nn.Module) -> str:
        config = self.model.config
        layer_types = getattr(config, "layer_types", None)
        index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
        if isinstance(layer_types, (list, tuple)) and isinstance(index, int) and index < len(layer_types):
            return "sliding" if layer_types[index] == "sliding_attention" else "full"
        return "sliding" if getattr(config, "sliding_window", None) is not None else "full"

    def __call__(self, layer: nn.Module, hidden: Tensor) -> dict[str, Any]:
        kind = self.mask_kind(layer)
        key = (kind, hidden.shape[0], hidden.shape[1], hidden.dtype, hidden.device)
        if key not in self.cache:
            # optional: transformers is imported only when a transformers model runs in a pipeline
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            make_mask = create_sliding_window_causal_mask if kind == "sliding" else create_causal_mask
            # transformers renamed `past_key_values` to `cache` here (the old name warns from 5.2x on).
            no_cache = {"cache" if "cache" in inspect.signature(make_mask).parameters else "past_key_values": None}
            mask = make_mask(
                config=self.model.config, inputs_embeds=hidden, attention_mask=None, position_ids=position_ids,
                **no_cache,
            )
            with torch.no_grad():
                rotary = self.model.model.rotary_emb(hidden, position_ids=position_ids)
            self.cache = {k: v for k, v in list(self.cache.items())[-7:]}  # a few shapes (train, eval)
            self.cache[key] = (mask, rotary, position_ids)
        mask, rotary, position_ids = self.cache[key]
        return {"attention_mask": mask, "position_embeddings": rotary, "position_ids": position_ids}


def _fill_layer_inputs(inputs: _LayerInputs, layer: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    if kwargs.get("position_embeddings") is not None:
        return None  # called by the model's own forward: it passed everything
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor):
        return None
    return args, {**kwargs, **inputs(layer, hidden)}


def _first_output(layer: nn.Module, args: tuple, output: Any) -> Any:
    # Older decoder layers return (hidden_states, ...): the next pipeline layer takes hidden_states only.
    return output[0] if isinstance(output, tuple) else output


# One set of hooks per decoder layer, however often configure_pipeline() is called (weak: keeps no layer alive).
_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _install_layer_hooks(model: nn.Module) -> None:
    inputs = _LayerInputs(model)
    for layer in model.model.layers:
        if layer in _HOOKED:
            continue
        layer.register_forward_pre_hook(lambda m, a, k, inputs=inputs: _fill_layer_inputs(inputs, m, a, k), with_kwargs=True)
        layer.register_forward_hook(_first_output)
        _HOOKED.add(layer)


class _Batch:
    """Splits batches in the transformers convention and remembers the whole batch's label count,
    so each microbatch's loss is weighted to give the batch's token mean (as ``model(labels=...)``)."""

    def __init__(self, split: Optional[Callable[[Any], tuple[Any, Any]]]) -> None:
        self.split = split
        self.batch_size = 1
        self.num_items: Optional[Tensor] = None

    def __call__(self, batch: Any) -> tuple[Tensor, Tensor]:
        input_ids, labels = self.split(batch) if self.split is not None else split_causal_lm_batch(batch)
        self.batch_size = labels.shape[0]
        self.num_items = (labels[..., 1:] != IGNORE_INDEX).sum()
        return input_ids, labels


def split_causal_lm_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` of a batch: a dict (``input_ids``, optional ``labels``/``attention_mask``),
    a pair ``(input_ids, labels)`` or ``input_ids``; labels unshifted, padding as ``-100``."""
    mask = None
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"pipeline_spec: a dict batch needs `input_ids`; got keys {sorted(batch)}.")
        input_ids, labels, mask = batch["input_ids"], batch.get("labels"), batch.get("attention_mask")
        if batch.get("position_ids") is not None or batch.get("inputs_embeds") is not None:
            raise ValueError("pipeline_spec: batches with `position_ids` or `inputs_embeds` are not supported; pass input_ids.")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        input_ids, labels = batch
    elif isinstance(batch, Tensor):
        input_ids, labels = batch, None
    else:
        raise ValueError(
            "pipeline_spec: a batch must be a dict with `input_ids` (and optional `labels`, `attention_mask`),"
            f" a pair (input_ids, labels) or an input_ids tensor; got {type(batch).__name__}."
        )
    labels = input_ids if labels is None else labels
    if mask is not None and not bool(mask.all()):
        mask = mask.to(torch.int64)
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "pipeline_spec: the attention_mask has padding before real tokens (left padding or holes). Pipeline"
                " stages compute causal masks and positions from the sequence alone, which is exact for right"
                " padding only: pad on the right (tokenizer.padding_side='right')."
            )
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return input_ids, labels


def pipeline_spec(
    model: nn.Module,
    *,
    split_batch: Optional[Callable[[Any], tuple[Any, Any]]] = None,
    log_name: Optional[str] = "loss",
) -> PipelineSpec:
    """A :class:`~lightning_para.PipelineSpec` for a transformers decoder-only causal LM::

        class MyModule(L.LightningModule):
            def configure_pipeline(self):
                return pipeline_spec(self.model)   # self.model = AutoModelForCausalLM.from_...(...)

    ``split_batch``: ``batch -> (input_ids, labels)`` in the transformers convention (labels aligned
    with the inputs, shifted by the loss), if batches are not one of the forms in the module docstring.
    Raises ``ValueError`` naming the class and what is missing for an architecture it does not know.
    """
    check_causal_lm(model)
    runtime = context_parallel_runtime(model)
    if runtime is not None and runtime.shard.cp > 1:
        # Its stages build positions, the causal mask and the label shift from the chunk they see.
        raise ValueError(
            f"pipeline_spec: `{type(model).__name__}` under pp x cp (cp={runtime.shard.cp}) is not supported: the"
            " pipeline stages would number each rank's chunks from 0 and shift labels inside them. Use cp without pp"
            " (the model's own forward gets its global positions), or pp without cp."
        )
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"pipeline_spec: `{type(model).__name__}` has config.output_router_logits=True, but the router auxiliary"
            " loss needs every layer's routing statistics of the whole batch, which pipeline stages and microbatches"
            " split apart. Set config.output_router_logits=False for pp>1 (experts still train through the routing"
            " weights), or train with pp=1: tp, ep and dp keep the exact auxiliary loss."
        )
    _install_layer_hooks(model)
    batches = _Batch(split_batch)
    vocab_size = model.config.vocab_size
    loss_function = getattr(model, "loss_function", None)

    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        # The token mean of the whole batch, whatever the microbatch: sum / (batch tokens * b / B).
        share = batches.num_items.to(logits.device) * labels.shape[0] / batches.batch_size
        if callable(loss_function):
            return loss_function(logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=share)
        return causal_lm_loss(logits, labels, vocab_size, share)

    base = model.model
    return PipelineSpec(
        layers=[base.embed_tokens, *base.layers, base.norm, model.lm_head],
        split_batch=batches,
        loss_fn=loss_fn,
        log_name=log_name,
    )


__all__ = ["causal_lm_loss", "check_causal_lm", "pipeline_spec", "split_causal_lm_batch"]
