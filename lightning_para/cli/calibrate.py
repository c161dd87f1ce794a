"""``lightning-para calibrate [THREADS]``: measure this machine for the planner's CPU step time, once, and cache it.

It runs :func:`lightning_para.calibrate.cache.calibrate` (matmul FLOP/s, one eager operator's fixed cost, the
non-matmul operators' bandwidth, gloo's alpha-beta; the per-rank figures with the machine's cores all busy), with
the matmul efficiency taken on two plain blocks of the GPT recipe (:func:`gpt_compute_workload`) and with DTensor's per-operator cost timed on the GPT recipe's own tensor- and
sequence-parallel block (:func:`gpt_tensor_parallel_workload`): the planner multiplies that cost by the
recipe's DTensor operator counts (``plan/overhead.py``), so both come from the same block. A synthetic
block of cheap DTensor operators measured a third of it (``docs/planner.md``). It also times the training
loop's fixed cost per step (:func:`measure_step_overhead`): Lightning's loop, hooks, logger and progress bar,
ParaStrategy's step and the ParaProfiler callback, around a model of one weight.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_para.config import ParallelConfig
from lightning_para.observe.profiler import ParaProfiler
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step
from lightning_para.parallelize import parallelize
from lightning_para.calibrate.cache import cache_path, calibrate
from lightning_para.calibrate.processes import run_measurement
from lightning_para.recipes import GPT
from lightning_para.strategy import ParaStrategy


def gpt_tensor_parallel_workload() -> tuple[Callable[[], None], Callable[[], None]]:
    """``(forward and backward, optimizer step)`` of a 2-layer ``GPT(preset="tiny")`` at tp=2 with sequence parallelism (built
    once the 2-rank process group exists): forward, vocab-parallel loss, backward, AdamW. A small batch
    (2 x 16 tokens), so the operators' fixed costs dominate, not their arithmetic."""
    config = ParallelConfig(tp=2, sequence_parallel=True)
    dims = config.resolve_dims(2)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = GPT(preset="tiny", sample_tokens=0)
    model.blocks = nn.ModuleList(list(model.blocks)[:2])
    parallelize(model, dims, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))

    def forward_backward() -> None:
        with loss_parallel_step(True):
            loss = model.loss_fn(model(tokens), tokens)
        with loss_parallel_backward(True):
            loss.backward()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return forward_backward, optimizer_step


def gpt_compute_workload(batch: int, seq_len: int) -> Callable[[], None]:
    """Forward and backward of two plain blocks of ``GPT(preset="tiny")`` on ``batch x seq_len`` tokens: the
    reference whose matmuls set the calibration's matmul efficiency (``calibrate.measure.measure_matmul_efficiency``)."""
    torch.manual_seed(0)
    model = GPT(preset="tiny", sample_tokens=0)
    blocks = list(model.blocks)[:2]
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len))

    def step() -> None:
        hidden = model.embed(tokens)
        for block in blocks:
            hidden = block(hidden)
        hidden.sum().backward()
        model.zero_grad(set_to_none=True)

    return step


class _OneWeight(L.LightningModule):
    """A model whose operators cost next to nothing: what is left of a step is the framework's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Linear(1, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.weight(batch).sum()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(256, 1), batch_size=1)


class _StepClock(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


# Set by an enclosing launcher (torchrun, Lightning's DDP launcher, SLURM): the measurement is a run of
# one process, which must not join, or wait for, the enclosing job's ranks.
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")


def _step_overhead_worker(threads: int, steps: int, out: Any) -> None:
    for name in list(os.environ):
        if name in _LAUNCHER_VARIABLES or name.startswith(("SLURM_", "PMI_", "OMPI_")):
            del os.environ[name]
    torch.set_num_threads(threads)
    clock = _StepClock()
    with tempfile.TemporaryDirectory() as logs:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=ParaStrategy(), max_steps=steps, log_every_n_steps=5,
            logger=TensorBoardLogger(logs), enable_checkpointing=False, enable_model_summary=False,
            callbacks=[ParaProfiler(check_predictions=False), clock], default_root_dir=logs,
        )
        trainer.fit(_OneWeight())
    out.put(statistics.median(clock.seconds[1:]))


def measure_step_overhead(threads: int, steps: int = 60, timeout: float = 300.0) -> float:
    """Median seconds of a training step of a one-weight model under ``lightning-para fit``'s machinery
    (ParaStrategy, the ParaProfiler callback, a TensorBoard logger, the progress bar), in a process of its own."""
    return float(run_measurement(_step_overhead_worker, [(threads, steps)], timeout, "the step overhead"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-para calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("threads", nargs="?", type=int, default=None,
                        help="intra-op threads per rank to calibrate for (default: this process's); the README "
                             "demo's ranks run 1 each")
    parser.add_argument("--no-comm", action="store_true", help="skip gloo's all-reduce sweep (nominal figures)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        print(f"lightning-para calibrate: threads={args.threads} must be >= 1", file=sys.stderr)
        return 2
    result = calibrate(args.threads, refresh=True, measure_comm=not args.no_comm,
                       dtensor_workload=gpt_tensor_parallel_workload, step_overhead=measure_step_overhead,
                       compute_workload=gpt_compute_workload)
    print(json.dumps(asdict(result), indent=2))
    print(f"cached in {cache_path()}")
    return 0


__all__ = ["gpt_compute_workload", "gpt_tensor_parallel_workload", "main", "measure_step_overhead"]
