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


# float8 (tensorwise) parity: what the format can promise. A value cast to float8 lands on a grid 2**-3 (e4m3:
# activations, weights) or 2**-2 (e5m2: gradients) of itself apart. A parallel run computes the values before the
# cast in another fp32 order (tensor-parallel partial sums), a few ulps (~2**-21 relative) from one device's, so a
# value rounds the other way only when it lies within those ulps of a midpoint between two grid points: ~2**-21 /
# 2**-3 = 4e-6 of the ~1e5 values cast per step, a flip every step or two, each moving one value by one grid step
# (up to 1/8 of it). No fp32 tolerance (1e-5) survives that. torchao's one-device float8 run re-rounds *every*
# cast value by up to half a step relative to the fp32 run, so the distance float8 itself puts between its run and
# the fp32 run (same model, same data) is the yardstick:
# - parameters (all the gradients' effect, summed over the run): within FP8_PARAM_MARGIN of that distance. A flip
#   changes the gradients of one token's path, float8 every gradient. Measured (2026-11-29, SGD): tp2+SP without a
#   flip 1e-5; dp2 x tp2 with one flip at step 0 (an attention input at -232.000000 here, -232.000076 on one
#   device, on the midpoint of -224 and -240) 0.28; a planted per-rank amax (tests/distributed/test_fp8.py) 0.93.
# - losses: each step within FP8_LOSS_BOUND times float8's largest per-step effect on the loss: a flip re-rounds
#   one value by one step where float8 re-rounds all of them, but in a sharp model (init 0.3) one token's loss
#   can move as much as the mean's (measured: the dp2 x tp2 flip, 0.9 of it at step 1). Only a bound, not the
#   discriminating check: the parameters are.
# AdamW amplifies a flip (its first updates are ~lr * sign(g) per component: 0.35 of the parameter distance in
# the dp2 x tp2 case, and Fabric's tp2+SP losses drifted to 4e-3 three steps after a flip), so float8 parity
# runs train with SGD, as the fp32 parity runs do (tests/tp_models.make_optimizer), for 2 optimizer steps.
FP8_PARAM_MARGIN = 0.5
FP8_LOSS_BOUND = 2.0


def assert_float8_close(losses: list[float], params: dict[str, torch.Tensor], float8: dict[str, Any],
                        fp32: dict[str, Any]) -> None:
    """A float8 run's per-step ``losses`` and final ``params`` (under pp: one stage's) against torchao's one-device
    float8 run and the fp32 run (``{"losses": ..., "params": ...}`` each), measured by float8's own distance from
    fp32 (FP8_PARAM_MARGIN, FP8_LOSS_BOUND above)."""
    assert len(losses) == len(float8["losses"]) == len(fp32["losses"]), (len(losses), len(float8["losses"]))
    expected = torch.tensor(float8["losses"], dtype=torch.float64)

    def loss_gap(values: list[float]) -> float:
        return ((torch.tensor(values, dtype=torch.float64) - expected).abs() / expected.abs()).max().item()

    names = sorted(params)
    assert names and set(names) <= set(float8["params"]), sorted(set(names) - set(float8["params"]))

    def param_gap(values: dict[str, torch.Tensor]) -> float:
        return sum(float((values[n].double() - float8["params"][n].double()).pow(2).sum()) for n in names) ** 0.5

    for what, gap, scale, margin in (("loss", loss_gap(losses), loss_gap(fp32["losses"]), FP8_LOSS_BOUND),
                                     ("parameter", param_gap(params), param_gap(fp32["params"]), FP8_PARAM_MARGIN)):
        assert scale > 1e-4, f"float8 moves the {what}s by only {scale:.1e} from fp32: this check would prove nothing"
        assert gap <= margin * scale, (
            f"{what}s {gap:.3e} from torchao's float8 run, float8 itself {scale:.3e} from fp32: more than "
            f"{margin} times that\n{losses}\n{float8['losses']}"
        )


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
