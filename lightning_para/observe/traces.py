"""A ``torch.profiler`` trace of a window of steps, per rank, for TensorBoard's profiler plugin or Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L


def start_trace(trainer: L.Trainer, log_dir: Optional[Path]) -> Any:
    """An entered ``torch.profiler.profile`` (CPU, and CUDA on a GPU run) that writes this rank's trace to
    ``<log_dir or the trainer's root>/traces`` when exited."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if trainer.strategy.root_device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    folder = (log_dir or Path(trainer.default_root_dir)) / "traces"
    handler = tensorboard_trace_handler(str(folder), worker_name=f"rank{trainer.global_rank}")
    trace = profile(activities=activities, on_trace_ready=handler, record_shapes=False)
    trace.__enter__()
    return trace


__all__ = ["start_trace"]
