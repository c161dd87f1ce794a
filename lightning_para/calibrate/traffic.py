"""Count the non-matmul bytes of the GPT recipe and fit the planner's traffic coefficients.

The planner prices the non-matmul operators of a microbatch (norms, RoPE, SwiGLU's products, residual
adds, casts, the loss's softmax) and of AdamW by the bytes they read and write, divided by
``Cluster.elementwise_bandwidth`` (:mod:`lightning_para.plan.overhead`). Those bytes scale with the
activation bytes the planner already computes (``plan.memory``) and with the parameter bytes, by
coefficients that depend on the precision (autocast adds casts; fp32 doubles every tensor) and on the
device's kernels (CUDA's fused attention and foreach AdamW against CPU's). :func:`count_traffic_coefficients`
counts them on the device the model is on, as ``plan/overhead.py``'s tables were counted:
``tests/unit/test_plan_overhead.py`` on CPU (``32-true``) and ``benchmarks/gpu_step_model.py`` on an H100
(``bf16-mixed``, ``bf16-true``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Sequence

import torch

from lightning_para.instrument.operators import TrafficCounter
from lightning_para.plan.cluster import Training
from lightning_para.describe import describe_module
from lightning_para.plan.layout import Layout
from lightning_para.plan.overhead import TrafficCoefficients
from lightning_para.plan.rank import layer_traffic_basis
from lightning_para.plan.rank_memory import head_bytes

__all__ = ["count_traffic_coefficients"]


def _bytes(run: Callable[[], None], drop: Sequence[torch.Tensor]) -> float:
    """Bytes of the second call of ``run`` (the first warms up), with the gradients of ``drop`` removed before
    it: a step's first microbatch starts with none (``zero_grad(set_to_none=True)``); a leaf left out of
    ``drop`` keeps the gradient of the first call, and the second call accumulates into it, as every later
    microbatch of a step does."""
    run()
    for leaf in drop:
        leaf.grad = None
    with TrafficCounter() as counter:
        run()
    return float(counter.bytes)


def _slope_and_rest(points: Sequence[tuple[float, float]], param_bytes: float) -> tuple[float, float]:
    """``traffic = a x activation bytes + c x param bytes`` through two points ``(traffic, activation bytes)``."""
    (t0, a0), (t1, a1) = points[0], points[1]
    a = (t0 - t1) / (a0 - a1)
    return a, (t0 - a * a0) / param_bytes


def count_traffic_coefficients(model: Any, precision: str = "32-true",
                               shapes: Sequence[tuple[int, int]] = ((8, 64), (4, 32)),
                               optimizer_params: Callable[[Any], Any] = lambda m: m.parameters()) -> TrafficCoefficients:
    """Counts the bytes of ``model``'s first block and of its head and loss, forward and backward, at two
    ``(batch, seq)`` shapes, and of one AdamW step, on the device ``model`` is on, under ``precision``
    (``"32-true"``, ``"bf16-mixed"``: autocast to bf16 on fp32 weights, ``"bf16-true"``: bf16 weights), and
    fits them the way :func:`lightning_para.plan.rank.microbatch_traffic_bytes` prices them.

    ``model`` is a :class:`~lightning_para.recipes.GPT` (``blocks``, ``head``, ``loss_fn``); it is not changed.
    ``optimizer_params(model)``: the parameters AdamW's bytes per element are counted on (fp32 copies; a
    subset saves memory on a wide model).
    """
    if precision not in ("32-true", "bf16-mixed", "bf16-true"):
        raise ValueError(f"`precision={precision!r}`: count '32-true', 'bf16-mixed' or 'bf16-true'.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parameter-count note is no concern here
        desc = describe_module(model)
    device = next(model.parameters()).device
    if precision == "bf16-true":
        model = copy.deepcopy(model).to(torch.bfloat16)
    dtype = next(model.parameters()).dtype

    def autocast() -> Any:
        if precision == "bf16-mixed":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    block, width, vocab = model.blocks[0], model.config.n_embd, model.config.vocab_size
    layer, head, accumulated = [], [], []
    for batch, seq in shapes:
        training = Training(seq_len=seq, global_batch=batch, micro_batch=batch, precision=precision)
        hidden = torch.randn(batch, seq, width, device=device, dtype=dtype, requires_grad=True)

        def block_step() -> None:
            with autocast():
                out = block(hidden)
            out.sum().backward()

        tokens = torch.randint(0, vocab, (batch, seq), device=device)

        def head_step() -> None:
            with autocast():
                loss = model.loss_fn(model.head(hidden), tokens)
            loss.backward()

        leaves = [hidden, *model.parameters()]
        layer.append((_bytes(block_step, leaves), layer_traffic_basis(desc, training, Layout(), 0)))
        head.append((_bytes(head_step, leaves), head_bytes(desc, training, Layout())))
        if not accumulated:  # a later microbatch: autograd adds each weight gradient into the one held
            block_grads = sum(p.numel() * p.element_size() for p in block.parameters())
            accumulated.append((_bytes(block_step, [hidden]) - layer[-1][0]) / block_grads)
        for leaf in leaves:
            leaf.grad = None
    weight_bytes = Training(seq_len=1, global_batch=1, precision=precision).bytes.weight
    layer_a, layer_c = _slope_and_rest(layer, weight_bytes * sum(p.numel() for p in block.parameters()))
    head_a, head_c = _slope_and_rest(head, weight_bytes * sum(p.numel() for p in model.head.parameters()))
    # AdamW steps fp32 parameters (bf16-true: ParaStrategy's fp32 masters), with torch's default
    # implementation for the device (foreach on CUDA, a loop per tensor on CPU).
    params = [torch.zeros_like(p, dtype=torch.float32, requires_grad=True) for p in optimizer_params(model)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer_bytes = _bytes(optimizer.step, ()) / sum(p.numel() for p in params)
    return TrafficCoefficients(layer_a, layer_c, head_a, head_c, optimizer_bytes, accumulated[0])
