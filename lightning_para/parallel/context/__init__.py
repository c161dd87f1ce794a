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

from lightning_para.parallel.context.adapters import (
    ContextParallelAdapter,
    ContextParallelRuntime,
    context_parallel_adapters,
    register_context_parallel_adapter,
)
from lightning_para.parallel.context.attention import (
    CP_METHODS,
    ContextParallelSDPA,
    context_parallel_attention,
    context_parallel_sdpa,
)
from lightning_para.parallel.context.ring import ring_attention
from lightning_para.parallel.context.check import PositionCheck
from lightning_para.parallel.context.sharding import (
    ContextParallelShard,
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
    ContextParallelStepMode,
    apply_context_parallel,
)
from lightning_para.parallel.context.ulysses import all_to_all, ulysses_attention, validate_ulysses_heads

__all__ = [
    "CP_METHODS",
    "ContextParallel",
    "ContextParallelAdapter",
    "ContextParallelRuntime",
    "ContextParallelSDPA",
    "ContextParallelShard",
    "ContextParallelStepMode",
    "PositionCheck",
    "apply_context_parallel",
    "all_to_all",
    "chunk_ids_for_rank",
    "context_parallel_adapters",
    "context_parallel_attention",
    "context_parallel_sdpa",
    "natural_to_rank_order",
    "position_ids_for_rank",
    "rank_order_positions",
    "rank_order_to_natural",
    "register_context_parallel_adapter",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "valid_cp_sizes",
    "validate_cp_sequence_length",
    "validate_ulysses_heads",
]
