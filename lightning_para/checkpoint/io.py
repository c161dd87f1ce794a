"""Reading and writing Lightning checkpoints for a parallelized model, in place.

:func:`save_checkpoint` writes Lightning's checkpoint dict as a sharded DCP directory (or one
consolidated file), atomically (:mod:`.atomic`); :func:`load_checkpoint_in_place` verifies the
checkpoint and loads either kind, and a plain single-device Lightning checkpoint, into whatever
layout the model has now, strictly unless the module sets ``strict_loading = False``.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_para._dtensor import local_tensor
from lightning_para.checkpoint import atomic, failures, swap
from lightning_para.checkpoint.consolidate import trainer_format, write_file_atomically
from lightning_para.checkpoint.format import (
    METADATA_FILENAME,
    checkpoint_keys,
    flat_keys,
    load_sharded_into,
    save_sharded,
)
from lightning_para.checkpoint.last import warn_if_newer
from lightning_para.checkpoint.model_info import check_model_info
from lightning_para.checkpoint.run import CheckpointRun
from lightning_para.checkpoint.optimizer import OptimParam, init_optimizer_state, load_optimizer_state
from lightning_para.parallel.data.interface import DataParallel
from lightning_para.parallel.pipeline.runner import PipelineRunner


T = TypeVar("T")


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _from_rank0(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, the same value on every rank (so all ranks take the same branch)."""
    if not dist.is_initialized():
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _agree(
    failure: Optional[BaseException], path: Path, partial: Optional[Path], needed_here: int, payload: Any = None
) -> list[Any]:
    """Collective: if any rank failed, rank 0 removes ``partial`` and every rank raises the same error;
    otherwise every rank's ``payload``, in rank order.

    A sync point even when nothing failed (it replaces a barrier), so no rank goes on into the next
    step of the save (or the next collective of training) while another has failed.
    """
    folder = path.parent
    mine = failures.summarize(failure, _rank(), folder, needed_here) if failure is not None else None
    gathered = _gather((mine, needed_here, payload))
    summaries = [s for s, _, _ in gathered if s is not None]
    if not summaries:
        return [p for _, _, p in gathered]
    decided = None
    if _is_rank0():
        removed = partial is not None and (partial.exists() or partial.is_symlink())
        if removed:
            swap.remove_partial(partial)
        newest = atomic.newest_complete_checkpoint(folder) if folder.is_dir() else None
        needed = failures.checkpoint_bytes(newest) or sum(n for _, n, _ in gathered)
        decided = failures.verdict(summaries, path, needed, newest, removed)
    if dist.is_initialized():
        box = [decided]
        dist.broadcast_object_list(box, src=0)
        decided = box[0]
    error = failures.as_error(*decided)
    error.rank_failure = failure  # this rank's own exception, if any (None where another rank failed)
    if isinstance(error, failures.CheckpointDiskFullError):
        # The message names the errno, the ranks and the space; DCP's chained `CheckpointException` (each
        # rank's traceback, e.g. "unexpected pos 704 vs 598") printed above it would only bury it.
        raise error from None
    raise error from failure


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    path: Path,
    checkpoint: dict[str, Any],
    *,
    sharded: bool = True,
    token: Optional[str] = None,
    run: Optional[CheckpointRun] = None,
) -> None:
    """Write Lightning's ``checkpoint`` dict (collective), atomically (see :mod:`.atomic`).

    Model and optimizer states go through DCP, the rest into ``meta.pt``, all into a hidden
    sibling of ``path`` that rank 0 marks complete and swaps into place once every rank has
    written. Each rank checksums the shards it wrote; the marker records every file's CRC-32.
    ``sharded=False``: the dict already holds the full state on rank 0 (:mod:`.full_state`),
    which writes it as one ordinary file beside ``path`` and swaps it into place; the other ranks
    write nothing.
    ``token`` names the sibling (the same on every rank; drawn by rank 0 when not given).
    ``run``: the run this save belongs to (:mod:`.run`): recorded in the checkpoint and its marker; rank 0
    holds the folder for it (:mod:`.lock`) before sweeping it.

    A failure on any rank (a full disk, a locked folder, a write error) makes every rank raise the
    same error (:class:`~.failures.CheckpointDiskFullError`, :class:`~.lock.CheckpointDirectoryLockedError`,
    :class:`~.failures.CheckpointSaveError`) after rank 0 removed the partial save; the checkpoints
    already in the folder are untouched.
    """
    path = Path(path)
    failure: Optional[BaseException] = None
    run = run if run is not None else CheckpointRun()
    recorded = run.record(checkpoint)
    if not sharded:
        if _is_rank0():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with run.holding(path):
                    run.sweep(path)  # leftovers of earlier interrupted saves
                    write_file_atomically(path, checkpoint)  # removes its hidden sibling if it fails
            except failures.SAVE_ERRORS as error:
                failure = error
        # No rank reads `path` (or saves again) before it is in place.
        _agree(failure, path, None, failures.tensor_bytes(checkpoint) if _is_rank0() else 0)
        return
    token = token or _from_rank0(atomic.new_token)
    partial = atomic.partial_path(path, token)
    info = {k: checkpoint.get(k) for k in ("epoch", "global_step")}
    info["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    info.update(recorded)
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    needed = failures.tensor_bytes(tensors)
    with contextlib.ExitStack() as hold:
        if _is_rank0():  # the folder, this run's hold on it, no leftovers, the sibling every rank writes into
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                hold.enter_context(run.holding(path))  # for this save only when outside `fit`
                run.sweep(path, keep=partial)  # leftovers of earlier interrupted saves
                partial.mkdir()
            except failures.SAVE_ERRORS as error:
                failure = error
        _agree(failure, path, partial, needed)
        sums: dict[str, str] = {}
        try:
            sums = save_sharded(partial, tensors, checkpoint)
        except failures.SAVE_ERRORS as error:
            failure = error
        # Every rank's shards (fsynced by DCP), DCP's `.metadata` and `meta.pt` are on disk after this agreement.
        everyone = _agree(failure, path, partial, needed, sums)
        removable: Optional[Path] = partial
        if _is_rank0():
            try:
                atomic.write_marker(partial, info, {k: v for rank_sums in everyone for k, v in rank_sums.items()})
                removable = None  # from here on `partial` may hold the previous checkpoint (exchanged): keep it
                swap.commit(partial, path)
            except failures.SAVE_ERRORS as error:
                failure = error
        _agree(failure, path, removable, needed)  # no rank reads `path` (or saves again) before it is in place


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint (rank 0) without ever leaving a half-deleted one under its name."""
    swap.remove_checkpoint(path)


@torch.no_grad()
def load_full_checkpoint_into(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
    data_parallel: Optional[DataParallel],
    strict: bool = True,
    path: Any = "<checkpoint>",
) -> None:
    """Load an ordinary (consolidated or single-device) Lightning checkpoint into the sharded model."""
    state = checkpoint["state_dict"]
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    check_keys(path, module, missing, unexpected, strict)
    for key, target in own.items():
        if key in state:
            _copy_full_into(target, state[key])
    if data_parallel is not None:
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
                saved = osd["state"].get(pid, {})
                view = views[id(q)]
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
    if data_parallel is not None:
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
        mine = atomic.data_problems(status, sorted(sums)[_rank()::world]) if isinstance(sums, dict) else []
    else:
        mine = atomic.data_problems(status) if _is_rank0() else []
    found = [problem for problems in _gather(mine) for problem in problems]
    if not found:
        return None
    status.problems = found
    return _from_rank0(lambda: atomic.describe_problems(status))


def _unreadable(path: Path, what: str, error: BaseException) -> atomic.IncompleteCheckpointError:
    status = atomic.CheckpointStatus(path, [f"{what} cannot be read ({type(error).__name__}: {error})"])
    return atomic.IncompleteCheckpointError(atomic.describe_problems(status))


def _model_keys_everywhere(wanted: set[str], pipeline: Optional[PipelineRunner]) -> set[str]:
    """The model's keys on every pipeline stage (each rank holds only its stages'): collective over pp."""
    if pipeline is None or not dist.is_initialized():
        return wanted
    gathered: list[Any] = [None] * dist.get_world_size(pipeline.group)
    dist.all_gather_object(gathered, sorted(wanted), group=pipeline.group)
    return {k for keys in gathered for k in keys}


def load_checkpoint_in_place(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    views: Mapping[int, OptimParam],
    data_parallel: Optional[DataParallel] = None,
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
    """
    path = Path(path)
    problem = _from_rank0(lambda: _problem(path))
    if problem is not None:
        kind, message = problem
        raise FileNotFoundError(message) if kind == "missing" else atomic.IncompleteCheckpointError(message)
    corrupt = _data_problem(path)
    if corrupt is not None:
        raise atomic.CorruptCheckpointError(corrupt)
    if _is_rank0():
        warn_if_newer(path)
    if strict is None:
        strict = getattr(module, "strict_loading", True)
    if path.is_dir():
        try:
            meta = torch.load(path / METADATA_FILENAME, weights_only=False)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
            raise _unreadable(path, f"`{METADATA_FILENAME}`", error) from error
        check_model_info(module, meta)  # before any tensor is loaded: what integrations recorded fits this layout
        own = module.state_dict()
        available = {k for k in checkpoint_keys(path) if k.startswith("state_dict.")}
        wanted = flat_keys({"state_dict": own})
        prefix = len("state_dict.")
        missing = sorted(k[prefix:] for k in wanted - available)
        unexpected = sorted(k[prefix:] for k in available - _model_keys_everywhere(wanted, pipeline))
        check_keys(path, module, missing, unexpected, strict)
        load_sharded_into(path, {"state_dict": own})
        if data_parallel is not None and not optimizers:
            data_parallel.reset_masters_from_params()
        for i, optimizer in enumerate(optimizers):
            load_optimizer_state(optimizer, views, path, f"optimizer_{i}", data_parallel)
        return meta
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        raise _unreadable(path, "the file", error) from error
    if convert is not None:
        checkpoint = convert(checkpoint)
    if "optimizer_states" not in checkpoint and "optimizer_0" in checkpoint:
        # Written by Lightning's `python -m lightning.fabric.utilities.consolidate_checkpoint` from a sharded directory.
        checkpoint = trainer_format(checkpoint)
    check_model_info(module, checkpoint)
    if pipeline is not None:
        pipeline.check_full_checkpoint(checkpoint, bool(optimizers))
    load_full_checkpoint_into(checkpoint, module, optimizers, views, data_parallel, strict=strict, path=path)
    return checkpoint


__all__ = ["check_keys", "load_checkpoint_in_place", "load_full_checkpoint_into", "remove_checkpoint", "save_checkpoint"]
