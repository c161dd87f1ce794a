"""The fake world a dry run runs in: torch's fake process group, a device module for ``meta``, and the two
lifts that let the real code train on meta tensors (FSDP2's meta check, the vocab-parallel loss's handlers)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # private: FSDP2 on meta, see `fsdp_on_meta`
from torch.distributed.tensor.parallel import loss as _tp_loss  # private: see docs/architecture.md

from lightning_para.instrument.live_bytes import LiveBytes


def start_fake_world(world_size: int, rank: int, gpus_per_node: int = 8) -> None:
    """Start torch's fake process group: ``world_size`` ranks, this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend (no network)

    from torch._C._distributed_c10d import FakeWork  # the fake backend's handle of an async collective

    # A fake collective moves nothing, so it is done when issued; torch's FakeWork says it is not yet
    # (`is_completed()` is False until waited for). Code that frees what is done without waiting (ZeRO-2's
    # "reduce_each_microbatch" settles its buckets so) would otherwise keep every bucket of a backward alive.
    FakeWork.is_completed = lambda self: True  # type: ignore[method-assign]
    if not isinstance(getattr(torch, "meta", None), _MetaDeviceModule):
        torch.meta = _MetaDeviceModule(gpus_per_node)  # type: ignore[attr-defined]
    # The fake backend on the meta device too: the pipeline schedule's sends and receives are batched per device type.
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)


class _MetaDeviceModule:
    """What ``torch.<device type>`` gives for the meta device, which torch has no module for.

    DTensor's cost model asks the mesh's device module for devices per host (a node of
    ``gpus_per_node`` devices here); FSDP2 asks it for the current device and for streams and events,
    which on meta order nothing: CPU's (``torch.cpu``, whose streams are no-ops) stand in for them."""

    def __init__(self, gpus_per_node: int) -> None:
        self._gpus_per_node = gpus_per_node

    def device_count(self) -> int:
        return self._gpus_per_node

    def current_device(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


@contextlib.contextmanager
def count_loss_parallel(live: LiveBytes) -> Any:
    """Count the temporaries of torch's vocab-parallel loss (``loss_parallel``) in ``live``.

    DTensor runs those ops in Python handlers on the local shards while it handles the op, with every dispatch
    mode off: the log-softmax's fp32 copies of the local logits (the input cast, the max-shifted input, its
    exp, the result), 14 bytes per local logit at its peak in bf16, were invisible to the dry run
    (13.7 GiB at tp=2 on an H200, `benchmarks/gpu_fake_world.py --tp 2`). Each handler runs under ``live`` for the
    step; ``loss_parallel()`` copies them into DTensor's table when it is entered, so they are wrapped first."""
    handlers = _tp_loss.customized_loss_ops
    originals = dict(handlers)

    def counted(handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with live:
                return handler(*args, **kwargs)
        return run

    handlers.update({op: counted(handler) for op, handler in originals.items()})
    try:
        yield
    finally:
        handlers.update(originals)


@contextlib.contextmanager
def fsdp_on_meta(live: Optional[LiveBytes] = None) -> Any:
    """Let FSDP2 (ZeRO-3) train on meta parameters, and count its gathered weights.

    FSDP2 refuses meta parameters at its first forward (a real run must materialize them); on meta the
    gathers and reduce-scatters have shapes only, which is all the dry run needs, so that check is lifted.
    FSDP2 allocates and frees the gathered weights by resizing their storages in place
    (``UntypedStorage.resize_``), which no dispatch mode sees: while ``live`` is given, each resize is
    reported to it, so the gathered weights count while they are held."""
    group_cls = _fsdp_param_group.FSDPParamGroup
    validate, resize = getattr(group_cls, "_validate_no_meta_params", None), torch.UntypedStorage.resize_

    def resize_and_count(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        if live is not None:
            live.resized(storage)
        return out

    if validate is not None:  # ZeRO 0-2 do not need it; a torch that renamed it fails ZeRO-3's dry run test
        group_cls._validate_no_meta_params = lambda self: None
    torch.UntypedStorage.resize_ = resize_and_count  # type: ignore[method-assign]
    try:
        yield
    finally:
        if validate is not None:
            group_cls._validate_no_meta_params = validate
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


@contextlib.contextmanager
def uncounted_sharding_propagation() -> Any:
    """Keep DTensor's sharding propagation out of the dry run's counters.

    DTensor learns an op's output shapes by running it on meta stand-ins of the *global* tensors, once per op and
    input shapes (then cached). On a GPU those stand-ins are meta tensors and hold no memory; in the dry run every
    tensor is meta, so the live-bytes counter would take them for allocations (at 405B, 2.5 GiB of global-vocab
    logits at a step's first loss). The propagation runs with the dispatch modes off."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator  # private: see docs/architecture.md
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


__all__ = ["count_loss_parallel", "fsdp_on_meta", "start_fake_world", "uncounted_sharding_propagation"]
