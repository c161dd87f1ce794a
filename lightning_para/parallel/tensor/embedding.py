"""The token embedding under tensor parallelism: split by vocabulary rows (``"vocab_parallel"``), with the
sum that ends it an all-reduce (TP) or a reduce-scatter along the sequence that starts the
sequence-parallel region (SP). See :mod:`.styles` for the layout contract."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_para.parallel.tensor.bounds import check_token_ids
from lightning_para.parallel.tensor.sequence import SEQ_DIM, check_sequence_divisible


class VocabParallelEmbedding(ParallelStyle):
    """``nn.Embedding`` split by vocabulary rows (Megatron's ``VocabParallelEmbedding``).

    Each rank looks up the ids in its own row range (others give zeros), and the partial
    outputs are summed: an all-reduce (TP) or a reduce-scatter along the sequence (SP, which
    also starts the sequence-parallel region). Computed on local tensors so the weight
    gradient only ever exists for this rank's rows (torch's ``RowwiseParallel`` on an
    embedding produces a full-vocabulary, replicated gradient on every rank).
    """

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _forward(self, mesh: DeviceMesh, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(ids, DTensor):
            ids = ids.to_local()
        # The ids are whole on every tp rank: each raises the same IndexError torch raises at tp=1.
        check_token_ids(ids, module.num_embeddings)
        tp = mesh.size()
        if self.sequence_parallel:
            if ids.dim() != 2:
                raise ValueError(
                    "sequence_parallel=True needs batch-first token ids [batch, seq] for the vocab-parallel"
                    f" embedding, got shape {tuple(ids.shape)}."
                )
            check_sequence_divisible(ids.shape[SEQ_DIM], tp, "the token ids")
        weight = module.weight.to_local()
        start = mesh.get_local_rank() * weight.shape[0]
        outside = (ids < start) | (ids >= start + weight.shape[0])
        padding = module.padding_idx
        local_padding = padding - start if padding is not None and start <= padding < start + weight.shape[0] else None
        out = torch.nn.functional.embedding((ids - start).masked_fill(outside, 0), weight, local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        summed = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        if self.sequence_parallel:
            # Reduce-scatter along the sequence; the stream stays a DTensor with its global shape.
            return summed.redistribute(mesh, [Shard(SEQ_DIM)])
        return summed.redistribute(mesh, [Replicate()]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"'vocab_parallel' applies to nn.Embedding, not {type(module).__name__}.")
        if module.max_norm is not None or module.sparse:
            raise ValueError("'vocab_parallel' does not support nn.Embedding(max_norm=...) or sparse=True.")
        weight = module.weight
        module.register_parameter(
            "weight",
            nn.Parameter(
                distribute_tensor(weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=weight.requires_grad,
            ),
        )
        module.forward = partial(self._forward, device_mesh, module)
        return module


__all__ = ["VocabParallelEmbedding"]
