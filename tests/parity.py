"""Run the same training in a pool of workers and in one process, and compare.

``fit_job`` runs inside every worker of a :class:`tests.harness.WorkerPool`;
``fit_reference`` runs in the pytest process on one device with the *global* batch.
Both return per-step losses and the final full parameters, so a test only compares.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

# fp32 parity tolerance: reductions run in a different order (per-rank partial sums, then a
# collective) than on one device; that reorders fp32 additions, ~1e-7 relative per op, and
# AdamW over 20 steps keeps the drift well below this.
FP32_RTOL = 1e-5


class LossRecorder(Callback):
    """Collects the loss of every training micro-step (Lightning reports it un-normalised)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor (collective when parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = t.float().cpu().clone()
    return out


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


class ShardedData(L.LightningDataModule):
    """The dataset split over the strategy's data-parallel ranks, in order (no shuffling).

    Lightning's automatic sampler shuffles training data; parity with one device needs the
    same samples per global batch, so the sampler is built here from
    ``strategy.distributed_sampler_kwargs`` (the dp sub-mesh).
    """

    def __init__(self, dataset_factory: Callable[[], Any], batch_size: int) -> None:
        super().__init__()
        self.dataset_factory = dataset_factory
        self.batch_size = batch_size

    def _loader(self):
        from torch.utils.data import DataLoader, DistributedSampler

        dataset = self.dataset_factory()
        sampler = DistributedSampler(dataset, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def fit_job(
    model_factory: Callable[[], L.LightningModule],
    strategy_kwargs: dict[str, Any],
    dataset_factory: Callable[[], Any],
    global_batch: int,
    max_steps: int = 20,
    trainer_overrides: Optional[dict[str, Any]] = None,
    collect: tuple[str, ...] = ("losses", "params"),
    ckpt_dir: Optional[str] = None,
    resume: Optional[str] = None,
    model_seed: int = 0,
) -> dict[str, Any]:
    """Inside a worker: train under ParaStrategy and report what the test compares.

    ``ckpt_dir`` saves a checkpoint at every epoch end (``collect`` ``"saved"`` lists them);
    ``resume`` continues from one. A ``model_seed`` other than the reference's 0 shows that
    resumed weights come from the checkpoint, not from the initialisation.
    ``collect`` may also name ``"memory"``, ``"scale"`` (the loss scale) and ``"step"``.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_para import ParaStrategy

    world = dist.get_world_size()
    strategy = ParaStrategy(**strategy_kwargs)
    L.seed_everything(model_seed, verbose=False)
    module = model_factory()
    recorder = LossRecorder()
    callbacks: list[Callback] = [recorder]
    overrides = dict(trainer_overrides or {})
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1))
        overrides["enable_checkpointing"] = True
    trainer = L.Trainer(
        devices=world,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        use_distributed_sampler=False,
        **trainer_kwargs(**overrides),
    )
    dp = strategy.config.resolve_dp(world)
    trainer.fit(module, datamodule=ShardedData(dataset_factory, global_batch // dp), ckpt_path=resume)
    result: dict[str, Any] = {"losses": recorder.losses, "rank": dist.get_rank()}
    if "params" in collect:
        params = full_parameters(module)
        result["params"] = params if dist.get_rank() == 0 else None
    if "memory" in collect:
        result["memory"] = strategy.memory_breakdown()
    if "saved" in collect:
        result["saved"] = sorted(str(p) for p in Path(ckpt_dir).iterdir()) if ckpt_dir else []
    if "scale" in collect:
        result["scale"] = strategy.precision_plugin.scale
    if "step" in collect:
        result["step"] = trainer.global_step
    return result


def fit_reference(
    model_factory: Callable[[], L.LightningModule],
    dataset_factory: Callable[[], Any],
    global_batch: int,
    max_steps: int = 20,
    trainer_overrides: Optional[dict[str, Any]] = None,
    callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any]:
    """In the pytest process: the same training on one device with the global batch."""
    assert "LOCAL_RANK" not in os.environ, "the reference must not run inside a worker"
    L.seed_everything(0, verbose=False)
    module = model_factory()
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=1, max_steps=max_steps, callbacks=[recorder, *callbacks], **trainer_kwargs(**(trainer_overrides or {}))
    )
    from torch.utils.data import DataLoader

    trainer.fit(module, train_dataloaders=DataLoader(dataset_factory(), batch_size=global_batch, shuffle=False))
    return {"losses": recorder.losses, "params": full_parameters(module)}


def mean_over_dp(per_rank_losses: list[list[float]], dp_ranks: list[list[int]]) -> list[float]:
    """Average the per-rank losses of one replica group (ranks that hold different data)."""
    ranks = dp_ranks[0]
    steps = len(per_rank_losses[ranks[0]])
    return [sum(per_rank_losses[r][i] for r in ranks) / len(ranks) for i in range(steps)]


def assert_losses_close(actual: list[float], expected: list[float], rtol: float = FP32_RTOL) -> None:
    assert len(actual) == len(expected), f"{len(actual)} steps vs {len(expected)} in the reference"
    a, e = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    rel = ((a - e).abs() / e.abs().clamp_min(1e-12)).max().item()
    assert rel <= rtol, f"per-step loss differs by {rel:.3e} relative (tolerance {rtol:.0e})\n{actual}\n{expected}"


def assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = FP32_RTOL, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def held_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from the storages
    independently of the library's ``memory_breakdown()``: each storage once, padding included (FSDP2
    gradients are views into one buffer), separate fp32 masters under the optimizer."""
    seen: set[int] = set()

    def nbytes(t: Any) -> int:
        if t is None:
            return 0
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        if t.numel() == 0 or t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.untyped_storage().nbytes()

    opt_params = [q for g in optimizer.param_groups for q in g["params"]]
    params = sum(nbytes(p.data) for p in module.parameters())
    grads = sum(nbytes(p.grad) for p in module.parameters()) + sum(nbytes(q.grad) for q in opt_params)
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    state += sum(nbytes(q.data) for q in opt_params)  # separate masters only (views were counted)
    return {"params": params, "grads": grads, "optimizer": state}
