"""Silent-corruption checks: replicas that should be bitwise equal are compared every N steps.

Data parallelism keeps copies: under ZeRO-0/1/2 every dp rank holds the whole (stage's)
parameters (experts: every ``edp`` rank of their ep group), plain parameters and ``Replicate``
DTensors (norms, biases of row-parallel layers) are whole on every tp rank, and under ZeRO-0
the optimizer state is replicated like its parameter. Identical gradients and identical updates
keep them *bitwise* equal, so any difference is corruption: a flipped bit in memory, a bad
collective, a diverged kernel.

Every ``integrity_check_every_n_steps`` (before the next step starts, after ZeRO's gather) each
rank computes two 64-bit checksums per replicated tensor -- the wrapping sum of its raw bits,
and the same sum weighted by position, so one flipped bit and two swapped values both change
them -- and exchanges them with **one all-gather per replica group** (dp, edp, tp: a few
kilobytes; also ``dp_replicate`` and ``cp``). A small all-gather over the world then shares the verdict, so every rank raises
(or warns) the same message naming the step, the tensor, the group and the ranks that
disagree with the majority.

Non-finite values: every step each rank notes, on the device and without a sync, the first
step whose *local* loss (its own batch's, before any reduction) was not finite; at a check the
ranks compare notes, so the report names the rank (and step) where it first appeared. Local
gradients are checked for inf/NaN at each check (after synchronisation: they name where a
non-finite gradient is held, not necessarily where it arose).

What it cannot catch: a flip in state that has a single copy -- a ZeRO-1/2 optimizer shard or
fp32 master (the next all-gather spreads it to every replica), a ZeRO-3 shard, a tp shard of a
sharded weight, the pipeline stage's own layers -- and corruption of activations or gradients
that leaves the replicas consistent (it is then in every copy). A deterministic re-run of a step
(Megatron's rerun state machine) catches those; it is not built here.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_para._dtensor import local_tensor
from lightning_para.mesh import ParallelDims
from lightning_para.spec.dims import DIM, DIMS

INTEGRITY_ACTIONS = ("raise", "warn")
_CHUNK = 1 << 24  # elements per checksum pass: bounds the temporary int64 copies to 128 MiB
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The groups a parameter may have replicas over, in the order every rank gathers over them (the dimension table's).
_GROUP_ORDER = tuple(d.name for d in DIMS if d.replicas)
# Mesh dims over which data parallelism (and context parallelism) may shard a DTensor parameter (FSDP2).
_DATA_DIMS = {d.name for d in DIMS if d.data}


class IntegrityError(RuntimeError):
    """Replicas that must be bitwise equal differ, or a loss or gradient is not finite."""


def check_integrity_options(every_n_steps: Optional[int], action: str) -> None:
    """``ValueError`` naming the argument (called before any process group exists)."""
    if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1):
        raise ValueError(
            f"`integrity_check_every_n_steps={every_n_steps!r}` must be a positive integer (steps between checks),"
            " or None to switch the checks off."
        )
    if action not in INTEGRITY_ACTIONS:
        raise ValueError(f"`integrity_action={action!r}` is unknown. Choose one of {', '.join(map(repr, INTEGRITY_ACTIONS))}.")


@torch.no_grad()
def tensor_checksums(tensor: Tensor) -> Tensor:
    """Two int64 checksums of the raw bits of ``tensor``: their wrapping sum and a position-weighted sum.

    Integer addition modulo 2**64 is associative, so the result does not depend on reduction order.
    """
    flat = local_tensor(tensor).detach().contiguous().view(-1)
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0 or flat.dtype.is_complex or flat.dtype == torch.bool:
        return out
    ints = flat.view(_INT_OF_SIZE[flat.element_size()])
    for start in range(0, ints.numel(), _CHUNK):
        chunk = ints[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
        out[0] += chunk.sum()
        out[1] += (chunk * weights).sum()
    return out


def replica_groups(param: Tensor, dims: ParallelDims, *, fully_sharded: bool, is_expert: bool) -> list[str]:
    """The mesh dimensions (``"dp"``, ``"edp"``, ``"dp_replicate"``, ``"cp"``, ``"tp"``) along which
    ``param``'s local tensor is replicated. Several 1-D groups cover a product (dp x tp: both)."""
    names: list[str] = []
    present: set[str] = set()
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        present = set(mesh.mesh_dim_names or ())
        for i, placement in enumerate(param.placements):
            name = (mesh.mesh_dim_names or ())[i] if mesh.mesh_dim_names else None
            if placement.is_replicate() and name in _GROUP_ORDER and mesh.size(i) > 1:
                names.append(name)
    if not fully_sharded and not present & _DATA_DIMS:
        # ZeRO 0-2 keep whole parameters on every data-parallel and context-parallel rank; experts
        # only on the ranks that hold the same experts (edp, in every replica).
        names += [p for p in DIM["dp"].parts if p != "ep"] if is_expert and dims.ep > 1 else ["dp"]
        names.append("cp")
    if "tp" not in present:  # not split by tensor parallelism: whole on every tp rank
        names.append("tp")
    return [n for n in dict.fromkeys(names) if dims.size(n) > 1]


def _groups_to_gather(dims: ParallelDims) -> list[str]:
    """Decided by the layout alone, so every member of a group calls its all-gather (``edp`` is only
    needed, and only differs from ``dp``, with expert parallelism)."""
    return [name for name in _GROUP_ORDER if dims.size(name) > 1 and (name != "edp" or dims.ep > 1)]


@dataclass
class Mismatch:
    """One replicated tensor whose copies differ."""

    name: str
    group: str
    ranks: list[int]  # global ranks of the group, in group order
    checksums: list[tuple[int, int]]

    def describe(self) -> str:
        counts = Counter(self.checksums)
        majority, votes = counts.most_common(1)[0]
        if votes * 2 > len(self.checksums):
            bad = [r for r, c in zip(self.ranks, self.checksums) if c != majority]
            good = [r for r, c in zip(self.ranks, self.checksums) if c == majority]
            who = f"rank(s) {_ranks(bad)} disagree with rank(s) {_ranks(good)}"
        else:
            who = f"rank(s) {_ranks(self.ranks)} hold different values (no majority says which is right)"
        return f"{self.name!r} differs between its replicas over {self.group}: {who}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class IntegrityChecker:
    """Compares replicated state across replicas and tracks non-finite losses (see the module docstring).

    Args:
        every_n_steps: steps between checks.
        action: ``"raise"`` (:class:`IntegrityError` on every rank) or ``"warn"`` (a warning on rank 0).
    """

    def __init__(self, every_n_steps: int, action: str = "raise") -> None:
        check_integrity_options(every_n_steps, action)
        self.every_n_steps = every_n_steps
        self.action = action
        self.last_checked_step = -1
        self.reports: list[str] = []  # every finding so far (warn mode keeps going)
        self._first_bad_loss: Optional[Tensor] = None

    # ---------------------------------------------------------------- every step (no sync, no collective)
    @torch.no_grad()
    def observe_loss(self, loss: Any, step: int) -> None:
        """Note (on the device) the first step whose local loss is not finite."""
        if isinstance(loss, dict):
            loss = loss.get("loss")
        if not isinstance(loss, Tensor):
            return
        value = local_tensor(loss).detach().float().reshape(-1)[:1].sum()
        if self._first_bad_loss is None:
            self._first_bad_loss = torch.full((), -1, dtype=torch.int64, device=value.device)
        bad = ~torch.isfinite(value) & (self._first_bad_loss < 0)
        self._first_bad_loss = torch.where(bad, torch.full_like(self._first_bad_loss, step), self._first_bad_loss)

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every_n_steps == 0 and step != self.last_checked_step

    # ---------------------------------------------------------------- the check (collective)
    def check(
        self,
        step: int,
        named_tensors: Callable[[], Iterator[tuple[str, Tensor, list[str]]]],
        gradients: Callable[[], Iterator[Tensor]],
        dims: ParallelDims,
        device: torch.device,
    ) -> list[str]:
        """Run one check on every rank; returns the findings (empty if all is well), after raising or warning.

        ``named_tensors`` yields ``(name, tensor, replica groups)``; ``gradients`` the local gradients.
        """
        self.last_checked_step = step
        per_group: dict[str, list[tuple[str, Tensor]]] = {name: [] for name in _groups_to_gather(dims)}
        for name, tensor, groups in named_tensors():
            for group in groups:
                if group in per_group:
                    per_group[group].append((name, tensor))
        mismatches: list[Mismatch] = []
        for group_name, entries in per_group.items():
            mismatches.extend(self._compare(group_name, entries, dims, device))
        grads_bad = torch.zeros((), dtype=torch.int64, device=device)
        for g in gradients():
            local = local_tensor(g)
            if local.numel() and not torch.isfinite(local).all():
                grads_bad.fill_(1)
                break
        first_bad = self._first_bad_loss.to(device) if self._first_bad_loss is not None else torch.full((), -1, device=device)
        flags = torch.stack([torch.tensor(len(mismatches), device=device), first_bad.to(torch.int64), grads_bad])
        world = dist.get_world_size()
        gathered = torch.zeros(world * 3, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, flags)
        rows = gathered.view(world, 3).cpu().tolist()
        findings: list[str] = []
        if any(r[0] for r in rows):
            details: list[Any] = [None] * world
            dist.all_gather_object(details, [m.describe() for m in mismatches])
            findings.extend(sorted({d for per_rank in details for d in per_rank}))
        bad_steps = [r[1] for r in rows if r[1] >= 0]
        if bad_steps:
            first = min(bad_steps)
            ranks = [rank for rank, r in enumerate(rows) if r[1] == first]
            findings.append(f"the loss was not finite first at step {first}, on rank(s) {_ranks(ranks)} (their local batch)")
            self._first_bad_loss = None  # reported once
        grad_ranks = [rank for rank, r in enumerate(rows) if r[2]]
        if grad_ranks:
            findings.append(f"gradients with inf/NaN are held on rank(s) {_ranks(grad_ranks)}")
        if findings:
            self._report(step, findings)
        return findings

    def check_model(
        self,
        step: int,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        dims: ParallelDims,
        device: torch.device,
        *,
        fully_sharded: bool,
        is_expert: Callable[[Tensor], bool],
    ) -> list[str]:
        """:meth:`check` of a model and its optimizers: every replicated parameter and optimizer state
        tensor (:func:`replicated_state`) and every optimizer parameter's gradient (collective)."""
        return self.check(
            step,
            lambda: replicated_state(module, optimizers, dims, fully_sharded=fully_sharded, is_expert=is_expert),
            lambda: (q.grad for o in optimizers for g in o.param_groups for q in g["params"] if q.grad is not None),
            dims,
            device,
        )

    def _compare(self, group_name: str, entries: list[tuple[str, Tensor]], dims: ParallelDims, device: torch.device) -> list[Mismatch]:
        group = dims.group(group_name)
        size = dist.get_world_size(group)
        # Entry 0 is the count, so replicas holding different sets of tensors show up too.
        local = torch.cat(
            [torch.tensor([len(entries), 0], dtype=torch.int64, device=device)]
            + [tensor_checksums(t).to(device) for _, t in entries]
        )
        out = torch.zeros(size * local.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(out, local, group=group)
        table = out.view(size, -1, 2).cpu().tolist()
        ranks = dist.get_process_group_ranks(group)
        if len({row[0][0] for row in table}) > 1:
            counts = [row[0][0] for row in table]
            return [Mismatch(f"<number of replicated tensors: {counts}>", group_name, ranks, [(c, 0) for c in counts])]
        found = []
        for j, (name, _) in enumerate(entries, start=1):
            values = [tuple(row[j]) for row in table]
            if len(set(values)) > 1:
                found.append(Mismatch(name, group_name, ranks, values))
        return found

    def _report(self, step: int, findings: list[str]) -> None:
        message = f"lightning-para integrity check at step {step}: " + "; ".join(findings) + "."
        self.reports.append(message)
        if self.action == "raise":
            raise IntegrityError(message)
        if dist.get_rank() == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def replicated_state(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    dims: ParallelDims,
    *,
    fully_sharded: bool,
    is_expert: Callable[[Tensor], bool],
) -> Iterator[tuple[str, Tensor, list[str]]]:
    """Every parameter (and, where the optimizer steps the parameter itself, its state tensors) with its replica groups."""
    states: dict[int, dict[str, Any]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for q in group["params"]:
                if q in optimizer.state:
                    states[id(q)] = optimizer.state[q]
    for name, param in module.named_parameters():
        groups = replica_groups(param, dims, fully_sharded=fully_sharded, is_expert=is_expert(param))
        if not groups:
            continue
        yield name, param, groups
        for key, value in states.get(id(param), {}).items():
            if isinstance(value, Tensor) and value.shape == param.shape and value.dim() > 0:
                yield f"{name} (optimizer {key})", value, groups


__all__ = [
    "INTEGRITY_ACTIONS",
    "IntegrityChecker",
    "IntegrityError",
    "Mismatch",
    "check_integrity_options",
    "replica_groups",
    "replicated_state",
    "tensor_checksums",
]
