"""ZeRO stage 3 on FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are all sharded over ``dp``: 16/N bytes/param with
Adam and mixed precision. Each *unit* (a module given its own ``fully_shard``) all-gathers its
parameters before its forward, frees them after, gathers again for its backward and
reduce-scatters its gradients: psi + psi + psi = 3 psi per step (ZeRO paper, Sec. 7.2.3).

Unit choice for an arbitrary LightningModule (:func:`choose_units`):

* every entry of an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` (the blocks),
* every other parameter-holding child that is not such a container (embedding, final norm,
  head), descending through plain wrapper modules,
* modules that share parameters only among themselves (a tied embedding and head) together, as
  one grouped unit that manages the shared table once (with every module that holds it); a
  parameter the root or a wrapper of the blocks holds directly, or a module reachable under two
  names, stays with the root.

The root is the LightningModule itself; :class:`~lightning_para.ParaStrategy` runs
``training_step`` *through* the root's ``__call__`` so FSDP2's root hooks run. The root
keeps FSDP2's own rule (not resharded after forward: backward needs it at once).

How the modules outside the blocks are sharded (``unit_choice``, ParaStrategy's ``zero3_units``):

* ``"blocks_and_ends"`` (torchtitan's choice): the embedding, and the final norm and head, are
  units of their own. Least memory: the embedding is sharded again right after its forward.
* ``"blocks"`` (the collectives of Lightning's FSDP2 recipe): the embedding, final norm and head
  are *one* grouped unit (``fully_shard([embedding, norm, head])``), gathered once when the
  embedding runs and kept until backward, reduce-scattered once. Two collectives fewer per step
  for the same bytes, at the price of holding the embedding gathered through the step.
  Lightning's recipe leaves these modules in the root instead; ParaStrategy runs
  ``training_step`` through the root, and a root whose forward is entered again inside it
  (``self(x)``) is resharded by FSDP2 when the outer call returns and gathered a second time in
  backward, so the root is kept free of parameters wherever it can be.
* ``"auto"`` (default): ``"blocks"`` when the parameters outside the blocks are no more than the
  largest block (then the grouped unit holds at most one block's worth more while gathered, and
  each collective saved is a latency saved), else ``"blocks_and_ends"``.

When each unit reshards and gathers (:func:`apply_fully_shard`):

* blocks reshard after forward and are gathered again in backward (3 psi for them), with
  FSDP2's backward prefetch (the next unit's all-gather overlaps this unit's backward);
* the unit that runs **last in forward** (the head) and the **last block** are *not* resharded
  after forward: backward starts with them, so resharding would only free memory to gather it
  straight back (2 psi for each; torchtitan keeps its last block too). An expert unit inside
  the last block is resharded as usual;
* a unit holding only **embeddings** is resharded after forward and *not* gathered in
  backward: an embedding's gradient needs the token ids, not the table (2 psi for it);
* under ``"blocks"`` the grouped unit holds the head, so it is the one kept gathered (2 psi);
  so is the grouped unit of a tied embedding and head under ``"blocks_and_ends"``;
* the root (only parameters it or a wrapper holds directly, normally none) keeps FSDP2's own
  rule, but is gathered again in backward when ``training_step`` calls ``self(x)`` (see ``"blocks"``).

So under either unit choice a step moves ``3 psi - psi_head - psi_embedding - psi_last_block``,
never more than the ZeRO paper's 3 psi, and ``psi_last_block`` less than Lightning's
``configure_model`` recipe (blocks plus a root holding embedding and head: 3 psi of blocks + 2 psi
of the rest). The planner prices the same (``plan/shape.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_para._dtensor import local_tensor, parameter_owners
from lightning_para.spec.options import ZERO3_UNITS

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())



# One `fully_shard` call: a module, or several modules that share one all-gather and one
# reduce-scatter (FSDP2's grouped modules, `fully_shard([a, b])`).
Unit = Union[nn.Module, list[nn.Module]]


def choose_units(
    root: nn.Module, expert_units: Sequence[nn.Module] = (), units: str = "blocks_and_ends"
) -> list[Unit]:
    """The units of ``root`` that get their own ``fully_shard``, children before parents.

    ``expert_units`` (expert stacks) come first: they shard over the expert-data-parallel mesh,
    not over all of dp, so each must be a unit of its own, inside its block's unit.
    ``units`` says how the modules outside the blocks (embedding, final norm, head) are sharded
    (module docstring): each its own unit (``"blocks_and_ends"``), or all of them one grouped unit,
    the last entry (``"blocks"``); ``"auto"`` decides by their size against the largest block.
    """
    return _choose_units(root, expert_units, units)[0]


def _choose_units(
    root: nn.Module, expert_units: Sequence[nn.Module], units: str
) -> tuple[list[Unit], list[nn.Module]]:
    """:func:`choose_units`, and the blocks among them in forward order (entries of containers)."""
    if units not in ZERO3_UNITS:
        raise ValueError(f"`zero3_units={units!r}` is unknown. Choose one of {', '.join(map(repr, ZERO3_UNITS))}.")
    owners = {pid: {fqn for fqn, _ in held} for pid, held in parameter_owners(root).items()}
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    blocks: list[nn.Module] = []
    ends: list[nn.Module] = []
    chosen: list[Unit] = []  # in the order found: children before the wrappers around them

    def self_contained(module: nn.Module) -> bool:
        prefix = names[id(module)]
        for p in module.parameters():
            for owner in owners[id(p)]:
                if not (owner == prefix or owner.startswith(prefix + ".") or prefix == ""):
                    return False
        return True

    def add(module: nn.Module, is_block: bool) -> None:
        (blocks if is_block else ends).append(module)
        chosen.append(module)

    def visit(module: nn.Module) -> None:
        in_container = isinstance(module, _CONTAINERS)
        for child in module.children():
            if not _has_params(child):
                continue
            if isinstance(child, _CONTAINERS):
                visit(child)
            elif any(isinstance(m, _CONTAINERS) for m in child.modules()) and _has_params_in_containers(child):
                visit(child)  # a wrapper around blocks, e.g. `self.transformer`
                if any(True for _ in child.parameters(recurse=False)) and self_contained(child):
                    add(child, is_block=False)
            elif self_contained(child):
                add(child, is_block=in_container)
            else:
                if any(True for _ in child.parameters(recurse=False)):
                    shared_holders.append(child)  # e.g. an embedding whose table the head reuses
                visit(child)

    shared_holders: list[nn.Module] = []
    visit(root)
    tied = _tied_groups(shared_holders, owners, names)
    if units == "auto":
        units = "blocks" if blocks and _ends_fit_in_a_block(root, blocks) else "blocks_and_ends"
    if units == "blocks" and len(ends) + sum(map(len, tied)) > 1:
        # Last: a wrapper among the ends holds blocks, which must be sharded before it.
        group = ends + [m for modules in tied for m in modules]
        chosen = [m for m in chosen if not any(m is e for e in ends)] + [group]
    else:
        chosen += tied  # each set of tied modules one grouped unit; it holds the head, so it runs last
    experts = [m for m in expert_units if m is not root and m not in chosen]
    return [*experts, *chosen], blocks


def _tied_groups(
    holders: Sequence[nn.Module], owners: dict[int, set[str]], names: dict[int, str]
) -> list[list[nn.Module]]:
    """Modules that share parameters only among themselves (a tied embedding and head), one list
    per set: each set can be one grouped unit, ``fully_shard([embedding, head])``, which manages
    the shared table once. A set whose parameters a module outside ``holders`` (the root, a
    wrapper of the blocks) holds too stays with the root."""
    groups: list[list[nn.Module]] = []
    for module in holders:
        shared = {owner for p in module.parameters(recurse=False) for owner in owners[id(p)]}
        joined = [g for g in groups if any(names[id(m)] in shared for m in g)]
        merged = [m for g in joined for m in g] + [module]
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    valid = []
    for group in groups:
        held_by = {names[id(m)] for m in group}
        if len(group) > 1 and all(
            owners[id(p)] <= held_by for m in group for p in m.parameters(recurse=False)
        ):
            valid.append(group)
    return valid


def _ends_fit_in_a_block(root: nn.Module, blocks: Sequence[nn.Module]) -> bool:
    """Whether the parameters outside the blocks (embedding, final norm, head, the root's own) are
    no more than the largest block's.

    Then gathering them as one unit for the whole step costs at most one block's gathered memory
    more, and saves an all-gather and a reduce-scatter per step (their latency). Local sizes: the
    same on every rank of the dp mesh.
    """

    def numel(params: Iterable[nn.Parameter]) -> int:
        return sum(local_tensor(p.data).numel() for p in {id(p): p for p in params}.values())

    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = numel(p for p in root.parameters() if id(p) not in in_blocks)
    return outside <= max(numel(b.parameters()) for b in blocks)


def _has_params_in_containers(module: nn.Module) -> bool:
    return any(isinstance(m, _CONTAINERS) and _has_params(m) for m in module.modules())


def apply_fully_shard(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    expert_units: Sequence[nn.Module] = (),
    expert_mesh: Optional[DeviceMesh] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    unit_choice: str = "auto",
) -> list[Unit]:
    """Shard ``root`` with FSDP2 over ``dp_mesh``; returns the units (root last).

    ``param_dtype`` is the compute dtype (bf16 under ``bf16-true``): FSDP2 keeps the sharded
    parameters in their own dtype (fp32, the master weights) and all-gathers in ``param_dtype``.
    ``expert_units`` are sharded over ``expert_mesh`` instead (expert parallelism replicates
    experts over ``edp`` only). ``shard_placement_fn`` picks the dim each parameter is sharded along
    (tensor parallel shards fused projections along dim 1; ``None`` means dim 0).
    ``reshard_after_forward=False`` keeps every unit gathered from its forward to its backward
    (ZeRO-2-like traffic); ``True`` reshards all but the unit that runs last and the last block
    (module docstring).
    ``unit_choice`` is ParaStrategy's ``zero3_units``: whether the embedding and head get units of
    their own (module docstring).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or param_dtype)
    units, blocks = _choose_units(root, expert_units, unit_choice)
    experts = {id(m) for m in expert_units}
    # Backward starts with the unit that ran last in forward (the head, or the group holding it),
    # then the last block: resharding them would only free memory to gather it straight back.
    runs_last = next((u for u in reversed(units) if id(u) not in experts), None)
    last_block = blocks[-1] if blocks else None
    for unit in units:
        mesh = expert_mesh if id(unit) in experts and expert_mesh is not None else dp_mesh
        reshard = reshard_after_forward and unit is not runs_last and unit is not last_block
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                    shard_placement_fn=shard_placement_fn)
        for module in unit if isinstance(unit, list) else [unit]:
            _RESHARD_AFTER_FORWARD[module] = reshard
        if isinstance(unit, nn.Module) and _only_embeddings(unit):
            unit.set_unshard_in_backward(False)  # an embedding's backward reads the ids, not the table
    # The root keeps FSDP2's own rule (`None`): not resharded after forward, backward needs it at once.
    fully_shard(root, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=None if reshard_after_forward else False,
                shard_placement_fn=shard_placement_fn)
    _RESHARD_AFTER_FORWARD[root] = False
    return [*units, root]


# What `apply_fully_shard` chose per module, so `fsdp_no_sync` can put it back after accumulating.
_RESHARD_AFTER_FORWARD: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _only_embeddings(unit: nn.Module) -> bool:
    """Whether every parameter of ``unit`` is the table of an ``nn.Embedding`` (its backward needs no weight)."""
    tables = {id(m.weight) for m in unit.modules() if isinstance(m, nn.Embedding)}
    params = list(unit.parameters())
    return bool(params) and all(id(p) in tables for p in params)


@contextlib.contextmanager
def fsdp_no_sync(root: nn.Module, *, keep_unsharded: bool = True) -> Iterator[None]:
    """Accumulation micro-steps for ZeRO-3 that communicate nothing after the first gather.

    Gradients accumulate unsharded (no reduce-scatter). With ``keep_unsharded`` the gathered
    parameters also stay gathered between micro-steps, so an optimizer step costs
    3 psi whatever the number of micro-steps: gather once in the first forward, gather again
    in the last backward, reduce-scatter once. The price is full-size parameters and
    gradients held during accumulation (``zero_accumulation="reduce_each_step"`` keeps them
    sharded instead and pays 3 psi per micro-step).
    """
    root.set_requires_gradient_sync(False)
    if keep_unsharded:
        root.set_reshard_after_forward(False)
        root.set_reshard_after_backward(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
        if keep_unsharded:
            root.set_reshard_after_backward(True)
            for module in root.modules():  # each unit's own choice back (see `apply_fully_shard`)
                if module in _RESHARD_AFTER_FORWARD:
                    module.set_reshard_after_forward(_RESHARD_AFTER_FORWARD[module], recurse=False)


def reshard_fsdp_units(module: nn.Module) -> None:
    """Reshard every FSDP2 unit in ``module`` that a forward-only pass left gathered.

    A unit kept gathered after forward (``reshard_after_forward=False``: the root, the unit that
    runs last) is resharded by backward; after validation, test or predict there is no backward,
    so it stays gathered, and while it is, the module's parameters are FSDP2's unsharded tensors,
    not the sharded ones the optimizer and checkpoints name. Local (no collective); a no-op for a
    unit that is sharded already. Call it at step boundaries only, never inside forward/backward.
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def is_fsdp_root(module: nn.Module) -> bool:
    """Whether ``module`` itself was given ``fully_shard`` (then steps run through its ``__call__``)."""
    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def fsdp_without_gradient_sync(units: Sequence[nn.Module]) -> Iterator[None]:
    """Accumulation micro-steps for modules the *user* gave ``fully_shard``: no reduce-scatter
    (gradients accumulate unsharded), and their reshard settings left as the user chose them."""
    fsdp_units = [u for u in units if isinstance(u, FSDPModule)]
    for unit in fsdp_units:
        unit.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for unit in fsdp_units:
            unit.set_requires_gradient_sync(True)
