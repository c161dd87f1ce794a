"""``ParaProfiler``: what a parallel run is doing, in TensorBoard.

A Lightning ``Callback`` (the ``lightning-para`` CLI adds it by default) that logs, through the trainer's
loggers (TensorBoard by default, under ``lightning_logs/``), ``perf/...`` (lr, global tokens/s, step time and MFU: ``flops_per_token * tokens/s / (peak FLOP/s * world
size)`` with ``flops_per_token = 6 N (+ attention)``, Kaplan et al. 2020; PaLM App. B; a model may define
``flops_per_token(seq_len)``), ``memory/rank{r}/...`` against the ZeRO formula, ``comm/{dim}/{kind}_MB`` and
``_ms`` per mesh dimension, ``pipeline/...`` idle fractions and a timeline image (``pp > 1``), ``plan/...``
(the planner's prediction against what was measured, ``check_predictions``), optional ``torch.profiler``
traces of a window of steps, and at the end of ``fit`` ``<log_dir>/para_summary.json`` with a one-line
summary. ``docs/profiling.md`` lists every tag.

Sampled work (comm tracing, memory, timeline) runs only on its steps, and every collective
it needs is issued by all ranks at the same step; with everything off the per-step cost is
two clock reads.

The callback owns when to sample; what it measures lives in :mod:`lightning_para.instrument`, :mod:`.prediction`
and :mod:`.timeline`, the panels it draws in :mod:`.panels`, and how they are gathered and written in :mod:`.publish`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_para.moe import MoE, MoEStats, biased_routers, moe_layers
from lightning_para.instrument.collectives import CollectiveCounter, group_labels
from lightning_para.observe.panels import comm_metrics, memory_panel, moe_metrics, prediction_metrics
from lightning_para.observe.traces import start_trace
from lightning_para.observe.publish import gather_objects, log_image, log_scalars, log_text, world_size
from lightning_para.observe.prediction import check_run, describe_for_prediction, measure_rank
from lightning_para.observe.timeline import draw_timeline, pipeline_metrics, rank_pipeline_record
from lightning_para.parallel.data import MemoryBreakdown
from lightning_para.parallel.pipeline import PipelineStats
from lightning_para.instrument.compare import IDLE_KINDS, PredictionCheck
from lightning_para.plan.model import ModelDesc
from lightning_para.calibrate.machine import detect_peak_flops


def _parallel_dims(strategy: Any) -> Any:
    """The ``ParallelDims`` of a set-up ParaStrategy (``None`` under any other strategy)."""
    try:
        return strategy.parallel_dims
    except (AttributeError, RuntimeError):
        return None


def _pipeline_runner(strategy: Any) -> Any:
    """The pipeline runner of a set-up ParaStrategy with ``pp > 1`` (``None`` otherwise)."""
    try:
        return strategy.parallel_model.pipeline
    except (AttributeError, RuntimeError):
        return None


def _first_tensor(batch: Any) -> Optional[Tensor]:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


class ParaProfiler(Callback):
    """Throughput, MFU, memory, communication and pipeline profiling for TensorBoard.

    Args:
        log_every_n_steps: how often to log throughput and LR (default: the trainer's).
        peak_flops: peak FLOP/s of one device for MFU; default: detected for known GPUs.
        memory_every_n_steps: log ``memory_breakdown()`` after step 1 and then every n steps (0: off).
        comm_every_n_steps: trace collectives on one step in every n (0: off).
        time_collectives: also time each traced collective (waits for it; see ``instrument.collectives``).
        timeline_every_n_steps: log pipeline idle fractions and the timeline image (0: off).
        trace_start_step, trace_steps: ``torch.profiler`` trace of batches
            ``[start, start + steps)``; ``None`` (default) records no trace.
        val_loss_key: the validation loss metric used in the end-of-fit summary.
        check_predictions: at the end of training, compare the planner's prediction for this run
            with what was measured (memory per component, comm bytes per dimension of the last
            traced step, pipeline idle fraction, step time); logged under ``plan/``, kept in
            :attr:`prediction_check` and in ``para_summary.json``.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        peak_flops: Optional[float] = None,
        memory_every_n_steps: int = 100,
        comm_every_n_steps: int = 25,
        time_collectives: bool = True,
        timeline_every_n_steps: int = 25,
        trace_start_step: Optional[int] = None,
        trace_steps: int = 3,
        val_loss_key: str = "val_loss",
        check_predictions: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("memory_every_n_steps", memory_every_n_steps), ("comm_every_n_steps", comm_every_n_steps),
                            ("timeline_every_n_steps", timeline_every_n_steps), ("trace_steps", trace_steps)):
            if value < 0:
                raise ValueError(f"`{name}={value}` must be >= 0 (0 switches it off).")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = peak_flops
        self.memory_every_n_steps = memory_every_n_steps
        self.comm_every_n_steps = comm_every_n_steps
        self.time_collectives = time_collectives
        self.timeline_every_n_steps = timeline_every_n_steps
        self.trace_start_step = trace_start_step
        self.trace_steps = trace_steps
        self.val_loss_key = val_loss_key
        self.check_predictions = check_predictions
        self._reset()

    def _reset(self) -> None:
        self.log_dir: Optional[Path] = None
        # This rank's memory_breakdown() at the last sampled training step end (memory_every_n_steps):
        # what training holds between steps, which the prediction check compares with. At the end of
        # training it may be gone: Lightning frees gradients before every validation loop
        # (`on_validation_model_zero_grad`), and a run usually ends with one.
        self._memory_between_steps: Optional[MemoryBreakdown] = None
        self.train_losses: list[Tensor] = []
        self.val_losses: list[tuple[int, float]] = []
        self._batches = 0
        self._window: list[tuple[float, int]] = []  # (seconds, global tokens) of untraced batches
        self._all_steps: list[tuple[float, int]] = []
        self._untraced_seconds: list[float] = []  # steps without the collective tracer (what the planner prices)
        self._tracer: Optional[CollectiveCounter] = None
        self._labels: dict[str, str] = {}
        self._torch_profiler: Optional[Any] = None
        self._start = 0.0
        self._traced = False
        self._last_memory_step = -1
        self._num_params = 0
        self._dp = 1
        self._has_moe = False
        self._timeline_pending = False
        self.last_summary: Optional[dict[str, Any]] = None
        self._model_desc: Optional[ModelDesc] = None
        self._no_prediction: Optional[str] = None  # why there is no prediction, when there is none
        self._last_comm: Optional[dict[str, dict[str, float]]] = None
        self._pipeline_steps: list[PipelineStats] = []  # pipeline_stats() of recent untraced steps
        self._batch_shape: tuple[int, ...] = ()
        self.prediction_check: Optional[PredictionCheck] = None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        # Counted before the strategy shards anything: the whole model, for the 6N fallback.
        self._num_params = sum(p.numel() for p in pl_module.parameters())
        # Decided before the pipeline split, so every rank agrees even if its stage has no MoE layer.
        self._has_moe = bool(list(moe_layers(pl_module)) or biased_routers(pl_module))
        if self.check_predictions:  # described while whole: the strategy splits and shards it next
            self._model_desc, self._no_prediction = describe_for_prediction(pl_module)
        # rank 0's directory on every rank (Lightning broadcasts it); no logger, no files
        log_dir = trainer.log_dir if trainer.loggers else None
        self.log_dir = Path(log_dir) if log_dir else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        dims = _parallel_dims(strategy)
        self._dp = dims.dp if dims is not None else trainer.world_size
        self._labels = group_labels(dims if getattr(dims, "mesh", None) is not None else None)
        if self.peak_flops is None:
            self.peak_flops = detect_peak_flops(strategy.root_device)

    # ------------------------------------------------------------------ per batch
    def _due(self, every: int) -> bool:
        return every > 0 and self._batches % every == every - 1  # never the first (warm-up) batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._traced = False
        if self.trace_start_step is not None and self._batches == self.trace_start_step:
            self._start_torch_profiler(trainer)
        if self._torch_profiler is not None:
            self._traced = True
        runner = _pipeline_runner(trainer.strategy)
        if runner is not None and (self._timeline_pending or self._due(self.timeline_every_n_steps)):
            runner.measure_timing = True  # per-action device events for this step's timeline (no host sync)
        if self._due(self.comm_every_n_steps) and world_size() > 1:
            self._tracer = CollectiveCounter(self._labels, self.time_collectives)
            self._tracer.__enter__()
            self._traced = True
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._start
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.__exit__(None, None, None)
        if self._torch_profiler is not None and self._batches >= self.trace_start_step + self.trace_steps - 1:
            self._stop_torch_profiler()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self.train_losses.append(loss.detach())
        tokens_tensor = _first_tensor(batch)
        tokens = (tokens_tensor.numel() if tokens_tensor is not None else 0) * self._dp
        if tokens_tensor is not None:
            self._batch_shape = tuple(tokens_tensor.shape)
        self._all_steps.append((seconds, tokens))
        if not self._traced:
            self._window.append((seconds, tokens))
            if len(self._all_steps) > 1:  # the first batch warms up
                self._untraced_seconds.append(seconds)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every > 0 and self._batches % every == 0:
            self._log_throughput(trainer, pl_module, tokens_tensor)
            if self._has_moe:
                self._log_moe(trainer, pl_module)
        if tracer is not None:
            self._last_comm = tracer.summary()
            self._log_comm(trainer, tracer, seconds)
        dims = _parallel_dims(trainer.strategy)
        # Not the first batch (shape inference runs inside it), not a traced one (the tracer waits).
        if self.check_predictions and not self._traced and self._batches > 0 and dims is not None and dims.pp > 1:
            self._pipeline_steps = [*self._pipeline_steps[-7:], trainer.strategy.pipeline_stats()]
        step = trainer.global_step
        if self.memory_every_n_steps and step != self._last_memory_step and (
            step == 1 or step % self.memory_every_n_steps == 0
        ):
            self._last_memory_step = step
            self._log_memory(trainer)
        self._timeline_pending |= self._due(self.timeline_every_n_steps)
        if self._timeline_pending and not self._traced:  # a traced step's timings are distorted
            self._timeline_pending = False
            self._log_pipeline(trainer)
            runner = _pipeline_runner(trainer.strategy)
            if runner is not None:
                runner.measure_timing = runner.device.type == "cpu"  # back to its default
        self._batches += 1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.val_loss_key)
        if value is not None and not trainer.sanity_checking:
            self.val_losses.append((trainer.global_step, float(value)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._torch_profiler is not None:
            self._stop_torch_profiler()
        if self.check_predictions and _parallel_dims(trainer.strategy) is not None and self._all_steps:
            self._check_predictions(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each rank's loss is its own batch's mean; the mean over all ranks is the global batch's
        # (tp/pp ranks repeat their dp slot's value, which leaves the mean unchanged).
        per_rank = gather_objects([float(x) for x in self.train_losses])
        summary = self.last_summary = self.summary([sum(v) / len(v) for v in zip(*per_rank)])
        if self.prediction_check is not None:
            summary["prediction"] = self.prediction_check.as_dict()
        if trainer.is_global_zero and self.log_dir is not None and summary["steps"]:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / "para_summary.json").write_text(json.dumps(summary, indent=1))
            first, last = summary["first_loss"], summary["final_val_loss"]
            text = f"lightning-para: loss at step 0 {first:.4f}"
            if last is not None:
                text += f" -> final validation loss {last:.4f} ({100 * (last - first) / first:+.1f}%)"
            if summary["tokens_per_s"]:
                text += f"; {summary['tokens_per_s']:.0f} tokens/s"
            print(text + f"; logs in {self.log_dir}", flush=True)

    # ------------------------------------------------------------------ summaries
    def summary(self, losses: Optional[list[float]] = None) -> dict[str, Any]:
        """Per-step training losses (default: this rank's), validation losses and throughput."""
        losses = [float(x) for x in self.train_losses] if losses is None else losses
        seconds = sum(s for s, _ in self._all_steps[1:]) or None  # the first batch warms up
        tokens = sum(t for _, t in self._all_steps[1:])
        return {
            "steps": len(losses),
            "train_losses": losses,
            "first_loss": losses[0] if losses else None,
            "val_losses": self.val_losses,
            "final_val_loss": self.val_losses[-1][1] if self.val_losses else None,
            "tokens_per_s": tokens / seconds if seconds else None,
            "log_dir": str(self.log_dir) if self.log_dir else None,
        }

    def _flops_per_token(self, pl_module: L.LightningModule, tokens: Optional[Tensor]) -> float:
        fn = getattr(pl_module, "flops_per_token", None)
        if callable(fn):
            return float(fn(tokens.shape[-1]) if tokens is not None and tokens.dim() > 1 else fn())
        return 6.0 * self._num_params

    def _log_throughput(self, trainer: L.Trainer, pl_module: L.LightningModule, tokens: Optional[Tensor]) -> None:
        window, self._window = self._window or self._all_steps[-1:], []
        seconds = sum(s for s, _ in window)
        metrics = {"perf/step_ms": 1e3 * seconds / len(window)}
        if trainer.optimizers:
            metrics["perf/lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        if seconds > 0:
            tokens_per_s = sum(t for _, t in window) / seconds
            metrics["perf/tokens_per_s"] = tokens_per_s
            if self.peak_flops:
                achieved = self._flops_per_token(pl_module, tokens) * tokens_per_s
                metrics["perf/mfu"] = achieved / (self.peak_flops * trainer.world_size)
        log_scalars(trainer, metrics)

    def _log_comm(self, trainer: L.Trainer, tracer: CollectiveCounter, step_seconds: float) -> None:
        per_rank = gather_objects(tracer.summary())
        if not trainer.is_global_zero:
            return
        log_scalars(trainer, comm_metrics(per_rank, step_seconds))

    def _log_memory(self, trainer: L.Trainer) -> None:
        breakdown_fn = getattr(trainer.strategy, "memory_breakdown", None)
        if breakdown_fn is None:
            return
        mine: MemoryBreakdown = breakdown_fn()
        self._memory_between_steps = mine
        device_max = None
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            device_max = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
        per_rank: list[tuple[MemoryBreakdown, Optional[int]]] = gather_objects((mine, device_max))
        if not trainer.is_global_zero:
            return
        metrics, text = memory_panel(per_rank)
        log_scalars(trainer, metrics)
        log_text(trainer, "memory/breakdown", text)

    def _check_predictions(self, trainer: L.Trainer) -> None:
        """Predicted against measured for this run (every rank measures; all ranks get the result)."""
        # The median untraced step: the collective tracer's steps time every collective (profiling cost the
        # planner does not price), and a median keeps one preempted step on a shared machine from moving it.
        warm = self._untraced_seconds or [seconds for seconds, _ in self._all_steps[1:]] or [self._all_steps[-1][0]]
        mine = measure_rank(
            trainer.strategy, trainer.global_rank, self._last_comm, statistics.median(warm), self._pipeline_steps,
            memory=self._memory_between_steps,
        )
        measured = gather_objects(mine)  # a world collective: every rank is here
        if self._model_desc is None:
            if trainer.is_global_zero:
                print(f"lightning-para: no planner prediction to compare: {self._no_prediction}", flush=True)
            return
        try:
            check = check_run(self._model_desc, trainer.strategy, trainer, self._batch_shape, measured, self.peak_flops)
        except ValueError as err:
            if trainer.is_global_zero:
                print(f"lightning-para: the planner cannot price this run: {err}", flush=True)
            return
        self.prediction_check = check
        metrics = prediction_metrics(check)
        log_scalars(trainer, metrics)
        if trainer.is_global_zero:
            log_text(trainer, "plan/predicted_vs_measured", "```\n" + check.table() + "\n```")
            # On CPU the step time is a band (its ranks share the host's cores; `CPU_STEP_BAND`), not one figure.
            band = check.step_band() if trainer.strategy.root_device.type == "cpu" else None
            if band:  # and the tighter band this run's own first steps calibrate (`IN_RUN_STEP_BAND`)
                in_run = check.in_run_step_band(self._untraced_seconds)
                band = f"{band}; {in_run}" if in_run else band
            worst = ", ".join(f"{k} {v:.1%}" if k not in IDLE_KINDS else f"{k} {v:.3f}"
                              for k, v in check.worst().items() if not (band and k == "step"))
            failing = len(check.failures())
            print(f"lightning-para: planner vs measured for {check.label}: worst error {worst}"
                  f"{f'; {band}' if band else ''}{f'; {failing} outside tolerance' if failing else ''}", flush=True)

    def _log_pipeline(self, trainer: L.Trainer) -> None:
        strategy = trainer.strategy
        dims = _parallel_dims(strategy)
        if dims is None or dims.pp <= 1 or not hasattr(strategy, "pipeline_stats"):
            return
        mine = rank_pipeline_record(strategy.pipeline_stats(), dist.get_rank(), dims.local_rank("pp"))
        per_rank = gather_objects(mine)
        if not trainer.is_global_zero:
            return
        metrics, events = pipeline_metrics(per_rank)
        log_scalars(trainer, metrics)
        if events:
            title = f"pipeline timeline of step {trainer.global_step} (measured; rows: ranks, boxes: action + microbatch)"
            log_image(trainer, "pipeline/timeline", draw_timeline(events, title=title))

    def _log_moe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Routing statistics of every MoE layer (each pipeline stage holds its own), averaged over ranks, and the
        global max/mean load of the other blocks that a selection bias balances (LitGPT's, transformers')."""
        mine: dict[str, MoEStats] = {}
        for name, layer in list(moe_layers(pl_module)):
            stats = layer.pop_stats()
            if stats is not None:
                mine[name] = stats
        biased = {name: m.global_load.tolist() for name, m in pl_module.named_modules()
                  if not isinstance(m, MoE) and getattr(m, "global_load", None) is not None}
        per_rank = gather_objects((mine, biased))
        loads = {name: counts for _, theirs in per_rank for name, counts in theirs.items()}
        log_scalars(trainer, moe_metrics([stats for stats, _ in per_rank], loads))  # rank 0 writes

    # ------------------------------------------------------------------ torch.profiler
    def _start_torch_profiler(self, trainer: L.Trainer) -> None:
        self._torch_profiler = start_trace(trainer, self.log_dir)

    def _stop_torch_profiler(self) -> None:
        profiler, self._torch_profiler = self._torch_profiler, None
        profiler.__exit__(None, None, None)
