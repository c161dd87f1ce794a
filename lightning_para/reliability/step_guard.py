"""One cheap agreement per optimizer step: stop on a non-finite loss or gradient, and on SIGTERM.

Two things must never happen silently or leave a rank behind, and both need every rank to take
the same decision at the same step:

* **Non-finite values.** A NaN/inf loss or gradient, left alone, turns the parameters into NaN
  and the run goes on (Megatron-LM checks loss and gradient norm for NaN by default, too). Each
  rank keeps its *local* loss (its own batch, before any reduction) and, under pipeline
  parallelism, the norm of each of its stages' forward outputs; before the optimizer steps, the
  norms of its gradients are computed (one fused ``torch._foreach_norm`` per dtype, no
  communication) and, with several ranks or a rider that reads it, its share of the squared global
  gradient norm (``sum(|g|^2 / replication)``). Any inf/NaN makes its entry non-finite.
* **Preemption.** SLURM and Kubernetes send SIGTERM to one or all processes. The signal handler
  only records the signal number (no collective inside a handler: a collective there pairs with
  whatever collective the peers run next, which is how a SIGTERM used to hang a run).

Both go into **one all-reduce (SUM) of four floats over the world** (whether a signal arrived and whether an
asynchronous save failed, ``checkpoint/async_save.py``, counted over ranks; the squared global gradient norm; the
sum of the noted losses and stage outputs -- a non-finite one makes the sum non-finite), issued once per optimizer
step after the gradients are synchronised (ZeRO's flush) and before clipping and the optimizer step; one rank alone
has nothing to agree on and keeps its notes as they are.
*Riders* (:attr:`StepGuard.riders`: the spike guard, the straggler detector) add their values to it: they agree
over ranks with no collective of their own. The all-reduce is **read one step late**: step ``N`` launches its agreement (asynchronously;
on an accelerator its result is copied to host memory behind the step's work and an event marks
it) and step ``N + 1``'s check reads it, long finished by then. So the hot path has no
device-to-host sync of its own (Lightning's loop has none either), and every rank still learns
the same thing at the same step:

* a non-finite value appearing at step ``N``: at step ``N + 1``'s check (before its optimizer
  step), one small all-gather of each rank's notes, then every rank raises the same
  :class:`NonFiniteError` naming step ``N`` (the step it appeared at), the rank(s) where it first
  appeared and, under pipeline parallelism, the stage that produced it (the first stage in
  pipeline order whose forward output was not finite; else the last stage's loss; else, for
  gradients, the stage where backward starts). Step ``N``'s optimizer step has run, so the
  parameters may be non-finite; **no checkpoint holds them**: a save first settles the agreement in
  flight (:meth:`StepGuard.settle`, a sync on checkpoint steps only), and so does the end of ``fit``,
  so a non-finite last step still raises.
* a signal: after the optimizer step of the step that agreed on it, at that step boundary, every rank saves a
  checkpoint through the normal (atomic) save path and raises :class:`Preempted`, a
  ``SIGTERMException`` (``SystemExit``) with code :data:`PREEMPTED_EXIT_CODE` (143 = 128 +
  SIGTERM, what a process ended by SIGTERM reports, so schedulers and ``torchrun`` restart it).
  A signal received during step ``N`` stops the run at the end of step ``N + 1``.

The cost per optimizer step: one pass over the local gradients (memory-bound) and one concatenation of the notes:
two kernels on one rank; with several ranks also a stack and a dot product of the norms and one asynchronous
all-reduce of 16 bytes (plus the riders'); a norm of each stage's output (pipeline only); on an accelerator, one
non-blocking copy to host (``docs/reliability.md``, ``docs/performance.md``).

Why this module is long: the agreement, its riders and the decisions read from it share one all-reduce and
its read a step late; split, each part would hold half of that protocol.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_para._dtensor import local_tensor
from lightning_para.parallel.data.grad_norm import foreach_norms, local_grad_square_sum
from lightning_para.reliability.integrity import IntegrityError
from lightning_para.reliability.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    hpc_checkpoint_path,
)

SIGNAL_ACTIONS = ("checkpoint", "exit")
_NONE = -1
_GRAD, _LOSS, _STAGE = "grad", "loss", "stage"  # what a note is: a gradient norm, a loss, a stage's output


class NonFiniteError(IntegrityError):
    """A loss or gradient was not finite (inf/NaN); raised on every rank before the optimizer step."""


def check_step_guard_options(check_finite: bool, on_sigterm: Optional[str]) -> None:
    """``ValueError`` naming the argument (called before any process group exists)."""
    if not isinstance(check_finite, bool):
        raise ValueError(f"`check_finite={check_finite!r}` must be True (stop on a non-finite loss/gradient) or False.")
    if on_sigterm is not None and on_sigterm not in SIGNAL_ACTIONS:
        raise ValueError(
            f"`on_sigterm={on_sigterm!r}` is unknown. Choose 'checkpoint' (save at the next step boundary, then exit"
            f" with code {PREEMPTED_EXIT_CODE}), 'exit' (exit at the next step boundary without saving) or None"
            " (Lightning's own SIGTERM handling)."
        )


def _first_tensor(output: Any) -> Optional[Tensor]:
    if isinstance(output, dict):
        output = output.get("loss")
    return output if isinstance(output, Tensor) else None


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


@dataclass
class _Agreement:
    """One step's flags on their way to the host: the all-reduce (``work``, ``None`` with one rank), the host copy and
    the event after it (accelerators; on CPU the flags are host memory), the step, the slice of the flags whose
    non-finite values stop the run, and this rank's notes behind them (read only to name where a value was not finite)."""

    step: int
    flags: Optional[Tensor]  # None: one rank with nothing on the device to read (``values`` holds the flags)
    checked: tuple[int, int]
    notes: list[tuple[tuple, Tensor]]
    riders: list[tuple[Any, int, int]]  # each rider's slice of the flags
    work: Any = None
    host: Optional[Tensor] = None
    event: Any = None
    values: Optional[list[float]] = None

    def read(self) -> list[float]:
        """``[signal, background save failed, gradient norms..., notes..., riders...]``: waits only for this agreement."""
        if self.values is not None:
            return self.values
        if self.event is not None:
            self.event.synchronize()
            return self.host.tolist()  # host memory, written before the event: no device sync
        if self.work is not None:
            self.work.wait()
        return self.flags.tolist()  # CPU flags: the device is the host


class StepGuard:
    """The per-step agreement described in the module docstring.

    Args:
        check_finite: stop on a non-finite loss or gradient (default on; ``False`` trains on).
        on_sigterm: ``"checkpoint"``, ``"exit"`` or ``None`` (no handler of ours).
        device: where the flags live (the device the default group communicates on).
        rank_info: global rank -> a short description (``"pipeline stage 0"``), for messages.
    """

    def __init__(self, *, check_finite: bool = True, on_sigterm: Optional[str] = "checkpoint",
                 device: torch.device = torch.device("cpu"), rank_info: Optional[Callable[[int], str]] = None) -> None:
        check_step_guard_options(check_finite, on_sigterm)
        self.check_finite = check_finite
        self.on_sigterm = on_sigterm
        self._hooks: list[Any] = []
        self._previous_handler: Any = None
        self._installed = False
        self.background: Any = None  # async_save's save in flight (`failed()`, `settle()`): its failure agreed here
        # Riders: ``payload(step, stepping) -> Optional[Tensor]`` (1-D float32, one size on every rank; ``stepping``: an
        # optimizer step's check), ``agreed(step, values)`` once read, ``wants_grad_norm`` (the gradient pass runs).
        self.riders: list[Any] = []
        self.connect(device, rank_info)

    def connect(
        self, device: torch.device, rank_info: Optional[Callable[[int], str]] = None,
        replication: Optional[Callable[[Tensor], int]] = None,
    ) -> None:
        """Start a fit on ``device`` (the default group's): fresh notes, no signal, no stage hooks. ``replication(p)``:
        on how many ranks ``p.grad`` is identical (the global norm's weights; default: on every rank)."""
        self.remove_hooks()
        self.device = torch.device(device)
        self.rank_info = rank_info or (lambda rank: "")
        self.replication = replication or (lambda p: dist.get_world_size() if dist.is_initialized() else 1)
        self.signal_received: Optional[int] = None  # set by the handler on this rank
        self.stop_signal: Optional[int] = None  # agreed by every rank
        self.pending = False  # a loss was observed since the last check (the same on every rank)
        self.stepped = False  # an optimizer step was checked since the last step boundary
        # Noted since the last check, on the device: ((kind, ...), fp32 value), inf/NaN where not finite.
        self._notes: list[tuple[tuple, Tensor]] = []
        self._zero, self._one = (torch.full((1,), v, dtype=torch.float32, device=self.device) for v in (0.0, 1.0))
        self._in_flight: Optional[_Agreement] = None  # the last check's agreement, read at the next

    @property
    def active(self) -> bool:
        return self.check_finite or self.on_sigterm is not None or self.background is not None or bool(self.riders)

    # ---------------------------------------------------------------- device-side notes (no sync)
    @torch.no_grad()
    def observe_loss(self, output: Any, step: int, local: bool = True) -> None:
        """Keep this rank's local loss (a reference: no kernel). ``local=False``: the value is not computed here
        (a pipeline rank without the last stage receives it): mark the step, note nothing."""
        self.pending = True
        loss = _first_tensor(output)
        if not self.check_finite or not local or loss is None:
            return
        value = local_tensor(loss).detach()
        self._notes.append(((_LOSS, step), value if value.dim() == 0 else value.float().sum()))

    def watch_stage_outputs(
        self, stages: Iterable[tuple[int, nn.Module]], step: Callable[[], int], skip: Callable[[], bool] = lambda: False
    ) -> None:
        """Pipeline stages: note the norm of each training forward output (the first stage by index whose output is
        not finite is named). ``skip()`` says when a forward's inputs are placeholders (the schedule's shape inference)."""
        if not self.check_finite:
            return
        for index, module in stages:
            self._hooks.append(module.register_forward_hook(self._stage_hook(index, step, skip)))

    def _stage_hook(self, index: int, step: Callable[[], int], skip: Callable[[], bool]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or skip():  # validation/prediction, or shape inference
                return
            tensors = [local_tensor(t).detach() for t in _tensors(output) if t.is_floating_point()]
            kind = (_STAGE, index, step())
            self._notes.extend((kind, norm) for norm in foreach_norms(tensors))

        return hook

    # ---------------------------------------------------------------- the agreement (collective)
    @torch.no_grad()
    def check(self, step: int, params: Optional[Iterable[Tensor]] = None) -> None:
        """Every rank, once per optimizer step (and at a step boundary if a loss was noted since): launch this
        step's all-reduce and read the previous step's; raises :class:`NonFiniteError` on every rank (naming the
        step the value appeared at), or records an agreed signal.

        ``params``: the optimizer's parameters whose local gradients are checked (``None``: none, e.g.
        under fp16 loss scaling, where an inf gradient only skips the step)."""
        self.pending = False
        if params is not None:
            self.stepped = True
        if not self.active:
            return
        notes, self._notes = self._notes, []
        several = dist.is_initialized() and dist.get_world_size() > 1
        grads = self._gradient_notes(params, several)
        notes_part = [self._notes_sum(notes)] if several else [value for _, value in notes]  # one size on every rank
        signalled = self.signal_received is not None
        save_failed = self.background is not None and self.background.failed()  # a host future: no sync
        parts = [self._one if signalled else self._zero, self._one if save_failed else self._zero,
                 *(t.reshape(1).to(self.device) for t in (*grads, *notes_part))]
        checked = (2, len(parts) if self.check_finite else 2)
        riders, start = [], len(parts)
        for rider in self.riders:
            values = rider.payload(step, params is not None)
            if values is not None:
                parts.append(values)
                riders.append((rider, start, start + values.numel()))
                start += values.numel()
        if several or len(parts) > 2:
            agreement = _Agreement(step, torch.cat(parts), checked, notes + [((_GRAD,), g) for g in grads], riders)
        else:  # one rank, nothing noted on the device: the host knows the flags
            agreement = _Agreement(step, None, checked, [], [], values=[float(signalled), float(save_failed)])
        previous, self._in_flight = self._in_flight, self._launch(agreement, several)
        if previous is not None:
            self._act(previous)

    def _gradient_notes(self, params: Optional[Iterable[Tensor]], several: bool) -> list[Tensor]:
        """What the gradients add to the flags. With several ranks or a rider that reads it, this rank's share of the
        squared global norm (``flags[2]``; the SUM over ranks is the squared norm); one rank alone: the norms as they
        are. Non-finite iff a gradient is (or the sum of squares overflows fp32: also a stop)."""
        wants_norm = any(getattr(r, "wants_grad_norm", False) for r in self.riders)
        if params is None or not (self.check_finite or wants_norm):
            return [self._zero] if several or wants_norm else []
        if several or wants_norm:
            return [local_grad_square_sum(params, self.replication, self.device)]
        return foreach_norms(local_tensor(p.grad).detach() for p in params if p.grad is not None and p.grad.numel())

    def _notes_sum(self, notes: list[tuple[tuple, Tensor]]) -> Tensor:
        if not notes:
            return self._zero
        return notes[0][1] if len(notes) == 1 else torch.stack([value.to(self.device) for _, value in notes]).sum()

    def this_step(self, rider: Any) -> Optional[tuple[int, Tensor, Tensor]]:
        """``(step, squared global gradient norm, its values)`` summed over ranks, on the device, for a rider acting in
        the step it rode (``None`` if it did not). On CPU the host waits for the all-reduce; an accelerator's stream does."""
        agreement = self._in_flight
        for r, start, stop in agreement.riders if agreement is not None else ():
            if r is rider:
                if agreement.event is None and agreement.work is not None:
                    agreement.work.wait()
                return agreement.step, agreement.flags[2], agreement.flags[start:stop]
        return None

    def _launch(self, agreement: _Agreement, several: bool) -> _Agreement:
        flags = agreement.flags
        if flags is None:
            return agreement
        if several:
            agreement.work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)
        if flags.device.type != "cpu":
            if agreement.work is not None:
                agreement.work.wait()  # accelerators: orders the current stream after the collective, no host wait
            agreement.host = flags.to("cpu", non_blocking=True)
            agreement.event = torch.Event(flags.device)
            agreement.event.record()
        return agreement

    def settle(self) -> None:
        """Read the agreement in flight now (every rank): before a checkpoint is saved and when ``fit`` ends, so no
        checkpoint holds parameters a non-finite step made and the last step's values are checked too."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._act(previous)

    def _act(self, agreement: _Agreement) -> None:
        values = agreement.read()
        if values[0] > 0 and self.stop_signal is None:
            self.stop_signal = int(signal.SIGTERM)  # the one signal the handler is installed for
        for rider, start, stop in agreement.riders:
            rider.agreed(agreement.step, values[start:stop])
        nonfinite = not all(map(math.isfinite, values[agreement.checked[0] : agreement.checked[1]]))
        save_failed = values[1] > 0
        if nonfinite or save_failed:
            if self._in_flight is not None and self._in_flight.work is not None:
                self._in_flight.work.wait()  # the collective launched after it completes before the next one
            self._in_flight = None
            if nonfinite:
                raise NonFiniteError(self._where(agreement))
            self.background.settle()  # raises the failed write's error, agreed over ranks in the background

    def _where(self, agreement: _Agreement) -> str:
        """Gather every rank's notes of the agreed step (a host read: the run stops here); the same message on every
        rank."""
        step = agreement.step
        bad = [kind for kind, value in agreement.notes if not math.isfinite(float(value))]
        stages = sorted((kind[1], kind[2]) for kind in bad if kind[0] == _STAGE)
        local = torch.tensor([min((kind[1] for kind in bad if kind[0] == _LOSS), default=_NONE),
                              *(stages[0] if stages else (_NONE, _NONE)),
                              int(any(kind[0] == _GRAD for kind in bad))], dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            world = dist.get_world_size()
            table = torch.zeros(world * 4, dtype=torch.int64, device=self.device)
            dist.all_gather_into_tensor(table, local)
            rows = table.view(world, 4).tolist()
        else:
            rows = [local.tolist()]
        stages = [r[1] for r in rows if r[1] >= 0]  # this agreement's notes only: none of the step after it
        losses = [r[0] for r in rows if r[0] >= 0]
        if stages:
            first = min(stages)
            at = min(r[2] for r in rows if r[1] == first)
            ranks = [i for i, r in enumerate(rows) if r[1] == first and r[2] == at]
            what = f"the forward output of pipeline stage {first} was not finite first at step {at}, on {self._ranks(ranks)}"
        elif losses:
            at = min(losses)
            ranks = [i for i, r in enumerate(rows) if r[0] == at]
            what = f"the loss was not finite first at step {at}, on {self._ranks(ranks)} (their local batch)"
        else:
            ranks = [i for i, r in enumerate(rows) if r[3]]
            what = f"the gradients were not finite at step {step} (after synchronisation), on {self._ranks(ranks)}"
        return (
            f"lightning-para: {what}. Every rank agreed on it one step later (the check is read a step late, so the"
            " hot path never waits for the device) and stopped there: that step's optimizer step ran, so the parameters"
            " may be non-finite, but no checkpoint holds them (a save settles the check first), so the last checkpoint"
            " is intact. Look for the cause in that step's batch or in the model; to train on regardless, pass"
            " `ParaStrategy(check_finite=False)`."
        )

    def _ranks(self, ranks: list[int]) -> str:
        described = []
        for r in ranks:
            info = self.rank_info(r)
            described.append(f"{r} ({info})" if info else str(r))
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(described)

    # ---------------------------------------------------------------- signals
    def install_signal_handler(self) -> None:
        """Replace the SIGTERM handler (Lightning's broadcasts inside the handler) with one that only
        records the signal (after Lightning's own is installed); restored at teardown."""
        if self.on_sigterm is None or self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_received is None:
            self.signal_received = signum
            rank = dist.get_rank() if dist.is_initialized() else 0
            sys.stderr.write(
                f"[rank {rank}] lightning-para: received {signal.Signals(signum).name}; every rank stops at the next"
                " step boundary" + (" after saving a checkpoint.\n" if self.on_sigterm == "checkpoint" else ".\n")
            )
            sys.stderr.flush()

    def restore_signal_handler(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)
        self._installed = False

    def at_step_boundary(self, step: int, save: Optional[Callable[[], Optional[str]]] = None) -> None:
        """After each training batch, on every rank: check a loss noted since the last check (manual
        optimization, accumulation micro-steps); after an optimizer step, act on an agreed signal. ``save=None``
        under ``"checkpoint"``: the caller's loop saves and exits (it reads :attr:`stop_signal`)."""
        if self.pending:
            self.check(step)
        stepped, self.stepped = self.stepped, False
        if stepped and (save is not None or self.on_sigterm == "exit"):
            self.stop_at_boundary(save or (lambda: None))

    def stop_at_boundary(self, save: Callable[[], Optional[str]]) -> None:
        """At a step boundary (every rank together): after an agreed signal, save (``"checkpoint"``)
        and raise :class:`Preempted`."""
        if self.stop_signal is None:
            return
        name = signal.Signals(self.stop_signal).name
        path = save() if self.on_sigterm == "checkpoint" else None
        rank = dist.get_rank() if dist.is_initialized() else 0
        saved = f"saved the checkpoint {path!r}" if path else "saved no checkpoint (on_sigterm='exit')"
        message = (
            f"[rank {rank}] lightning-para: stopped after {name}: {saved}; exiting with code {PREEMPTED_EXIT_CODE}."
            + (" Resume with trainer.fit(..., ckpt_path='hpc') (automatic under SLURM)." if path else "")
        )
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        raise Preempted(message, path)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def pipeline_rank_info(mesh: Any) -> Callable[[int], str]:
    """Global rank -> ``"pipeline rank k"`` on a mesh with a ``"pp"`` dimension of size > 1, else ``""``."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None or "pp" not in names or mesh.size(names.index("pp")) < 2:
        return lambda rank: ""
    dim, ranks = names.index("pp"), mesh.mesh

    def info(rank: int) -> str:
        where = (ranks == rank).nonzero()
        return f"pipeline rank {int(where[0][dim])}" if len(where) else ""

    return info


__all__ = [
    "NonFiniteError",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "SIGNAL_ACTIONS",
    "StepGuard",
    "check_step_guard_options",
    "hpc_checkpoint_path",
    "pipeline_rank_info",
]
