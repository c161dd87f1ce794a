"""Data parallelism. One entry point, :func:`apply_data_parallel`, returns a :class:`DataParallel`
(:mod:`.interface`): the strategy, the pipeline runner, checkpoints, observers and precision talk to
that only. Behind it: ZeRO 0-2 (:mod:`.zero`, bucket layout in :mod:`.layout`), ZeRO-3 on FSDP2
(:mod:`.fsdp`), the global gradient norm over every dimension (:mod:`.grad_norm`), and BatchNorm
statistics over the dp group (:mod:`.sync_batchnorm`, ``Trainer(sync_batchnorm=True)``)."""

from lightning_para.parallel.data.apply import FullyShardedData, UserFullyShardedData, ZeroData, apply_data_parallel
from lightning_para.parallel.data.fsdp import (
    apply_fully_shard,
    choose_units,
    fsdp_no_sync,
    fsdp_without_gradient_sync,
    is_fsdp_root,
    reshard_fsdp_units,
)
from lightning_para.parallel.data.grad_norm import (
    GradReplication,
    clip_grads_by_global_norm,
    clip_grads_by_value,
    count_grad_replication,
    global_grad_norm,
)
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.parallel.data.layout import ParamSlot
from lightning_para.parallel.data.memory import BytesPerParam, MemoryBreakdown
from lightning_para.parallel.data.sync_batchnorm import DataParallelBatchNorm, convert_sync_batchnorm
from lightning_para.parallel.data.zero import ZeroDataParallel

__all__ = [
    "BytesPerParam",
    "DataParallel",
    "DataParallelBatchNorm",
    "FullyShardedData",
    "MemoryBreakdown",
    "UserFullyShardedData",
    "ZeroData",
    "apply_data_parallel",
    "GradReplication",
    "ParamSlot",
    "ZeroDataParallel",
    "apply_fully_shard",
    "choose_units",
    "clip_grads_by_global_norm",
    "clip_grads_by_value",
    "convert_sync_batchnorm",
    "count_grad_replication",
    "fsdp_no_sync",
    "fsdp_without_gradient_sync",
    "global_grad_norm",
    "is_fsdp_root",
    "reshard_fsdp_units",
]
