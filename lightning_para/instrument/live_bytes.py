"""The one live-bytes counter: storages created while it is active and still alive, their peak, and the
allocation trace the caching-allocator model replays (:mod:`lightning_para.simulate.allocator` fills it). Used by the dry run
(:mod:`lightning_para.simulate`), which counts the states a rank holds with :func:`lightning_para.memory.measure_states`
and this module's :func:`storage_key`.

Storages are told apart by their StorageImpl (meta tensors all have ``data_ptr() == 0``), and a DTensor counts
its local shard (its wrapper's storage has the global size)."""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # private: see docs/architecture.md



class AllocationLog(Protocol):
    """Where the counter writes every allocation and free in order (the dry run's ``AllocationTrace``)."""

    def mark(self, name: str) -> None: ...

    def alloc(self, key: Any, nbytes: int, stream: Any = 0) -> None: ...

    def free(self, key: Any, nbytes: int) -> None: ...


def storage_key(t: Tensor) -> int:
    # Meta tensors all have data_ptr 0: tell storages apart by their StorageImpl instead.
    return t.untyped_storage()._cdata  # private: the only identity a meta storage has




def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard (the tensor that holds its memory); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode and still alive; and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self._total = 0  # sum(self.live.values()), kept as they change: read after every operator
        self.peak = 0
        self.exclude: set[int] = set()  # storages that existed before (weights, states): not activations
        self.forward_peak = 0  # the peak when the forwards are done (set by the dry run's step)
        self.trace: Optional[AllocationLog] = None  # every allocation and free in order, when set

    def mark(self, name: str) -> None:
        """A point of the step the allocator model needs (:class:`AllocationLog`)."""
        if self.trace is not None:
            self.trace.mark(name)

    def _release(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self._total -= nbytes
        if self.trace is not None and nbytes:
            self.trace.free(key, nbytes)

    def _hold(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` at its size now, until it is freed."""
        key = storage._cdata  # private: see storage_key
        if key not in self.live:
            weakref.finalize(storage, self._release, key)
        nbytes = storage.nbytes()
        if self.trace is not None:  # a resize (FSDP2's gathered weights) frees the old size and takes the new
            if self.live.get(key):
                self.trace.free(key, self.live[key])
            if nbytes:
                # FSDP2 gathers and reduce-scatters on streams of its own, whose cached blocks a GPU keeps apart;
                # on meta the device module's streams are CPU's, which still say which one is current.
                self.trace.alloc(key, nbytes, id(torch.cpu.current_stream()))
        self._total += nbytes - self.live.get(key, 0)
        self.live[key] = nbytes

    def track(self, t: Tensor) -> None:
        """Count ``t``'s storage (its local shard's) if it is not yet counted and not excluded."""
        t = local_shard(t)
        if t.is_sparse:
            return
        storage = t.untyped_storage()
        if storage._cdata not in self.live and storage._cdata not in self.exclude:
            self._hold(storage)
            self.peak = max(self.peak, self.current)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place (FSDP2's gathered weights): count its new size."""
        if storage._cdata not in self.exclude:
            self._hold(storage)
            self.peak = max(self.peak, self.current)

    def held_by(self, tensors: Any) -> int:
        """Live bytes of the distinct storages of ``tensors`` (their local shards') that this mode counts."""
        keys = {storage_key(local_shard(t)) for t in tensors}
        return sum(self.live.get(key, 0) for key in keys)

    @property
    def current(self) -> int:
        return self._total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: only new storages are allocations.
        # A DTensor is a wrapper whose storage has the *global* size; the memory is its local shard's
        # (counting the wrappers would make sequence-parallel activations and the vocab-parallel
        # log-softmax look t times larger).
        inputs = {storage_key(local_shard(t)) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and not t.is_sparse:
                storage = local_shard(t).untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in inputs:
                    self._hold(storage)
        self.peak = max(self.peak, self.current)
        return out



__all__ = ["LiveBytes", "local_shard", "storage_key"]
