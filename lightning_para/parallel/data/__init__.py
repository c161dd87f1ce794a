"""Data parallelism. One entry point, :func:`apply_data_parallel`, returns a :class:`DataParallel`
(:mod:`.interface`): the strategy, the pipeline runner, checkpoints, observers and precision talk to
that only. Behind it: ZeRO 0-2 (:mod:`.zero`, bucket layout in :mod:`.layout`), ZeRO-3 on FSDP2
(:mod:`.fsdp`), the global gradient norm over every dimension (:mod:`.grad_norm`), and BatchNorm
statistics over the dp group (:mod:`.sync_batchnorm`, ``Trainer(sync_batchnorm=True)``)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".apply": ("FullyShardedData", "UserFullyShardedData", "ZeroData", "apply_data_parallel"),
    ".fsdp": ("apply_fully_shard", "choose_units", "fsdp_no_sync", "fsdp_without_gradient_sync", "is_fsdp_root",
        "reshard_fsdp_units"),
    ".grad_norm": ("GradReplication", "clip_grads_by_global_norm", "clip_grads_by_value", "count_grad_replication",
        "global_grad_norm"),
    ".interface": ("DataParallel", "NoDataParallel"),
    ".layout": ("ParamSlot",),
    ".memory": ("BytesPerParam", "MemoryBreakdown"),
    ".sync_batchnorm": ("DataParallelBatchNorm", "convert_sync_batchnorm"),
    ".zero": ("ZeroDataParallel",),
})
