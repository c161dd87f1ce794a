"""``memory_breakdown()``: bytes this rank holds, against the ZeRO paper's formulas.

The result is a typed :class:`MemoryBreakdown` (``ParaStrategy.memory_breakdown()`` returns it; the
data-parallel implementation builds it, since the formulas are data parallelism's).

The formulas are the ZeRO paper's (:mod:`lightning_para.spec.zero`, the one written form): with psi parameters on a
rank before data parallelism (after TP/PP/EP split them), ``p`` and ``g`` bytes per parameter and gradient element,
``K`` optimizer bytes per parameter (fp32 master included) and ``N`` ranks that *shard* the state (``dp_shard x cp``;
experts ``edp x cp``). Under ZeRO-3, FSDP2 keeps the sharded weights in fp32 (they *are* the master copy), so
p = g = 4, K = 8: still 16/N.

Measured bytes count each storage once: a ZeRO-1/2 fp32 master is a view of its parameter's
rows and is not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_para.memory import measure_states
from lightning_para.spec.memory import MeasuredMemory, PredictedMemory
from lightning_para.spec.zero import zero_state_bytes

# Optimizer state tensors per parameter element, by optimizer class (for the expected bytes).
_STATES_PER_ELEMENT = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Adagrad": 1, "RMSprop": 1,
}


def optimizer_states_per_element(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """How many state tensors of a parameter's size ``optimizer`` keeps; ``None`` if unknown."""
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name in ("Adam", "AdamW") and group.get("amsgrad", False):
        return 3
    if name == "RMSprop":
        return 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered", False)))
    return _STATES_PER_ELEMENT.get(name)


@dataclass(frozen=True)
class BytesPerParam:
    """The formulas' bytes per parameter element: ``p`` (weight), ``g`` (gradient), ``K`` (optimizer, master included)."""

    param: int
    grad: int
    optimizer: int


@dataclass(frozen=True)
class MemoryBreakdown:
    """This rank's bytes, measured and as the ZeRO formulas expect them (see the module docstring).

    ``measured`` is what this rank holds (``params``/``grads``/``optimizer``/``total`` read it); ``expert`` and
    ``dense`` split it (MoE experts shard over ``edp``); ``expected*`` are the formulas' bytes for the same split.
    ``dp``/``edp`` are the formulas' ``N`` (ranks that shard dense / expert state: ``dp_shard x cp``,
    ``edp x cp``); ``dp_replicate`` and ``cp`` are reported alongside.
    """

    measured: MeasuredMemory
    expert: MeasuredMemory
    dense: MeasuredMemory
    expected: PredictedMemory
    expected_expert: PredictedMemory
    expected_dense: PredictedMemory
    zero: int
    dp: int
    edp: int
    dp_replicate: int
    cp: int
    num_params: int
    num_expert_params: int
    bytes_per_param: BytesPerParam
    formula: str

    @property
    def params(self) -> int:
        return int(self.measured.params)

    @property
    def grads(self) -> int:
        return int(self.measured.grads)

    @property
    def optimizer(self) -> int:
        return int(self.measured.optimizer)

    @property
    def total(self) -> int:
        return int(self.measured.model_states)

    def as_dict(self) -> dict[str, Any]:
        """The record as plain nested values (for text and TensorBoard output, JSON)."""
        return {
            **self.measured.states(),
            "expert": self.expert.states(), "dense": self.dense.states(), "expected": self.expected.states(),
            "expected_expert": self.expected_expert.states(), "expected_dense": self.expected_dense.states(),
            "zero": self.zero, "dp": self.dp, "edp": self.edp, "dp_replicate": self.dp_replicate, "cp": self.cp,
            "num_params": self.num_params, "num_expert_params": self.num_expert_params,
            "bytes_per_param": {"param": self.bytes_per_param.param, "grad": self.bytes_per_param.grad,
                                "optimizer": self.bytes_per_param.optimizer},
            "formula": self.formula,
        }


def expected(
    *,
    stage: int,
    psi_dense: int,
    psi_expert: int,
    dp: int,
    edp: int,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
) -> PredictedMemory:
    """The ZeRO formula per category for this rank (:func:`~lightning_para.spec.zero.zero_state_bytes`)."""
    parts = [zero_state_bytes(psi, zero=stage, shards=n, weight_bytes=param_bytes, grad_bytes=grad_bytes,
                              optimizer_bytes=optimizer_bytes) for psi, n in ((psi_dense, dp), (psi_expert, edp))]
    return PredictedMemory(*(dense + expert for dense, expert in zip(*parts)))


def formula(stage: int, n: int) -> str:
    """The paper's bytes/param for bf16 + Adam at this stage, as text (e.g. ``'2+14/N = 5.50'``)."""
    values = {0: (16.0, "16"), 1: (4 + 12 / n, "4+12/N"), 2: (2 + 14 / n, "2+14/N"), 3: (16 / n, "16/N")}
    value, text = values[stage]
    return f"{text} = {value:.2f} B/param at N={n}"


def memory_breakdown(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    stage: int,
    dp: int,
    edp: int,
    psi_dense: int,
    psi_expert: int,
    param_bytes: int,
    master_bytes: int,
    is_expert: Callable[[Tensor], bool] = lambda t: False,
    dp_replicate: int = 1,
    cp: int = 1,
) -> MemoryBreakdown:
    """Measured and expected bytes for this rank (see :meth:`ParaStrategy.memory_breakdown`).

    ``dp``/``edp`` are the numbers of ranks that shard dense/expert state (the formulas' ``N``);
    ``dp_replicate`` and ``cp`` are reported alongside. ``is_expert`` tells MoE expert tensors
    (model parameters and the optimizer's masters of them)."""
    measured = measure_states(module, optimizers)
    states = None
    for o in optimizers:
        states = optimizer_states_per_element(o)
    if states is None:  # unknown optimizer: infer from what it holds
        psi = max(psi_dense + psi_expert, 1)
        shard_factor = dp if stage >= 1 else 1
        states = round((measured.optimizer * shard_factor / psi - master_bytes) / 4) if optimizers else 0
    optimizer_bytes = master_bytes + 4 * states
    exp = expected(
        stage=stage, psi_dense=psi_dense, psi_expert=psi_expert, dp=dp, edp=edp,
        param_bytes=param_bytes, grad_bytes=param_bytes, optimizer_bytes=optimizer_bytes,
    )
    # Expert vs dense split (MoE): experts are replicated over edp only, dense over dp.
    expert = measure_states(module, optimizers, only=is_expert) if psi_expert else MeasuredMemory(0, 0, 0)
    dense = MeasuredMemory(
        measured.params - expert.params, measured.grads - expert.grads, measured.optimizer - expert.optimizer
    )
    kwargs = dict(stage=stage, dp=dp, edp=edp, param_bytes=param_bytes, grad_bytes=param_bytes, optimizer_bytes=optimizer_bytes)
    return MemoryBreakdown(
        measured=measured, expert=expert, dense=dense, expected=exp,
        expected_expert=expected(psi_dense=0, psi_expert=psi_expert, **kwargs),
        expected_dense=expected(psi_dense=psi_dense, psi_expert=0, **kwargs),
        zero=stage, dp=dp, edp=edp, dp_replicate=dp_replicate, cp=cp,
        num_params=psi_dense + psi_expert, num_expert_params=psi_expert,
        bytes_per_param=BytesPerParam(param_bytes, param_bytes, optimizer_bytes),
        formula=formula(stage, dp),
    )


__all__ = ["BytesPerParam", "MemoryBreakdown", "expected", "formula", "memory_breakdown"]
