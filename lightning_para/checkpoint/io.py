"""Reading Lightning checkpoints into a parallelized model, in place.

:func:`load_checkpoint_in_place` verifies the checkpoint and loads a sharded DCP directory, a consolidated file
or a plain single-device Lightning checkpoint into whatever layout the model has now, strictly unless the module
sets ``strict_loading = False``. Writing is :mod:`.save`'s.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_para._dtensor import local_tensor
from lightning_para.checkpoint import atomic
from lightning_para.checkpoint.consolidate import consolidate_checkpoint, trainer_format
from lightning_para.checkpoint.format import (
    METADATA_FILENAME, ROW_ORDER_KEY, checkpoint_keys, flat_keys, load_sharded_into,
)
from lightning_para.checkpoint.last import warn_if_newer
from lightning_para.checkpoint.optimizer import OptimParam, init_optimizer_state, load_optimizer_state
from lightning_para.checkpoint.save import from_rank0, gather, is_rank0, rank
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.parallel.pipeline.runner import PipelineRunner
from lightning_para.parallel.tensor.columns import rank_major_rows, reorder_named, reorder_rows


@torch.no_grad()
def load_full_checkpoint_into(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
    data_parallel: DataParallel,
    strict: bool = True,
    path: Any = "<checkpoint>",
) -> None:
    """Load an ordinary (consolidated or single-device) Lightning checkpoint into the sharded model; its
    tensors are in the model's own row order, put in tp's rank-major order where this layout stores them so."""
    rows = rank_major_rows(module)
    state = reorder_named(checkpoint["state_dict"], rows, to_model=False)
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    check_keys(path, module, missing, unexpected, strict)
    for key, target in own.items():
        if key in state:
            _copy_full_into(target, state[key])
    for slot in data_parallel.optimizer_slots():
        if slot.name in state:
            slot.load_master(_local_of_full(slot.param, state[slot.name]))
    for optimizer, osd in zip(optimizers, checkpoint.get("optimizer_states", [])):
        init_optimizer_state(optimizer, data_parallel)
        for group, saved_group in zip(optimizer.param_groups, osd["param_groups"]):
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
            for q, pid in zip(group["params"], saved_group["params"]):
                view = views[id(q)]
                saved = osd["state"].get(pid, {})
                if view.fqn in rows:
                    saved = reorder_rows(saved, rows[view.fqn], to_model=False, name=f"the optimizer state of {view.fqn!r}")
                for key, value in saved.items():
                    current = optimizer.state[q].get(key)
                    if isinstance(value, Tensor) and isinstance(current, Tensor) and current.dim() > 0:
                        local = _local_of_full(view.slot.param if view.slot else q, value)
                        if view.slot is not None and view.slot.sharded:
                            local = view.slot.local_rows(local)
                        local_tensor(current).copy_(local.reshape(local_tensor(current).shape))
                    elif isinstance(value, Tensor) and isinstance(current, Tensor):
                        current.copy_(value)
                    else:
                        optimizer.state[q][key] = value
    data_parallel.gather_params()


def _local_of_full(param: Tensor, full: Tensor) -> Tensor:
    """This rank's piece of a full tensor, laid out like ``param`` (plain, TP or FSDP DTensor)."""
    if isinstance(param, DTensor):
        full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
        # Every rank holds the full tensor already: split locally, no communication. This covers FSDP2's
        # shards of a tensor-parallel shard too (`_StridedShard` over dp on the joint (dp, tp) mesh).
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full.to(param.dtype)


def _copy_full_into(target: Tensor, full: Tensor) -> None:
    local_tensor(target).copy_(_local_of_full(target, full).view(local_tensor(target).shape))


def _first(keys: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_keys(path: Any, module: nn.Module, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> None:
    """Lightning's ``strict=True`` contract: raise listing up to 10 missing and 10 unexpected keys.

    Collective when distributed: every rank raises the same error (the union of what each rank
    found), so no rank goes on into the optimizer load's collectives while another has failed.
    """
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sorted(missing), sorted(unexpected)))
        missing = sorted({k for m, _ in gathered for k in m})
        unexpected = sorted({k for _, u in gathered for k in u})
    if not strict or not (missing or unexpected):
        return
    parts = []
    if unexpected:
        parts.append(f"Unexpected key(s) in the checkpoint ({len(unexpected)}): {_first(list(unexpected))}")
    if missing:
        parts.append(f"Missing key(s) in the checkpoint ({len(missing)}): {_first(list(missing))}")
    raise RuntimeError(
        f"Error(s) in loading the checkpoint {str(path)!r} into {type(module).__name__} (strict loading). "
        + ". ".join(parts)
        + ". The checkpoint was written for a different model. To load only the entries that match, set"
        " `self.strict_loading = False` in the LightningModule."
    )


def _problem(path: Path) -> Optional[tuple[str, str]]:
    """Rank 0's verdict on ``path``: ``None`` if loadable, else the error class name and message."""
    status = atomic.checkpoint_problems(path)
    if status.complete:
        return None
    kind = "missing" if not path.exists() else "incomplete"
    return kind, atomic.describe_problems(status)


def _data_problem(path: Path) -> Optional[str]:
    """Collective: every rank reads a share of the files against the checksums written at save
    (a single file: rank 0, against its zip records' CRC-32s); rank 0 words the agreed verdict."""
    status = atomic.checkpoint_problems(path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if path.is_dir():
        sums = (status.marker or {}).get("checksums")
        mine = atomic.data_problems(status, sorted(sums)[rank()::world]) if isinstance(sums, dict) else []
    else:
        mine = atomic.data_problems(status) if is_rank0() else []
    found = [problem for problems in gather(mine) for problem in problems]
    if not found:
        return None
    status.problems = found
    return from_rank0(lambda: atomic.describe_problems(status))


def _unreadable(path: Path, what: str, error: BaseException) -> atomic.IncompleteCheckpointError:
    status = atomic.CheckpointStatus(path, [f"{what} cannot be read ({type(error).__name__}: {error})"])
    return atomic.IncompleteCheckpointError(atomic.describe_problems(status))


def _over_stages(value: Any, pipeline: Optional[PipelineRunner]) -> list[Any]:
    """Every pipeline stage's ``value`` (each rank holds only its stages'): collective over pp."""
    return [value] if pipeline is None else gather(value, pipeline.group)


def stored_row_orders(module: nn.Module, pipeline: Optional[PipelineRunner] = None) -> dict[str, Any]:
    """What a sharded save records under :data:`~.format.ROW_ORDER_KEY`: every stage's parameters whose shards
    hold tp's rank-major rows (collective over pp)."""
    return {k: v for part in _over_stages(rank_major_rows(module), pipeline) for k, v in part.items()}


def _rows_moved(meta: Mapping[str, Any], module: nn.Module, own: Mapping[str, Any]) -> bool:
    """Whether a sharded checkpoint's rows are in another order than this layout's (every rank agrees).
    Written before the order was recorded (no key): assumed this layout's, as such checkpoints were loaded."""
    saved, now = meta.get(ROW_ORDER_KEY), rank_major_rows(module)
    if saved is None:
        _check_unrecorded_rows(meta, now)
    return any(gather(saved is not None and any(saved.get(k) != now.get(k) for k in own)))


def _check_unrecorded_rows(meta: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Before the row order was recorded, LitGPT models kept their grouped-query tp in their model record
    (``litgpt_models``: ``qkv_rank_major_tp``, 0 for the model's own order); at another tp the rows would land
    in the wrong places silently, so such a checkpoint loads at the tp it was saved with only."""
    legacy = {int(entry.get("qkv_rank_major_tp", 0)) for entry in (meta.get("litgpt_models") or {}).values()}
    running = {tp for _, tp in now.values()} or {0}
    if legacy and legacy != running:
        saved = max(legacy)
        raise ValueError(
            f"This checkpoint was written before lightning-para recorded fused projections' row order; its LitGPT"
            f" grouped-query `qkv` rows are in {f'tp={saved}' if saved else 'one device'}'s order, this run's in"
            f" {f'tp={max(running)}' if max(running) else 'one device'}'s. Resume with tp={max(saved, 1)}, then save"
            " again (new checkpoints load at any tp)."
        )


def _load_sharded(
    path: Path, module: nn.Module, own: dict[str, Any], optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam], data_parallel: DataParallel, pipeline: Optional[PipelineRunner], strict: bool,
) -> None:
    """A sharded DCP folder into ``own`` (``module.state_dict()``) and ``optimizers``, resharded by DCP."""
    available = {k for k in checkpoint_keys(path) if k.startswith("state_dict.")}
    wanted = flat_keys({"state_dict": own})
    prefix = len("state_dict.")
    missing = sorted(k[prefix:] for k in wanted - available)
    unexpected = sorted(k[prefix:] for k in available - {k for part in _over_stages(wanted, pipeline) for k in part})
    check_keys(path, module, missing, unexpected, strict)
    load_sharded_into(path, {"state_dict": own})
    if not optimizers:
        data_parallel.reset_masters_from_params()
    for i, optimizer in enumerate(optimizers):
        load_optimizer_state(optimizer, views, path, f"optimizer_{i}", data_parallel)


def load_checkpoint_in_place(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
    data_parallel: DataParallel,
    pipeline: Optional[PipelineRunner] = None,
    strict: Optional[bool] = None,
    convert: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
) -> dict[str, Any]:
    """What ``ParaStrategy.load_checkpoint`` does: load ``path`` into ``module`` and ``optimizers``
    in place and return the non-tensor part of the checkpoint.

    ``path`` is a sharded DCP folder (any layout: DCP reshards on load) or a single full file
    (``save_distributed_checkpoint=False``, or a plain Lightning checkpoint). ``views`` are
    :func:`optimizer_params`. With no optimizers (validate/predict), ZeRO masters follow the
    loaded weights.

    Rank 0 verifies the checkpoint first (completion marker, every file at its written size),
    then every rank reads a share of the files against the checksums written at save: every rank
    raises ``FileNotFoundError``, :class:`~.atomic.IncompleteCheckpointError` or
    :class:`~.atomic.CorruptCheckpointError` naming the path, the file and what is wrong, and the
    newest complete (and verified) checkpoint in the same folder.
    Missing and unexpected model keys raise unless ``strict`` (default: ``module.strict_loading``) is ``False``.
    ``convert`` turns a single file written in another front end's layout (Fabric's ``{"model": ...,
    "optimizer": ...}``) into Lightning's (``state_dict``, ``optimizer_states``) before it is loaded.
    Rows of a fused projection this layout stores rank-major (:func:`~.columns.rank_major_rows`) are put in its
    order: a single file holds the model's own order; a sharded folder saved under another tp is read whole.
    """
    path = Path(path)
    problem = from_rank0(lambda: _problem(path))
    if problem is not None:
        kind, message = problem
        raise FileNotFoundError(message) if kind == "missing" else atomic.IncompleteCheckpointError(message)
    corrupt = _data_problem(path)
    if corrupt is not None:
        raise atomic.CorruptCheckpointError(corrupt)
    if is_rank0():
        warn_if_newer(path)
    if strict is None:
        strict = getattr(module, "strict_loading", True)
    if path.is_dir():
        try:
            meta = torch.load(path / METADATA_FILENAME, weights_only=False)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
            raise _unreadable(path, f"`{METADATA_FILENAME}`", error) from error
        own = module.state_dict()
        if not _rows_moved(meta, module, own):
            _load_sharded(path, module, own, optimizers, views, data_parallel, pipeline, strict)
            meta.pop(ROW_ORDER_KEY, None)  # the checkpoint's own record, not the user's state (fabric.load returns the rest)
            return meta
        if pipeline is not None and optimizers:  # a whole file's optimizer state has no pipeline stage to go to
            saved = sorted({tp for _, tp in (meta.get(ROW_ORDER_KEY) or {}).values()}) or [1]
            raise ValueError(
                f"`{path}` holds fused projections' rows in tp={saved[0]}'s order, not this layout's; a pipeline-parallel"
                f" run resumes optimizer state from a sharded checkpoint of its own tp only. Resume with tp={saved[0]}."
            )
        # Saved under another tp's rank-major rows: read whole (every rank), in the model's order, then this layout's.
        checkpoint = consolidate_checkpoint(path)
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
            raise _unreadable(path, "the file", error) from error
        if convert is not None:
            checkpoint = convert(checkpoint)
        if "optimizer_states" not in checkpoint and "optimizer_0" in checkpoint:
            # Written by Lightning's `python -m lightning.fabric.utilities.consolidate_checkpoint` from a sharded directory.
            checkpoint = trainer_format(checkpoint)
    if pipeline is not None:
        pipeline.check_full_checkpoint(checkpoint, bool(optimizers))
    load_full_checkpoint_into(checkpoint, module, optimizers, views, data_parallel, strict=strict, path=path)
    return checkpoint


__all__ = ["check_keys", "load_checkpoint_in_place", "load_full_checkpoint_into", "stored_row_orders"]
