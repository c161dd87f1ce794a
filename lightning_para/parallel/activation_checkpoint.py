"""Activation recomputation per block: ``activation_checkpointing="full"``, ``"selective"`` or ``"selective_op"``.

Megatron's activation memory per layer (Korthikanti et al. 2022, Sec. 4; s sequence, b batch,
h hidden, a heads, t tensor-parallel size; 16-bit activations) is ``sbh(34 + 5as/h)``; with
TP ``sbh(10 + 24/t + 5as/(ht))``; with TP+SP ``sbh(34/t + 5as/(ht))``.

* ``"full"``: each block keeps only its input; the whole block forward runs again in backward
  (``2sbh`` per layer, ~33% more compute: one extra forward).
* ``"selective"``: each block keeps the outputs of matmuls, attention kernels and
  collectives, and recomputes the cheap, memory-heavy rest: norms, activations, softmax,
  dropout, elementwise ops (the paper's selective recomputation targets the ``5as/h``
  attention term; with fused attention kernels that term is already gone, so here the
  elementwise terms go instead). Recomputing collectives would add communication, so they
  are always saved.
* ``"selective_op"``: torchtitan's per-op policy (``selective_ac_option="op"``,
  ``torchtitan/distributed/activation_checkpoint.py``, its ``_save_list`` at the commit of its
  published Llama 3.1 benchmarks, 9dec370): like ``"selective"``, but every second matmul of a
  block's forward is recomputed (a counter per block forward: the 2nd, 4th, ... ``mm``/``addmm``/
  ``linear``; in a Llama block with separate q, k, v projections, k, the attention output
  projection and the SwiGLU up projection), and of the collectives only reduce-scatter outputs are
  saved (a sequence-parallel all-gather or a tensor-parallel all-reduce runs again in the
  recomputation). It keeps less than ``"selective"`` for about a third of a block's matmul
  forward more.

Blocks are the entries of the outermost ``nn.ModuleList``/``nn.Sequential`` containers found
from the root (``nn.ModuleDict`` is searched through, as in nanoGPT's ``transformer``). Checkpointing uses
:func:`torch.distributed._composable.checkpoint`, which installs hooks instead of a wrapper
module, so parameter names -- and checkpoints -- are the same with and without it.
Recomputation replays the block's forward collectives (TP/SP), on every rank alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed._composable import checkpoint  # private: see docs/architecture.md
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_para.spec.options import RECOMPUTE_MODES as MODES

# Containers whose entries are blocks; an nn.ModuleDict is a namespace (nanoGPT's `transformer`).
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_blocks(root: nn.Module) -> list[nn.Module]:
    """Entries of the outermost ``nn.ModuleList``/``nn.Sequential`` under ``root`` (the transformer blocks)."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                blocks.extend(c for c in child.children() if any(True for _ in c.parameters()))
            else:
                visit(child)

    visit(root)
    return blocks


def _save_policy() -> Any:
    """Ops whose outputs selective recomputation keeps (everything else is recomputed)."""
    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default}
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    ):
        op = getattr(aten, name, None)
        if op is not None:
            keep.add(op.default)
    return keep


def _policy(keep, ctx, op, *args, **kwargs):
    namespace = getattr(op, "namespace", "")
    if op in keep or namespace in ("_c10d_functional", "c10d_functional", "c10d"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _matmuls() -> set:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.linear.default}


def _reduce_scatters() -> set:
    ops = set()
    for namespace in ("_c10d_functional", "c10d_functional"):
        packet = getattr(getattr(torch.ops, namespace, None), "reduce_scatter_tensor", None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _alternating_policy(keep: set, matmuls: set) -> Callable[..., CheckpointPolicy]:
    """torchtitan's per-op policy for one block forward: save ``keep`` (matmuls, attention,
    reduce-scatter) but every second matmul. The forward and the recomputation count separately,
    so both see the same matmuls saved."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _HookOpsOutsideRecomputation(TorchDispatchMode):
    """Runs FSDP2's hook ops of a recomputation where its forward ran them: outside selective checkpointing.

    FSDP2 prepends its forward pre-hook, so in the forward it runs before the composable checkpoint's hook,
    outside the checkpointed region; when backward recomputes the block, the checkpoint calls the module again
    and FSDP2's hook (which casts the inputs to the compute dtype, inside
    ``record_function("FSDP::...")``) now runs inside the region. Torch's selective checkpoint replays only
    the ops its forward recorded and raises on any other ("encountered during backward but not found in
    storage"): ZeRO-3 with a compute dtype (``*-true`` precisions) and ``"selective"``/``"selective_op"``
    could not train. This mode sits above the replaying one and runs, outside it, the profiler's ops and every
    op inside an ``FSDP::`` profiler range: exactly what the forward ran outside the region."""

    def __init__(self) -> None:
        super().__init__()
        self._fsdp_ranges = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func.namespace != "profiler" and not self._fsdp_ranges:
            return func(*args, **kwargs)  # on to the replaying mode
        if func is torch.ops.profiler._record_function_enter_new.default and str(args[0]).startswith("FSDP::"):
            self._fsdp_ranges += 1
        elif func.namespace == "profiler" and "exit" in func.name() and self._fsdp_ranges:
            self._fsdp_ranges -= 1
        with _disable_current_modes():  # private: pinned by the zero=3 + selective test
            return func(*args, **kwargs)


@contextlib.contextmanager
def _recompute_with_hooks_outside(
    replaying: Any, recompute_context: Optional[Callable[[], contextlib.AbstractContextManager[Any]]]
) -> Iterator[None]:
    with replaying, _HookOpsOutsideRecomputation(), (recompute_context() if recompute_context else contextlib.nullcontext()):
        yield


def _selective_contexts(
    policy: Callable[..., CheckpointPolicy],
    recompute_context: Optional[Callable[[], contextlib.AbstractContextManager[Any]]] = None,
) -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts for ``policy``, with FSDP2's hook ops run outside the replay
    and ``recompute_context`` entered around the recomputation (see :func:`apply_activation_checkpointing`)."""
    recording, replaying = create_selective_checkpoint_contexts(policy)
    return recording, _recompute_with_hooks_outside(replaying, recompute_context)


def _alternating_contexts(
    keep: set, matmuls: set, recompute_context: Optional[Callable[[], contextlib.AbstractContextManager[Any]]] = None
) -> tuple[Any, Any]:
    # A fresh counter for each checkpointed call (torch calls `context_fn` once per block forward).
    return _selective_contexts(_alternating_policy(keep, matmuls), recompute_context)


def apply_activation_checkpointing(
    module: nn.Module,
    mode: Optional[str],
    recompute_context: Optional[Callable[[], contextlib.AbstractContextManager[Any]]] = None,
) -> list[nn.Module]:
    """Recompute the activations of every block of ``module`` in backward; returns the blocks.

    ``mode`` is ``"full"``, ``"selective"``, ``"selective_op"`` or ``None`` (nothing). ``recompute_context`` makes
    a context entered around each recomputation: torch-function modes active in the forward (context
    parallel's attention, the dry run's fused kernels) are not active in backward, where the block's forward
    runs again. Raises ``ValueError`` for another value or when the module has no blocks to checkpoint.
    """
    if mode is None:
        return []
    if mode not in MODES:
        raise ValueError(
            f"`activation_checkpointing={mode!r}` is unknown. Choose one of {', '.join(map(repr, MODES))} or None."
        )
    blocks = find_blocks(module)
    if not blocks:
        raise ValueError(
            f"`activation_checkpointing={mode!r}`: {type(module).__name__} has no blocks (entries of an nn.ModuleList,"
            " or nn.Sequential) to checkpoint. Keep the transformer blocks in a ModuleList."
        )
    kwargs: dict[str, Any] = {}
    if mode == "selective":
        kwargs["context_fn"] = partial(_selective_contexts, partial(_policy, _save_policy()), recompute_context)
    elif mode == "selective_op":
        kwargs["context_fn"] = partial(
            _alternating_contexts, _save_policy() | _reduce_scatters(), _matmuls(), recompute_context
        )
    elif recompute_context is not None:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_context())
    for block in blocks:
        checkpoint(block, **kwargs)
    return blocks


__all__ = ["MODES", "apply_activation_checkpointing", "find_blocks"]
