"""Count bytes passed to torch.distributed collectives, apart from the library's own counter.

A ``TorchDispatchMode`` sees every c10d op (``dist.all_reduce`` ... and the ones FSDP2 and
our ZeRO issue) and every functional collective (DTensor / tensor parallel), including those
launched from backward hooks. Volumes follow the usual accounting, which the acceptance
criteria use:

* all-reduce of psi bytes counts 2 psi (reduce-scatter + all-gather);
* reduce-scatter counts its *input*, all-gather its *output* (psi each);
* all-to-all, broadcast, send and recv count the bytes sent.

This file is test-only on purpose: the library's own profiler must not be what checks it. Only the op
table is shared: each op's kind and bytes come from the library's ``classify`` (pinned op by op in
``tests/unit/test_profiling.py``); intercepting, grouping and summing are this file's own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_para.instrument.collectives import classify


class CollectiveCounter(TorchDispatchMode):
    """Use as a context manager; ``bytes_by_kind`` and ``calls`` hold what happened inside."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.calls: list[tuple[str, int, Optional[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.name())
        namespace = name.split("::")[0]
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self._record(name.split("::")[1].split(".")[0], args, kwargs)
        return func(*args, **kwargs)

    def _record(self, op: str, args: tuple, kwargs: dict) -> None:
        counted = classify(op, args)
        if counted is None:
            return
        kind, volume = counted
        group = None
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, str):
                group = a
            elif isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                group = dist.ProcessGroup.unbox(a).group_name  # c10d ops carry the group object
        self.bytes_by_kind[kind] += volume
        self.calls.append((kind, volume, group))

    @property
    def total(self) -> int:
        return sum(self.bytes_by_kind.values())

    def total_of(self, *kinds: str) -> int:
        return sum(self.bytes_by_kind.get(k, 0) for k in kinds)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def nccl_reduce_scatter_path(job: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``job`` (in a worker) with ZeRO-1/2 taking torch's real reduce-scatter and all-gather, the path NCCL takes.

    On gloo, ZeRO-1/2 all-reduce their buckets in place instead (gloo's reduce-scatter is an
    all-reduce inside, plus a clone), which counts as an ``all_reduce`` of 2x the bytes here, and
    gather the updated weights by one broadcast per rank (``layout.GLOO_SHORTCUTS``).
    Tests that check the ZeRO paper's accounting (reduce-scatter psi + all-gather psi, and the
    planner's model of it) run their job through this.
    """
    from lightning_para.parallel.data import layout

    layout.GLOO_SHORTCUTS = False
    try:
        return job(*args, **kwargs)
    finally:
        layout.GLOO_SHORTCUTS = True


def batches_counter(first: int, last: Optional[int] = None) -> Any:
    """A Lightning callback whose ``.counter`` (a :class:`CollectiveCounter`) sees every collective of
    training batches ``first`` to ``last`` (default: ``first`` only), forward, backward and optimizer step."""
    from lightning.pytorch.callbacks import Callback

    class BatchesCounter(Callback):
        def __init__(self) -> None:
            self.counter = CollectiveCounter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == first:
                self.counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == (first if last is None else last):
                self.counter.__exit__(None, None, None)

    return BatchesCounter()
