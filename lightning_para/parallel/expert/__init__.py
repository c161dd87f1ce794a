"""Expert parallelism: experts sharded over ``ep``, tokens moved by all-to-all (see :mod:`.apply`)."""

from lightning_para.parallel.expert.apply import ExpertParallelInfo, apply_expert_parallel, check_expert_layout
from lightning_para.parallel.expert.dispatch import AllToAllDispatcher

__all__ = ["AllToAllDispatcher", "ExpertParallelInfo", "apply_expert_parallel", "check_expert_layout"]
