"""Models and jobs for the Lightning-compatibility suite.

The models are written the way Lightning's own docs and integration tests write them
(our own code): a gated feed-forward block whose ``configure_model`` applies tensor
parallelism with ``parallelize_module`` on ``self.device_mesh["tensor_parallel"]`` and/or
FSDP2 with ``fully_shard`` on ``self.device_mesh["data_parallel"]``, a BatchNorm classifier,
and a manual-optimization module. No lightning-para imports: each runs unchanged under
Lightning's strategies and under ``ParaStrategy``.

``fit_job`` runs inside every worker of a pool with either strategy, so one test compares
``ModelParallelStrategy`` and ``ParaStrategy`` on the same ranks, data and seeds.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import TensorDataset

from tests.parity import LossRecorder, ShardedData, trainer_kwargs

DIM = 32


def vector_dataset(n: int = 256, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    y = torch.sin(x @ torch.randn(DIM, DIM, generator=g) / DIM**0.5)
    return TensorDataset(x, y)


class FeedForward(nn.Module):
    """w3(silu(w1 x) * w2 x): the block Lightning's ModelParallel examples split column/row-wise."""

    def __init__(self, dim: int = DIM, hidden: int = 64) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class FeedForwardModule(L.LightningModule):
    """Two feed-forward blocks. ``configure_model`` applies what the flags say, as a user would.

    Args:
        tp: ``parallelize_module`` with Colwise w1/w2 and Rowwise w3 on the tensor-parallel mesh.
        fsdp: ``fully_shard`` each block (and the module) on the data-parallel mesh.
        mesh_names: the mesh names the user code asks for (Lightning's, or lightning-para's).
    """

    def __init__(self, tp: bool = False, fsdp: bool = False, mesh_names: tuple[str, str] = ("data_parallel", "tensor_parallel"),
                 lr: float = 0.01, optimizer: str = "adamw") -> None:
        super().__init__()
        self.tp, self.fsdp, self.mesh_names = tp, fsdp, mesh_names
        self.lr, self.optimizer_name = lr, optimizer
        self.blocks = nn.ModuleList([FeedForward(), FeedForward()])

    def configure_model(self) -> None:
        if self.device_mesh is None or not (self.tp or self.fsdp):
            return
        dp_name, tp_name = self.mesh_names
        if self.tp:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for block in self.blocks:
                parallelize_module(block, self.device_mesh[tp_name], {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()})
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh[dp_name])
            fully_shard(self, mesh=self.device_mesh[dp_name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_strategy(kind: str, kwargs: dict[str, Any]):
    if kind == "mps":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(**kwargs)
    from lightning_para import ParaStrategy

    return ParaStrategy(**kwargs)


def fit_job(
    kind: str,
    strategy_kwargs: dict[str, Any],
    model_factory: Callable[[], L.LightningModule],
    steps: int = 5,
    global_batch: int = 16,
    trainer_overrides: Optional[dict[str, Any]] = None,
    callbacks: tuple[Callback, ...] = (),
    after_fit: Optional[Callable[[L.Trainer, L.LightningModule], Any]] = None,
    ckpt_path: Optional[str] = None,
    dataset: Callable[[], Any] = vector_dataset,
) -> dict[str, Any]:
    """Inside a worker: fit under ``ModelParallelStrategy`` (``kind="mps"``) or ``ParaStrategy``.

    Returns this rank's per-step losses (its dp shard's loss), its dp coordinate, and whatever
    ``after_fit(trainer, module)`` returns.
    """
    strategy = make_strategy(kind, strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = model_factory()
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, callbacks=[recorder, *callbacks],
        use_distributed_sampler=False, **trainer_kwargs(**{"max_steps": steps, **(trainer_overrides or {})}),
    )
    data = _DpData(dataset, global_batch)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    sampler = trainer.strategy.distributed_sampler_kwargs
    out = {"losses": recorder.losses, "dp_rank": sampler["rank"], "dp": sampler["num_replicas"], "rank": dist.get_rank()}
    if after_fit is not None:
        out["extra"] = after_fit(trainer, module)
    return out


class _DpData(ShardedData):
    """``ShardedData`` with the per-rank batch derived from the strategy's dp degree at setup."""

    def setup(self, stage: str) -> None:
        self.batch_size = self.global_batch // self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]

    def __init__(self, dataset_factory: Callable[[], Any], global_batch: int) -> None:
        super().__init__(dataset_factory, global_batch)
        self.global_batch = global_batch


def dp_mean_losses(results: list[dict[str, Any]]) -> list[float]:
    """The global-batch loss per step: the mean over dp coordinates (tp ranks of one coordinate agree)."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    steps = len(next(iter(by_dp.values())))
    return [sum(v[i] for v in by_dp.values()) / len(by_dp) for i in range(steps)]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((x - y).abs() / y.abs().clamp_min(1e-12)).max().item()


# ----------------------------------------------------------------------------- ModelParallelStrategy parity
MPS_STEPS = 5
MPS_GLOBAL_BATCH = 16
# Same module, same ranks, same data under both strategies: only the order of a few fp32 sums
# (ParaStrategy's ZeRO-1 reduce-scatter vs FSDP2's) can differ, ~1e-7 relative per step.
MPS_RTOL = 1e-6
_one_device: dict[str, list[float]] = {}


def compare_with_mps(pool, mps_kwargs: dict[str, Any], para_kwargs: dict[str, Any], model: Callable[[], L.LightningModule],
                     para_model: Optional[Callable[[], L.LightningModule]] = None) -> tuple[float, float]:
    """Fit ``model`` under ``ModelParallelStrategy(**mps_kwargs)`` and ``para_model or model`` under
    ``ParaStrategy(**para_kwargs)`` on the same ranks; every rank's per-step losses agree within
    ``MPS_RTOL``, and their dp mean matches one device on the global batch within ``FP32_RTOL``.
    Returns both largest relative differences."""
    from tests.parity import FP32_RTOL, fit_reference

    mps = pool.run(fit_job, "mps", mps_kwargs, model, MPS_STEPS, MPS_GLOBAL_BATCH)
    para = pool.run(fit_job, "para", para_kwargs, para_model or model, MPS_STEPS, MPS_GLOBAL_BATCH)
    worst = 0.0
    for m, p in zip(mps, para):
        assert (m["dp_rank"], m["dp"]) == (p["dp_rank"], p["dp"]), "the strategies split the data differently"
        worst = max(worst, max_rel_diff(p["losses"], m["losses"]))
    assert worst <= MPS_RTOL, [(m["losses"], p["losses"]) for m, p in zip(mps, para)]
    if "losses" not in _one_device:
        _one_device["losses"] = fit_reference(FeedForwardModule, vector_dataset, MPS_GLOBAL_BATCH, MPS_STEPS)["losses"]
    to_one_device = max_rel_diff(dp_mean_losses(para), _one_device["losses"])
    assert to_one_device <= FP32_RTOL
    print(f"vs ModelParallelStrategy: {worst:.2e}; vs one device: {to_one_device:.2e}")
    return worst, to_one_device
