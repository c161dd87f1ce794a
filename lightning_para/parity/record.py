"""Recording a run for the parity check: per-step loss, global gradient norm and each parameter's gradient norm.

:class:`ParityRecorder` is a Lightning callback. At every optimizer step, after gradients are
final (ParaPrecision has flushed ZeRO's buckets; ``on_before_optimizer_step``), each rank adds
up, per parameter *name*, ``|g|^2 / r`` over the gradient pieces it holds, with ``r`` the number
of ranks holding the same piece (``ParallelModel.grad_replication``, the count the strategy's
gradient clipping uses). One ``all_gather_object`` then gives every rank each parameter's
gradient norm as one device would compute it, whatever the layout: ZeRO shards, TP/EP
DTensors, FSDP2 shards and pipeline stages all map back to the model's own parameter names
(the strategy keeps them). The step's loss is the mean over ranks of each rank's loss (dp ranks
hold different data; tp/pp ranks repeat theirs), the global batch's loss.

:func:`lightning_para.cli.parity.record_run` runs a LightningCLI config with such a recorder (in
this process, on every rank of the current process group) and returns a :class:`RunRecord`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_para._dtensor import local_tensor
from lightning_para.observe.publish import gather_objects, world_size


@dataclass
class RunRecord:
    """What one run did, step by step (identical on every rank)."""

    label: str
    world_size: int
    precision: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    param_grad_norms: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "world_size": self.world_size, "precision": self.precision,
                "losses": self.losses, "grad_norms": self.grad_norms, "param_grad_norms": self.param_grad_norms}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunRecord":
        return cls(data["label"], int(data["world_size"]), data["precision"], list(data["losses"]),
                   list(data["grad_norms"]), [dict(d) for d in data["param_grad_norms"]])


class ParityRecorder(Callback):
    """Per-step loss, global gradient norm and per-parameter gradient norms (see the module docstring)."""

    def __init__(self) -> None:
        self._losses: list[float] = []
        self.param_grad_norms: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._losses.append(float(loss.detach().float()))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        names, replication = _naming(trainer.strategy, pl_module)
        mine: dict[str, float] = {}
        for group in optimizer.param_groups:
            for q in group["params"]:
                if q.grad is None:
                    continue
                grad = local_tensor(q.grad).detach().float()
                name = names(q)
                mine[name] = mine.get(name, 0.0) + float(grad.pow(2).sum()) / replication(q)
        total: dict[str, float] = {}
        for part in gather_objects(mine):
            for name, value in part.items():
                total[name] = total.get(name, 0.0) + value
        self.param_grad_norms.append({name: math.sqrt(value) for name, value in sorted(total.items())})

    def losses(self) -> list[float]:
        """The global batch's loss per step: the mean over ranks (a world collective)."""
        per_rank = gather_objects(self._losses)
        return [sum(values) / len(values) for values in zip(*per_rank, strict=True)]


def _naming(strategy: Any, module: torch.nn.Module) -> tuple[Callable[[Tensor], str], Callable[[Tensor], int]]:
    """``(name of an optimizer tensor, on how many ranks its gradient is identical)`` for ``strategy``."""
    by_id = {id(p): n for n, p in module.named_parameters()}
    try:
        parallel = strategy.parallel_model  # ParaStrategy's record of the layout
    except (AttributeError, RuntimeError):
        parallel = None  # another strategy: whole gradients on one device
    data_parallel = parallel.data_parallel if parallel is not None else None

    def name(q: Tensor) -> str:
        master_of = data_parallel.parameter_name(q) if data_parallel is not None else None
        return master_of if master_of is not None else by_id.get(id(q), f"<unnamed {tuple(q.shape)}>")

    if parallel is None:
        return name, lambda q: 1
    return name, parallel.grad_replication


__all__ = ["ParityRecorder", "RunRecord", "world_size"]
