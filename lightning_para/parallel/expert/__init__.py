"""Expert parallelism: experts sharded over ``ep``, tokens moved by all-to-all (see :mod:`.apply`);
other libraries' experts through the adapters their integrations register (:mod:`.adapters`)."""

from lightning_para.parallel.expert.adapters import ExpertAdapter, expert_adapters, register_expert_adapter
from lightning_para.parallel.expert.apply import ExpertParallelInfo, apply_expert_parallel, check_expert_layout
from lightning_para.parallel.expert.dispatch import AllToAllDispatcher

__all__ = [
    "AllToAllDispatcher", "ExpertAdapter", "ExpertParallelInfo", "apply_expert_parallel", "check_expert_layout",
    "expert_adapters", "register_expert_adapter",
]
