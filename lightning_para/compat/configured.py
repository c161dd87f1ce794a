"""What the user's ``configure_model`` already parallelized, and what ParaStrategy may add.

Lightning teaches tensor parallelism and FSDP2 inside ``configure_model``:
``parallelize_module(self, self.device_mesh["tensor_parallel"], plan)`` and
``fully_shard(block, mesh=self.device_mesh["data_parallel"])``. A model that arrives at
:func:`~lightning_para.parallelize` that way must not be parallelized a second time:
applying TP again fails (``distribute_module should only be called once``), and ZeRO on top
of the user's FSDP2 reduces every gradient twice, which trains to silently wrong losses.

:func:`detect_user_parallelism` looks at the model as ``configure_model`` left it:

* **FSDP2**: a module is an ``FSDPModule``; the first mesh dim of the parameters it manages
  (FSDP2 puts its shard dim first) must be this strategy's ``dp`` group;
* **tensor parallel**: any other mesh dim of a DTensor parameter; it must be this strategy's
  ``tp`` group (its size is ``tp``).

A mesh dim that is neither (another size, other ranks) is a ``ValueError`` that says which
degrees to set: the data sampler and every collective of the strategy follow its own mesh, so
a model split differently would train on the wrong samples. Combinations the strategy cannot
build on (its own TP after the user's FSDP2, pipeline or expert parallelism on a model the
user already split, ZeRO-1/2 on top of FSDP2) are ``ValueError`` s naming the dimension the
user applied and what to change. Nothing here communicates, so every rank raises the same error
before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_para.config import ParallelConfig
from lightning_para.mesh import ParallelDims


@dataclass(frozen=True)
class UserParallelism:
    """What ``configure_model`` applied; :func:`~lightning_para.parallelize` skips those dimensions."""

    tensor_parallel: bool = False
    fully_sharded: bool = False
    # The outermost modules the user gave ``fully_shard`` (for accumulation without gradient sync).
    fsdp_roots: tuple[nn.Module, ...] = field(default=(), repr=False)

    @property
    def applied(self) -> bool:
        return self.tensor_parallel or self.fully_sharded

    def describe(self) -> str:
        parts = (["tensor parallelism (parallelize_module)"] if self.tensor_parallel else []) + (
            ["FSDP2 (fully_shard)"] if self.fully_sharded else []
        )
        return " and ".join(parts) or "nothing"


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _outermost(modules: list[nn.Module]) -> tuple[nn.Module, ...]:
    inner = {id(child) for m in modules for child in m.modules() if child is not m}
    return tuple(m for m in modules if id(m) not in inner)


def detect_user_parallelism(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> UserParallelism:
    """Classify what ``module`` already is, check it against ``dims``, and reject what cannot compose.

    Raises ``ValueError`` naming the degrees or options to change (see the module docstring).
    """
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    dtensor_params = [(name, p) for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if not fsdp_modules and not dtensor_params:
        return UserParallelism()
    tp_ranks = _ranks(dims.group("tp"))
    dp_ranks = _ranks(dims.group("dp"))
    # FSDP2 puts its data-parallel shard dim first (before any TP dims) on the parameters it manages.
    fsdp_managed = {id(p) for m in fsdp_modules for p in m.parameters()}
    user_tp = False
    for name, p in dtensor_params:
        mesh = p.device_mesh
        for i in range(mesh.ndim):
            if mesh.size(i) == 1:
                continue
            ranks = _ranks(mesh.get_group(i))
            is_fsdp_dim = i == 0 and id(p) in fsdp_managed
            expected, degree, what = (dp_ranks, dims.dp, "data-parallel (fully_shard)") if is_fsdp_dim else (
                tp_ranks, dims.tp, "tensor-parallel")
            if ranks != expected:
                dim_name = (mesh.mesh_dim_names or ("?",) * mesh.ndim)[i]
                raise ValueError(
                    f"configure_model made `{name}` a DTensor over ranks {list(ranks)} (mesh dim {dim_name!r}, size"
                    f" {mesh.size(i)}), which is not ParaStrategy's {what} group {list(expected)} (degree {degree};"
                    f" its tensor-parallel group is {list(tp_ranks)}, tp={dims.tp}, its data-parallel group"
                    f" {list(dp_ranks)}, dp={dims.dp}). Build the meshes from `self.device_mesh['tensor_parallel']` /"
                    " `['data_parallel']` (or 'tp' / 'dp') and set ParaStrategy(tp=..., dp=...) to the degrees"
                    " configure_model uses."
                )
            user_tp = user_tp or not is_fsdp_dim
    user = UserParallelism(
        tensor_parallel=user_tp, fully_sharded=bool(fsdp_modules), fsdp_roots=_outermost(fsdp_modules)
    )
    _check_composable(user, dims, config)
    return user


def _check_composable(user: UserParallelism, dims: ParallelDims, config: ParallelConfig) -> None:
    applied = user.describe()
    if dims.tp_enabled and not user.tensor_parallel and user.fully_sharded:
        raise ValueError(
            f"configure_model applied {applied}, and ParaStrategy(tp={dims.tp}) cannot add tensor parallelism to"
            " parameters FSDP2 already sharded. Apply `parallelize_module(..., self.device_mesh['tensor_parallel'],"
            " plan)` before `fully_shard` in configure_model, or set tp=1."
        )
    if user.tensor_parallel and config.tp_plan is not None:
        raise ValueError(
            f"configure_model applied {applied}, so ParaStrategy(tp_plan=...) would never be used. Remove tp_plan,"
            " or remove parallelize_module from configure_model and let the plan apply."
        )
    if dims.pp_enabled:
        raise ValueError(
            f"configure_model applied {applied}; ParaStrategy(pp={dims.pp}) splits the whole model into stages"
            " first and cannot split a model that is already parallelized. Set pp=1, or let ParaStrategy apply"
            " every dimension (remove the parallelization from configure_model)."
        )
    if dims.ep_enabled:
        raise ValueError(
            f"configure_model applied {applied}; ParaStrategy(ep={dims.ep}) shards experts before data parallelism"
            " and cannot do so on a model that is already parallelized. Set ep=1, or remove the parallelization"
            " from configure_model."
        )
    if user.fully_sharded and config.zero in (1, 2):
        raise ValueError(
            f"configure_model applied {applied}: the data-parallel dimension is already fully sharded (ZeRO-3)."
            f" ParaStrategy(zero={config.zero}) would shard and reduce the gradients a second time. Use zero=0 or"
            " zero=3 (both keep your fully_shard as it is), or remove fully_shard and let ParaStrategy apply ZeRO."
        )
    if user.fully_sharded and config.activation_checkpointing is not None:
        raise ValueError(
            f"configure_model applied {applied}; ParaStrategy(activation_checkpointing=...) wraps blocks before"
            " data parallelism. Apply activation checkpointing in configure_model before fully_shard, or remove"
            " fully_shard."
        )


__all__ = ["UserParallelism", "detect_user_parallelism"]
