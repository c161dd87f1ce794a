"""How sharp a parity model is: can a wrong position, mask, shard or label move its loss?

A tiny transformer initialised with std 0.02-0.1 attends almost uniformly (every key gets
~1/n of the weight) and predicts almost uniformly over the vocabulary. Then wrong positions,
a wrong mask, heads in the wrong order or labels paired with the wrong inputs change the
step-0 loss by less than the 1e-5 parity tolerance (issue 24: cp with local RoPE positions
was 8.7e-6 off at init 0.02, 1.9e-2 off at 0.3). A parity model must therefore be *sharp*:

* its attention rows are far from uniform: mean normalised entropy ``H(p) / log(n)`` (``n``
  the keys a query may see; 1.0 is uniform) at most :data:`MAX_ATTENTION_ENTROPY`;
* its next-token distribution is far from uniform: ``H(softmax(logits)) / log(V)`` at most
  :data:`MAX_OUTPUT_ENTROPY`.

:func:`measure` runs one forward pass and records both, by wrapping
``torch.nn.functional.scaled_dot_product_attention`` (the probabilities are recomputed from
q, k and the mask) and 4-D ``torch.nn.functional.softmax`` calls (attention written out by
hand). It only observes: the forward's own results are returned unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

# Thresholds between the figures measured on the parity models (tests/unit/test_parity_models_sharp.py
# prints them): at their old inits (std 0.02-0.1) attention entropy 0.93-1.00, output entropy
# 0.94-1.00; at std 0.3, 0.23-0.52 and 0.53-0.75.
MAX_ATTENTION_ENTROPY = 0.75
MAX_OUTPUT_ENTROPY = 0.85


@dataclass
class Sharpness:
    """Mean normalised entropies of one forward pass (``None``: the model has no such part)."""

    attention: Optional[float] = None
    output: Optional[float] = None
    attention_calls: int = 0
    _rows: list[torch.Tensor] = field(default_factory=list, repr=False)


def _normalised_entropy(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per row ``H(p) / log(n_allowed)``, for rows that may see more than one key."""
    probs = probs.double()
    n = allowed.sum(-1)
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-300).log(), torch.zeros_like(probs))
    h = -plogp.sum(-1)
    keep = n > 1
    return (h[keep] / n[keep].double().log()).flatten()


def _sdpa_probs(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **_: Any):
    q, k = q.detach().float(), k.detach().float()
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    lq, lk = q.shape[-2], k.shape[-2]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    allowed = allowed.expand_as(scores)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask.expand_as(scores)
        else:
            scores = scores + attn_mask.detach().float()
            allowed = allowed & torch.isfinite(attn_mask.expand_as(scores)) & (attn_mask.expand_as(scores) > -1e4)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs, allowed


@contextlib.contextmanager
def recording() -> Iterator[Sharpness]:
    """Within the block, every attention call adds its rows' normalised entropies to the result."""
    result = Sharpness()
    real_sdpa, real_softmax = F.scaled_dot_product_attention, F.softmax

    def sdpa(q, k, v, *args: Any, **kwargs: Any):
        names = ("attn_mask", "dropout_p", "is_causal", "scale")
        opts = dict(zip(names, args), **kwargs)
        opts.pop("dropout_p", None)
        probs, allowed = _sdpa_probs(q, k, **opts)
        result._rows.append(_normalised_entropy(probs, allowed))
        result.attention_calls += 1
        return real_sdpa(q, k, v, *args, **kwargs)

    def softmax(input, dim=None, *args: Any, **kwargs: Any):
        out = real_softmax(input, dim, *args, **kwargs)
        if input.dim() == 4 and dim in (-1, 3):  # (batch, heads, queries, keys): attention by hand
            result._rows.append(_normalised_entropy(out.detach(), torch.isfinite(input.detach())))
            result.attention_calls += 1
        return out

    F.scaled_dot_product_attention, F.softmax = sdpa, softmax
    try:
        yield result
    finally:
        F.scaled_dot_product_attention, F.softmax = real_sdpa, real_softmax
        if result._rows:
            result.attention = torch.cat(result._rows).mean().item()


def output_entropy(logits: torch.Tensor) -> float:
    """Mean ``H(softmax(logits)) / log(V)`` over the positions."""
    logits = logits.detach().double().flatten(0, -2)
    return (-(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1) / math.log(logits.shape[-1])).mean().item()


def measure(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Optional[torch.Tensor]]) -> Sharpness:
    """Run ``forward(model)`` (returning logits, or ``None`` for a model without a vocabulary) once."""
    torch.manual_seed(0)
    with torch.no_grad(), recording() as result:
        logits = forward(model)
    if logits is not None:
        result.output = output_entropy(logits)
    return result


SHARP_STD = 0.3  # the init std of every parity model (initializer_range in transformers' terms)


def sharp_gpt(init_std: float = SHARP_STD, **kwargs: Any):
    """The GPT recipe (:class:`lightning_para.recipes.GPT`) with ``init_std``: the recipe's GPT-2
    init (0.02) is right for training but too blunt for parity."""
    from lightning_para.recipes.gpt import GPT

    return GPT(init_std=init_std, **kwargs)


def reinit_normal(module: torch.nn.Module, std: float = SHARP_STD) -> None:
    """Every Linear/Embedding weight ~ N(0, std), biases zero; norms keep their init (ones)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)


def _perturbed_runs(factory, dataset, global_batch, steps, overrides, relative):
    import lightning as L

    from tests.parity import fit_reference

    class Perturb(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.mul_(1 + relative * torch.randn(p.shape, generator=g))

    return (fit_reference(factory, dataset, global_batch, steps, overrides),
            fit_reference(factory, dataset, global_batch, steps, overrides, callbacks=(Perturb(),)))


def perturbation_growth(
    factory: Callable[[], torch.nn.Module], dataset: Callable[[], Any], global_batch: int, steps: int,
    overrides: Optional[dict] = None, relative: float = 1e-7,
) -> list[float]:
    """Per-step relative loss difference, on one device, between a run and the same run whose initial
    weights were multiplied by ``1 + relative * N(0, 1)``.

    ``relative=1e-7`` is the size of a reordered fp32 sum: what a parallel layout changes every step.
    If this grows past the parity tolerance within the compared steps, the training is too chaotic
    for a 1e-5 check (lower the learning rate), whatever the layout does.
    """
    a, b = _perturbed_runs(factory, dataset, global_batch, steps, overrides, relative)
    return [abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])]


def perturbation_param_drift(
    factory: Callable[[], torch.nn.Module], dataset: Callable[[], Any], global_batch: int, steps: int,
    overrides: Optional[dict] = None, relative: float = 1e-7,
) -> dict[str, float]:
    """Like :func:`perturbation_growth`, for the trained parameters: per parameter, the largest absolute
    difference beyond ``1e-5 * |p|`` (what ``assert_params_close`` adds to its ``atol``)."""
    a, b = _perturbed_runs(factory, dataset, global_batch, steps, overrides, relative)
    return {n: ((a["params"][n] - b["params"][n]).abs() - 1e-5 * a["params"][n].abs()).max().item() for n in a["params"]}
