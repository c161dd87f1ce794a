"""The sequence-parallel stream and the styles that act on it outside the attention/MLP sublayers.

Under TP+SP the residual stream ``[batch, seq, hidden]`` is a DTensor ``Shard(1)``: each tp rank
holds and computes on its ``seq / tp`` rows, while ``.shape`` stays global, so model code that
builds positions, rotary tables or masks from ``hidden.shape[1]`` sees the real length
(docs/tensor_parallel.md, "Sequence parallel"). Here: the layout helpers, the norm style
(:class:`SequenceShardedNorm`), learned positions added to the stream (:class:`SequenceSlice`),
modules run whole on the gathered sequence (:class:`GatherSequence`) and the pipeline-stage
boundary (:func:`shard_stage_boundary`). Every style returns the kind of tensor it was given: a
caller passing this rank's slice as a plain tensor gets a plain tensor back.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

# The residual stream is batch-first: [batch, seq, hidden].
SEQ_DIM = 1


def check_sequence_divisible(seq_len: int, tp: int, where: str) -> None:
    """Sequence parallel splits the sequence evenly over tp; anything else is a clear error."""
    if seq_len % tp:
        raise ValueError(
            f"sequence_parallel=True splits the sequence over tp={tp}, but the sequence length is {seq_len} ({where})."
            f" Use sequence lengths that are multiples of {tp} (pad the batch), or set sequence_parallel=False."
        )


def is_sequence_shard(x: Any) -> bool:
    """A DTensor whose only placement shards the sequence dimension (the SP residual stream)."""
    return isinstance(x, DTensor) and len(x.placements) == 1 and x.placements[0] == Shard(SEQ_DIM)


def like_input(out: Any, input_was_plain: bool) -> Any:
    """Under SP: give a sequence-sharded output back as this rank's plain slice if the input was plain
    (the first tensor of a tuple output: attention returns ``(output, weights)``)."""
    if not input_was_plain:
        return out
    if is_sequence_shard(out):
        return out.to_local()
    if isinstance(out, tuple) and out and is_sequence_shard(out[0]):
        return (out[0].to_local(), *out[1:])
    return out


class SequenceShardedNorm(ParallelStyle):
    """SP: a norm (LayerNorm/RMSNorm) on the sequence shard of the stream (Korthikanti et al. 2022).

    torch's ``SequenceParallel`` with one difference: the output has the kind of the input. A
    sequence-sharded DTensor (the stream) gives a DTensor; this rank's slice as a plain tensor
    gives a plain tensor, so ``x + norm(x)``-style code keeps working on plain slices. The
    weights become ``Replicate`` DTensors; their gradients come back ``Partial`` (each rank saw
    other tokens) and are summed over tp by :func:`~.apply.apply_tensor_parallel`'s hook.
    """

    def __init__(self) -> None:
        super().__init__()
        self._plain_inputs: list[bool] = []

    def _prepare(self, mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"'norm' expects the hidden states as the first positional argument of {type(module).__name__}.")
        self._plain_inputs.append(not isinstance(x, DTensor))
        if isinstance(x, DTensor):
            x = x if is_sequence_shard(x) else x.redistribute(mesh, [Shard(SEQ_DIM)])
        else:
            x = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False)
        return (x, *args[1:])

    def _finish(self, module: nn.Module, args: tuple, out: Any) -> Any:
        return like_input(out, self._plain_inputs.pop() if self._plain_inputs else False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # Every rank holds the same initialised weights: no communication needed.
            replicated = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(self._prepare, device_mesh))
        # Not always_call: torch.compile guards on the ids of always-called hooks (one graph per block);
        # a call that raised leaves one entry at the bottom of the stack, which later pairs never reach.
        module.register_forward_hook(self._finish)
        return module


def shard_stage_boundary(stage: nn.Module, mesh: DeviceMesh) -> None:
    """SP with pipeline stages: the stream crosses stages as this rank's plain sequence slice.

    Point-to-point sends take plain tensors, and a slice is ``1/tp`` of the bytes. Inside the
    stage the stream is the same global-shaped DTensor as without pipelining: a received
    floating-point input of ``[batch, seq/tp, ...]`` becomes a ``Shard(1)`` DTensor (token ids,
    integers, pass through), and a sequence-sharded output is sent as its local slice.
    """

    def enter(module: nn.Module, args: tuple) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [Shard(SEQ_DIM)], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.is_floating_point() and a.dim() > SEQ_DIM
            else a
            for a in args
        )

    def leave(module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, tuple):
            return tuple(o.to_local() if is_sequence_shard(o) else o for o in out)
        return out.to_local() if is_sequence_shard(out) else out

    stage.register_forward_pre_hook(enter)
    stage.register_forward_hook(leave)


class SequenceSlice(ParallelStyle):
    """SP only: keep this rank's slice (dim -2) of a module output that covers the whole sequence.

    For learned position (or token-type) embeddings added to the sequence-sharded residual
    stream: the output is a DTensor sharded along dim -2 with its global shape, so adding it to
    the stream (``Shard(1)`` of ``[batch, seq, hidden]``) broadcasts without communication.
    Backward all-gathers the output gradient, so the (plain, replicated) weights get the full
    gradient on every rank.
    """

    def _slice(self, mesh: DeviceMesh, module: nn.Module, args: tuple, out: torch.Tensor) -> DTensor:
        dim = out.dim() - 2
        check_sequence_divisible(out.shape[dim], mesh.size(), f"the output of {type(module).__name__}")
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(partial(self._slice, device_mesh))
        return module


class GatherSequence(ParallelStyle):
    """SP only: run a module replicated on the full sequence (e.g. an MoE layer), then re-slice.

    Tensor inputs shaped like the first one are all-gathered along the sequence; the first
    tensor output (or the first element of a tuple output) is sliced back. Every tp rank
    computes the same thing, so parameter gradients are identical and stay plain tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self._plain_inputs: list[bool] = []  # per call in flight: was the first input a plain tensor?

    def _gather(self, mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self._plain_inputs.append(first is not None and not isinstance(first, DTensor))
        if first is None:
            return args, kwargs

        def gather(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.full_tensor()
            if isinstance(x, torch.Tensor) and x.shape == first.shape:
                full = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False)
                return full.redistribute(mesh, [Replicate()]).to_local()
            return x

        return tuple(gather(a) for a in args), kwargs

    def _slice(self, mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        input_was_plain = self._plain_inputs.pop() if self._plain_inputs else True

        def cut(x: torch.Tensor) -> torch.Tensor:
            shard = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(SEQ_DIM)])
            return shard.to_local() if input_was_plain else shard

        if isinstance(out, torch.Tensor):
            return cut(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (cut(out[0]), *out[1:])
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(self._gather, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(self._slice, device_mesh), with_kwargs=True)  # not always_call: as above
        return module


__all__ = [
    "SEQ_DIM", "GatherSequence", "SequenceShardedNorm", "SequenceSlice", "check_sequence_divisible",
    "is_sequence_shard", "like_input", "shard_stage_boundary",
]
