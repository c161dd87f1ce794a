"""The one collective counter: communication per mesh dimension and collective kind, measured while it happens.

Used by the profiler (bus bytes, timed), the dry run (payload bytes, on the fake process group) and the
planner's check (:mod:`lightning_para.instrument.compare`).

:class:`CollectiveCounter` is a ``TorchDispatchMode``: every c10d op (``dist.all_reduce`` ..., the
ones ZeRO and FSDP2 issue from backward hooks, pipeline send/recv) and every functional
collective (DTensor / tensor parallel) passes through it. Each op's process group is mapped
to the name of the mesh dimension it belongs to (``tp``, ``cp``, ``dp``, ``pp``, ``ep``,
``edp``; under hybrid sharding ``dp_shard`` and ``dp_replicate``; with ``cp > 1`` ZeRO's group
``dp_shard_cp``; or ``world`` for the default group), so the counts read "tp all_reduce:
1.2 MB, 3.4 ms" and the bytes that cross nodes (``dp_replicate``, ``pp``) stand apart.

Two byte conventions, both counted for every call and both read from one table of ops (``_OPS``):

* **bus bytes** (``bytes``, :meth:`CollectiveCounter.summary`) follow the ZeRO paper's accounting
  (Rajbhandari et al. 2020, Sec. 7), which the docs' formulas use: an all-reduce of psi bytes counts
  2 psi (reduce-scatter + all-gather), a reduce-scatter its input, an all-gather its output,
  all-to-all / broadcast / send / recv the bytes they pass;
* **payload bytes** (``payload_bytes``, :meth:`CollectiveCounter.payload_figures`): the local tensor a
  rank hands the call (a reduce-scatter's input, an all-to-all's input, the others' first tensor; a
  receive carries the sender's bytes, so point-to-point counts once, as ``send_recv``), which is what
  the planner's ``Collective.payload`` prices per call.

Time, when ``time_collectives`` is on, is measured by *waiting* for each collective right
after issuing it (and synchronising the device), so it is the collective's own duration,
not its exposed time: the tracer serialises communication that would otherwise overlap.
Point-to-point ops are never waited on (two neighbours that both receive first would
deadlock), so pipeline send/recv report bytes only; the pipeline's idle time shows their cost.

The mode only runs on the steps it is entered for, so profiling costs nothing on others.

A collective can name a process group the mesh does not list but that joins the same ranks:
DTensor's redistributions resolve a group by its ranks and may get an older group over the
same ranks (e.g. one a previous layout in the same processes created). Such a group is
labelled by its ranks, so its bytes still count for the right dimension.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from lightning_para.instrument.records import CommFigure
from lightning_para.spec.dims import DIM, planner_label

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group  # private: see docs/architecture.md
from torch.utils._python_dispatch import TorchDispatchMode  # private: see docs/architecture.md

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_P2P = {"send", "recv"}

# The one table of collective ops, by schema name: ``(kind, the argument whose bytes the bus convention counts, the
# tensor the payload convention counts: an index into the call's tensors in order, None where it counts none)``, or
# ``None`` for bookkeeping. Bus bytes: an all-reduce counts its argument twice, an all-gather given a group size (the
# functional ones) its input times that. Payload kind: the bus kind, but a send is a ``send_recv`` (a receive carries
# the sender's bytes: counted once, sent).
_OPS: dict[str, Optional[tuple[str, int, Optional[int]]]] = {
    # c10d: what torch.distributed's calls reach through the dispatcher
    "allreduce_": ("all_reduce", 0, 0), "allreduce_coalesced_": ("all_reduce", 0, None),
    "_reduce_scatter_base_": ("reduce_scatter", 1, -1), "reduce_scatter_": ("reduce_scatter", 1, -1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, -1), "_allgather_base_": ("all_gather", 0, 0),
    "allgather_": ("all_gather", 0, 0), "allgather_coalesced_": ("all_gather", 0, None),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 0), "alltoall_base_": ("all_to_all", 1, 1),
    "alltoall_": ("all_to_all", 0, None), "broadcast_": ("broadcast", 0, 0), "send": ("send", 0, 0),
    "recv_": ("recv", 0, None), "recv_any_source_": ("recv", 0, None), "reduce_": ("reduce", 0, None),
    "scatter_": ("scatter", 0, None), "gather_": ("gather", 0, None), "barrier": None, "monitored_barrier_": None,
    # functional collectives (DTensor's)
    "all_reduce": ("all_reduce", 0, 0), "all_reduce_": ("all_reduce", 0, None),
    "all_reduce_coalesced": ("all_reduce", 0, None), "all_reduce_coalesced_": ("all_reduce", 0, None),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "all_gather_into_tensor": ("all_gather", 0, 0), "all_gather_into_tensor_coalesced": ("all_gather", 0, None),
    "all_to_all_single": ("all_to_all", 0, 0), "broadcast": ("broadcast", 0, 0), "wait_tensor": None,
    "_wrap_tensor_autograd": None,
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def group_labels(mesh: Any, planner: bool = False) -> dict[str, str]:
    """Process-group name -> dimension name, in the dimension table's priority (a group two names share takes the
    plainer); the groups of one rank after the others (their collectives, e.g. ZeRO over dp=1, move nothing).

    ``mesh`` is a :class:`~lightning_para.mesh.ParallelDims` (preferred: it keeps the flattened ``dp`` mesh itself,
    which torch asks callers to do instead of slicing it from the root) or a ``DeviceMesh`` with named dims.
    ``planner``: the planner's names (the dry run's record: ``dp_shard_cp`` / ``edp_cp`` are its ``dp`` / ``edp``,
    :func:`~lightning_para.spec.dims.planner_label`), groups of one rank left out.
    """
    labels: dict[str, str] = {}
    if mesh is not None:
        sub_mesh = getattr(mesh, "get_mesh", None) or mesh.__getitem__
        subs = []
        for dim in DIM:
            try:
                subs.append((planner_label(dim) if planner else dim, sub_mesh(dim)))
            except (KeyError, RuntimeError, ValueError):
                continue
        for label, sub in sorted(subs, key=lambda item: item[1].size() <= 1):
            if label and (not planner or sub.size() > 1):
                labels.setdefault(sub.get_group().group_name, label)
    if dist.is_initialized():
        labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels


def classify(op: str, args: tuple) -> Optional[tuple[str, int]]:
    """``(kind, bus bytes)`` of collective ``op`` (its schema name, e.g. ``allreduce_``) called with ``args``, or
    ``None`` for bookkeeping; an op the table does not know counts its first argument, under its own name."""
    if op not in _OPS:
        return op.rstrip("_"), _nbytes(args[0]) if args else 0
    entry = _OPS[op]
    if entry is None:
        return None
    kind, arg, _ = entry
    group_size = args[1] if kind == "all_gather" and len(args) > 1 and isinstance(args[1], int) else 1
    return kind, (2 if kind == "all_reduce" else group_size) * _nbytes(args[arg])


def payload(op: str, args: tuple, kwargs: dict) -> Optional[tuple[str, int]]:
    """``(kind, bytes)`` of the local tensor a rank hands collective ``op`` (its schema name), or ``None`` if the
    payload convention does not count it (see the module docstring)."""
    entry = _OPS.get(op)
    if entry is None or entry[2] is None:
        return None
    kind, _, index = entry
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return ("send_recv" if kind == "send" else kind), _nbytes(tensors[index:index + 1 or None])


@dataclass
class CommStat:
    """Calls of one kind over one dimension: bus bytes, payload bytes and (when timed) seconds."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    timed: bool = False


class CollectiveCounter(TorchDispatchMode):
    """Counts (and optionally times) collectives per ``(mesh dim, kind)`` while active: bus bytes in
    :attr:`stats` and payload bytes in :attr:`payload` (see the module docstring).

    Args:
        labels: process-group name -> dimension name (see :func:`group_labels`).
        time_collectives: wait for each collective to measure its duration (see module doc).
    """

    def __init__(self, labels: dict[str, str], time_collectives: bool = True) -> None:
        super().__init__()
        self.labels = dict(labels)
        self.time_collectives = time_collectives
        self.stats: dict[tuple[str, str], CommStat] = defaultdict(CommStat)
        self.payload: dict[tuple[str, str], CommStat] = defaultdict(CommStat)
        # Rank set -> dimension, in the labels' priority order, for groups the mesh does not name.
        self._by_ranks: dict[tuple[int, ...], str] = {}
        for name, dim in self.labels.items():
            ranks = _group_ranks(name)
            if ranks is not None:
                self._by_ranks.setdefault(ranks, dim)

    def reset(self) -> None:
        self.stats = defaultdict(CommStat)
        self.payload = defaultdict(CommStat)

    def _label(self, args: tuple, kwargs: dict) -> str:
        for a in list(args) + list(kwargs.values()):
            name = None
            if isinstance(a, str):
                name = a
            elif isinstance(a, torch.ScriptObject):
                try:
                    name = dist.ProcessGroup.unbox(a).group_name
                except (RuntimeError, TypeError):
                    continue
            if name is not None and name in self.labels:
                return self.labels[name]
            ranks = _group_ranks(name) if name is not None else None
            if ranks in self._by_ranks:
                self.labels[name] = self._by_ranks[ranks]  # type: ignore[index]
                return self.labels[name]  # type: ignore[index]
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, rest = str(func.name()).partition("::")
        if namespace not in _COLLECTIVE_NAMESPACES:
            return func(*args, **kwargs)
        op = rest.split(".")[0]
        info = classify(op, args)
        if info is None:
            return func(*args, **kwargs)
        kind, volume = info
        timed = self.time_collectives and kind not in _P2P
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if timed:
            _wait(out, namespace, args)
        label = self._label(args, kwargs)
        stat = self.stats[(label, kind)]
        stat.calls += 1
        stat.bytes += volume
        sent = payload(op, args, kwargs)
        if sent is not None:
            entry = self.payload[(label, sent[0])]
            entry.calls += 1
            entry.bytes += sent[1]
        if timed:
            stat.seconds += time.perf_counter() - start
            stat.timed = True
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"tp/all_reduce": {"calls", "bytes", "seconds"}, ...}`` (seconds only where timed)."""
        out = {}
        for (dim, kind), s in sorted(self.stats.items()):
            entry = {"calls": float(s.calls), "bytes": float(s.bytes)}
            if s.timed:
                entry["seconds"] = s.seconds
            out[f"{dim}/{kind}"] = entry
        return out

    def payload_figures(self) -> list[CommFigure]:
        """Calls and payload bytes per ``(dimension, kind)``, sorted (the dry run's record)."""
        return [CommFigure(dim, kind, int(s.calls), float(s.bytes)) for (dim, kind), s in sorted(self.payload.items())]


def _group_ranks(group_name: str) -> Optional[tuple[int, ...]]:
    """The global ranks of the process group called ``group_name`` (``None`` if there is none)."""
    if not dist.is_initialized():
        return None
    try:
        return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    except (RuntimeError, ValueError, KeyError):
        return None


def _wait(out: Any, namespace: str, args: tuple) -> None:
    if namespace != "c10d":
        if isinstance(out, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(out)  # private: see docs/architecture.md
        elif isinstance(out, (list, tuple)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor(t)  # private: see docs/architecture.md
    else:
        works = out[1:] if isinstance(out, tuple) else (out,)
        for w in works:
            if isinstance(w, torch.ScriptObject):
                try:
                    dist.Work.unbox(w).wait()
                except (RuntimeError, TypeError):
                    pass
    device = _device_of(args)
    if device is not None and device.type != "cpu":
        torch.accelerator.synchronize(device)


def _device_of(value: Any) -> Optional[torch.device]:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        for v in value:
            d = _device_of(v)
            if d is not None:
                return d
    return None
