"""Context parallelism: the sequence split over the ``cp`` ranks, attention computed across them.

* :mod:`.sharding`: load-balanced (head-tail) sequence shards and their global positions;
* :mod:`.ring`: ring attention (K/V blocks peer-to-peer, online softmax);
* :mod:`.ulysses`: DeepSpeed-Ulysses (all-to-all from sequence to heads);
* :mod:`.attention`: one entry point and a ``TorchFunctionMode`` that makes SDPA context-parallel;
* :mod:`.step`: ``apply_context_parallel`` and what the strategy does around each step (batch
  split and its hook, global positions, the loss over the whole sequence).

Self-contained: nothing here imports another ``lightning_para`` module.
"""

from lightning_para.parallel.context.attention import (
    CP_METHODS,
    ContextParallelSDPA,
    context_parallel_attention,
    context_parallel_sdpa,
)
from lightning_para.parallel.context.ring import ring_attention
from lightning_para.parallel.context.sharding import (
    chunk_ids_for_rank,
    natural_to_rank_order,
    position_ids_for_rank,
    rank_order_positions,
    rank_order_to_natural,
    shard_sequence,
    unshard_sequence,
    valid_cp_sizes,
    validate_cp_sequence_length,
)
from lightning_para.parallel.context.step import (
    ContextParallel,
    ContextParallelShard,
    ContextParallelStepMode,
    apply_context_parallel,
)
from lightning_para.parallel.context.ulysses import all_to_all, ulysses_attention, validate_ulysses_heads

__all__ = [
    "CP_METHODS",
    "ContextParallel",
    "ContextParallelSDPA",
    "ContextParallelShard",
    "ContextParallelStepMode",
    "apply_context_parallel",
    "all_to_all",
    "chunk_ids_for_rank",
    "context_parallel_attention",
    "context_parallel_sdpa",
    "natural_to_rank_order",
    "position_ids_for_rank",
    "rank_order_positions",
    "rank_order_to_natural",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "valid_cp_sizes",
    "validate_cp_sequence_length",
    "validate_ulysses_heads",
]
