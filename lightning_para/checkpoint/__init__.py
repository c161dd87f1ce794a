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

from lightning_para.checkpoint.async_save import AsyncSaver, check_async_save, is_async_checkpoint_io
from lightning_para.checkpoint.atomic import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    mark_checkpoint_complete,
    new_token,
    newest_complete_checkpoint,
    verify_checkpoint,
)
from lightning_para.checkpoint.consolidate import consolidate_checkpoint
from lightning_para.checkpoint.failures import CheckpointDiskFullError, CheckpointSaveError
from lightning_para.checkpoint.full_state import full_model_state, full_optimizer_state
from lightning_para.checkpoint.io import load_checkpoint_in_place
from lightning_para.checkpoint.last import ParaModelCheckpoint
from lightning_para.checkpoint.lock import CheckpointDirectoryLockedError, DirectoryLock
from lightning_para.checkpoint.model_info import model_info, register_model_info
from lightning_para.checkpoint.optimizer import optimizer_params, optimizer_state_dict
from lightning_para.checkpoint.pretrained import PretrainedWeights, load_pretrained_into, stored_tensors
from lightning_para.checkpoint.resume import ResumeCheckpointError, begin_run, resume_path
from lightning_para.checkpoint.run import RUN_ID_ENV, CheckpointRun
from lightning_para.checkpoint.save import remove_checkpoint, save_checkpoint

__all__ = [
    "AsyncSaver",
    "RUN_ID_ENV",
    "CheckpointRun",
    "ResumeCheckpointError",
    "begin_run",
    "check_async_save",
    "is_async_checkpoint_io",
    "resume_path",
    "CheckpointDirectoryLockedError",
    "CheckpointDiskFullError",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "DirectoryLock",
    "IncompleteCheckpointError",
    "ParaModelCheckpoint",
    "PretrainedWeights",
    "consolidate_checkpoint",
    "full_model_state",
    "full_optimizer_state",
    "load_checkpoint_in_place",
    "load_pretrained_into",
    "mark_checkpoint_complete",
    "model_info",
    "new_token",
    "newest_complete_checkpoint",
    "optimizer_params",
    "optimizer_state_dict",
    "register_model_info",
    "remove_checkpoint",
    "save_checkpoint",
    "stored_tensors",
    "verify_checkpoint",
]
