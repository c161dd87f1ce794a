"""How the profiler's figures leave a rank: every rank's record gathered on every rank, and rank 0 writing
scalars, images and text through the trainer's loggers (TensorBoard by default)."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (a world collective: call it on all ranks)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def log_scalars(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Rank 0 logs the finite ``metrics`` at the trainer's global step (other ranks: nothing)."""
    if not trainer.is_global_zero or not metrics:
        return
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    for logger in trainer.loggers:
        logger.log_metrics(clean, step=trainer.global_step)


def _tensorboards(trainer: L.Trainer) -> list[Any]:
    return [lg.experiment for lg in trainer.loggers if hasattr(getattr(lg, "experiment", None), "add_image")]


def log_image(trainer: L.Trainer, tag: str, image: Any) -> None:
    """An HWC image in every TensorBoard logger of the trainer."""
    for tb in _tensorboards(trainer):
        tb.add_image(tag, image, trainer.global_step, dataformats="HWC")


def log_text(trainer: L.Trainer, tag: str, text: str) -> None:
    """Text (markdown) in every TensorBoard logger of the trainer."""
    for tb in _tensorboards(trainer):
        tb.add_text(tag, text, trainer.global_step)


__all__ = ["gather_objects", "log_image", "log_scalars", "log_text", "world_size"]
