"""Sharded checkpoints (``torch.distributed.checkpoint``), consolidation, resharding.

* :mod:`.format`: the on-disk format (a DCP directory plus ``meta.pt``);
* :mod:`.optimizer`: optimizer state by parameter name as global DTensors, for any layout;
* :mod:`.consolidate`: one ordinary Lightning checkpoint out of a sharded directory;
* :mod:`.atomic`: write beside, mark complete, swap into place; verification on load;
* :mod:`.save`: what the strategy calls to save (atomically, every rank agreeing) and remove;
* :mod:`.io`: what the strategy calls to load in place;
* :mod:`.async_save`: saves written in the background once the state is staged (``async_save=True``);
* :mod:`.full_state`: full plain state on rank 0 (``save_distributed_checkpoint=False``);
* :mod:`.checksums`: per-file CRC-32s written at save, verified at load;
* :mod:`.failures`: a failed save agreed over ranks (a full disk named as such);
* :mod:`.lock`: one run per checkpoint directory;
* :mod:`.run`: which run a checkpoint belongs to, and this run's hold on its folders;
* :mod:`.resume`: what ``ckpt_path="hpc"``/``"last"`` load: this run's newest complete checkpoint;
* :mod:`.last`: ``ckpt_path="last"`` as the newest complete checkpoint (``ParaModelCheckpoint``);
* :mod:`.pretrained`: pretrained safetensors read sharded after parallelizing (each rank its slices);
* :mod:`.model_info`: what integrations record about the model (transformers: class and config).
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".async_save": ("AsyncSaver", "check_async_save", "is_async_checkpoint_io"),
    ".atomic": ("CorruptCheckpointError", "IncompleteCheckpointError", "mark_checkpoint_complete", "new_token",
        "newest_complete_checkpoint", "verify_checkpoint"),
    ".consolidate": ("consolidate_checkpoint",),
    ".failures": ("CheckpointDiskFullError", "CheckpointSaveError"),
    ".full_state": ("full_model_state", "full_optimizer_state"),
    ".format": ("ROW_ORDER_KEY",),
    ".io": ("load_checkpoint_in_place", "stored_row_orders"),
    ".last": ("ParaModelCheckpoint",),
    ".lock": ("CheckpointDirectoryLockedError", "DirectoryLock"),
    ".model_info": ("model_info", "register_model_info"),
    ".optimizer": ("optimizer_params", "optimizer_state_dict"),
    ".pretrained": ("PretrainedWeights", "load_pretrained_into", "stored_tensors"),
    ".resume": ("ResumeCheckpointError", "begin_run", "resume_path"),
    ".run": ("RUN_ID_ENV", "CheckpointRun"),
    ".save": ("remove_checkpoint", "save_checkpoint"),
})
