"""Data parallelism: ZeRO 0-2 (:mod:`.zero`, bucket layout in :mod:`.layout`), ZeRO-3 on FSDP2
(:mod:`.fsdp`), and the global gradient norm over every dimension (:mod:`.grad_norm`)."""

from lightning_para.parallel.data.fsdp import apply_fully_shard, choose_units, fsdp_no_sync
from lightning_para.parallel.data.grad_norm import (
    GradReplication,
    clip_grads_by_global_norm,
    clip_grads_by_value,
    count_grad_replication,
    global_grad_norm,
)
from lightning_para.parallel.data.layout import ParamSlot
from lightning_para.parallel.data.zero import ZeroDataParallel

__all__ = [
    "GradReplication",
    "ParamSlot",
    "ZeroDataParallel",
    "apply_fully_shard",
    "choose_units",
    "clip_grads_by_global_norm",
    "clip_grads_by_value",
    "count_grad_replication",
    "fsdp_no_sync",
    "global_grad_norm",
]
