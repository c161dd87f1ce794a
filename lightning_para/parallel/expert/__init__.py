"""Expert parallelism: experts sharded over ``ep``, tokens moved by all-to-all (see :mod:`.apply`);
other libraries' experts through the adapters their integrations register (:mod:`.adapters`)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".adapters": ("ExpertAdapter", "balance_experts", "expert_adapters", "register_expert_adapter"),
    ".apply": ("ExpertParallelInfo", "apply_expert_parallel", "check_expert_layout"),
    ".dispatch": ("AllToAllDispatcher",),
})
