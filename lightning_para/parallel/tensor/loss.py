"""Loss parallel: cross-entropy on vocab-sharded logits without gathering them.

With ``loss_parallel=True`` tensor parallelism leaves the head's logits a DTensor sharded over
the vocabulary. :func:`loss_parallel_step` makes ``F.cross_entropy`` on such logits run torch's
vocab-parallel kernel (``torch.distributed.tensor.parallel.loss_parallel``) and return an
ordinary tensor; :func:`loss_parallel_backward` wraps the backward, which needs the same custom
ops. Both take ``enabled`` from the record of what :func:`~lightning_para.parallelize` applied, so
nothing is marked on the user's modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.parallel.loss import customized_loss_ops
from torch.overrides import TorchFunctionMode

from lightning_para._dtensor import local_tensor
from lightning_para.parallel.tensor.bounds import check_targets


def _loss_parallel() -> contextlib.AbstractContextManager[Any]:
    """torch's ``loss_parallel()``, unless already active: it is not re-entrant (leaving an
    inner one would switch the loss ops off for the enclosing one)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers  # private: see docs/architecture.md
    active = all(op in handlers for op in customized_loss_ops)
    return contextlib.nullcontext() if active else loss_parallel()


class _CrossEntropyOnShards(TorchFunctionMode):
    """``F.cross_entropy`` on vocab-sharded DTensor logits: torch's loss-parallel kernel, plain result.

    The result is an ordinary tensor (differentiable, identical on every tp rank), so user code
    can add auxiliary losses to it, log it and call ``.item()``. ``label_smoothing`` is not
    supported by the parallel kernel: those calls gather the logits instead.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], DTensor):
            logits = args[0]
            target = args[1] if len(args) > 1 else kwargs.get("target")
            if isinstance(target, torch.Tensor):  # a label no rank's vocabulary shard holds would count as logit 0
                ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
                check_targets(local_tensor(target), logits.shape[1 if logits.dim() > 1 else 0], ignore)
            if kwargs.get("label_smoothing", 0.0):
                return func(logits.full_tensor(), *args[1:], **kwargs)
            with _loss_parallel():
                out = func(*args, **kwargs)
            if not isinstance(out, DTensor):  # an enclosing mode of this kind already converted it
                return out
            plain = out.to_local() if all(p.is_replicate() for p in out.placements) else out.full_tensor()
            # A copy, not the custom op's output view: user code may add to it in place (transformers'
            # MoE models do `loss += coef * aux_loss`), which autograd forbids on that view.
            return plain.clone()
        return func(*args, **kwargs)


@contextlib.contextmanager
def loss_parallel_step(enabled: bool) -> Generator[None, None, None]:
    """Around a training/validation/test/predict step (or a pipeline's last stage) whose logits may be
    vocab-sharded. Backward needs :func:`loss_parallel_backward`. ``enabled=False`` does nothing."""
    if not enabled:
        yield
        return
    with _CrossEntropyOnShards():
        yield


@contextlib.contextmanager
def loss_parallel_backward(enabled: bool) -> Generator[None, None, None]:
    """Around backward: the loss-parallel kernels' backward must see the same custom ops."""
    if not enabled:
        yield
        return
    with _loss_parallel():
        yield


IGNORE_INDEX = -100  # transformers' (and torch's default) ignored label


def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items: Optional[Tensor] = None) -> Tensor:
    """The transformers causal-LM loss (``ForCausalLMLoss``): labels shifted left by one, ``-100`` ignored, the
    logits in fp32, the sum divided by ``num_items`` (or the mean over the valid tokens). The transformers
    pipeline's loss and the dry run's loss of a model without ``loss_fn`` both run it."""
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = logits.float().view(-1, vocab_size)
    if num_items is None:
        return F.cross_entropy(flat, shift, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(flat, shift, ignore_index=IGNORE_INDEX, reduction="sum") / num_items


__all__ = ["IGNORE_INDEX", "causal_lm_loss", "loss_parallel_backward", "loss_parallel_step"]
