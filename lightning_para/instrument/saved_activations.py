"""The saved-activation meter: live and peak bytes of the tensors autograd saves for backward, parameters excluded.

It counts what a ``saved_tensors_hooks`` pack hook sees, not every storage a step creates (that is
:class:`~lightning_para.instrument.live_bytes.LiveBytes`, the dry run's counter): the activation memory a schedule
holds for backward, which ``pipeline_stats().peak_saved_activation_bytes`` reports when the pipeline runner's
``measure_activations`` is on (the core engine gives the runner this meter) and the context-parallel tests read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_para._dtensor import local_tensor
from lightning_para.memory import storage_pointer as _storage_key


class SavedActivationMeter:
    """Live and peak bytes of the tensors autograd saves for backward, parameters excluded.

    A ``saved_tensors_hooks`` pack hook counts each saved storage once (views of one storage
    share it) and a finalizer uncounts it when autograd frees the graph after backward, so
    ``peak_bytes`` is the high-water mark of activation memory kept for backward.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {_storage_key(local_tensor(t, allow_partial=True)) for t in exclude}
        self._counts: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks: Optional[Any] = None

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _pack(self, tensor: Tensor) -> Any:
        local = local_tensor(tensor, allow_partial=True)
        key = _storage_key(local)
        if key in self._excluded or local.device.type == "meta":
            return tensor
        return _SavedTensor(self, tensor, key, local.untyped_storage().nbytes())

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _SavedTensor) else packed

    def _acquire(self, key: int, nbytes: int) -> None:
        count = self._counts.get(key, 0)
        if count == 0:
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._counts[key] = count + 1

    def _release(self, key: int) -> None:
        count = self._counts[key] - 1
        if count == 0:
            del self._counts[key]
            self.live_bytes -= self._sizes.pop(key)
        else:
            self._counts[key] = count


class _SavedTensor:
    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: SavedActivationMeter, tensor: Tensor, key: int, nbytes: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key
        meter._acquire(key, nbytes)

    def __del__(self) -> None:
        self.meter._release(self.key)


__all__ = ["SavedActivationMeter"]
