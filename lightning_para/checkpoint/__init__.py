"""Sharded checkpoints (``torch.distributed.checkpoint``), consolidation, resharding.

* :mod:`.format`: the on-disk format (a DCP directory plus ``meta.pt``);
* :mod:`.optimizer`: optimizer state by parameter name as global DTensors, for any layout;
* :mod:`.consolidate`: one ordinary Lightning checkpoint out of a sharded directory;
* :mod:`.io`: what the strategy calls to save and to load in place;
* :mod:`.full_state`: full plain state on rank 0 (``save_distributed_checkpoint=False``).
"""

from lightning_para.checkpoint.consolidate import consolidate_checkpoint
from lightning_para.checkpoint.full_state import full_model_state, full_optimizer_state
from lightning_para.checkpoint.io import load_checkpoint_in_place, save_checkpoint
from lightning_para.checkpoint.optimizer import optimizer_params, optimizer_state_dict

__all__ = [
    "consolidate_checkpoint",
    "full_model_state",
    "full_optimizer_state",
    "load_checkpoint_in_place",
    "optimizer_params",
    "optimizer_state_dict",
    "save_checkpoint",
]
