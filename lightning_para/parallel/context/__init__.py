"""Context parallelism: the sequence split over the ``cp`` ranks, attention computed across them.

* :mod:`.sharding`: load-balanced (head-tail) sequence shards and their global positions;
* :mod:`.ring`: ring attention (K/V blocks peer-to-peer, online softmax);
* :mod:`.ulysses`: DeepSpeed-Ulysses (all-to-all from sequence to heads);
* :mod:`.attention`: one entry point and a ``TorchFunctionMode`` that makes SDPA context-parallel;
* :mod:`.adapters`: how integrations give their models global positions (a registry they fill);
* :mod:`.check`: the first-step check that the model computes under cp what it computes whole;
* :mod:`.step`: ``apply_context_parallel`` and what the strategy does around each step (batch
  split and its hook, global positions, the loss over the whole sequence).

Self-contained: nothing here imports another ``lightning_para`` module.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".adapters": ("ContextParallelAdapter", "ContextParallelRuntime", "context_parallel_adapters",
        "register_context_parallel_adapter"),
    ".attention": ("CP_METHODS", "ContextParallelSDPA", "context_parallel_attention", "context_parallel_sdpa"),
    ".ring": ("ring_attention",),
    ".check": ("PositionCheck",),
    ".sharding": ("ContextParallelShard", "chunk_ids_for_rank", "natural_to_rank_order", "position_ids_for_rank",
        "rank_order_positions", "rank_order_to_natural", "shard_sequence", "unshard_sequence", "valid_cp_sizes",
        "validate_cp_sequence_length"),
    ".step": ("ContextParallel", "ContextParallelStepMode", "apply_context_parallel"),
    ".ulysses": ("all_to_all", "ulysses_attention", "validate_ulysses_heads"),
})
