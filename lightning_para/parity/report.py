"""Comparing two recorded runs: per-step differences, a verdict, and where to look on a mismatch.

Tolerances (relative, per step), by the runs' precision:

=================  ==========  ==============  ===================================================
precision          loss        gradient norms  why
=================  ==========  ==============  ===================================================
32-true            1e-5        1e-4            fp32 sums in another order (per-rank partial sums,
                                               then a collective): ~1e-7 per op; the project's
                                               parity tests hold losses to 1e-5 over 20 AdamW steps.
                                               Gradient norms are squared sums of many of them.
bf16-*, 16-mixed   2e-2        5e-2            an 8-bit mantissa (~4e-3 per rounding); losses of
                                               different reduction orders drift by a few 1e-3.
=================  ==========  ==============  ===================================================

A parameter's gradient norm is compared relative to the larger of itself and 1e-3 of the step's
global gradient norm, so parameters with nearly no gradient do not fail on noise.

The verdict is ``match`` when every step's loss, global gradient norm and per-parameter gradient
norms are within tolerance. Otherwise ``mismatch`` names the first step where anything is off
and the parameters whose gradients differ most at that step (largest relative difference
first): a layout bug shows first in the parameters of the module it breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_para.parity.record import RunRecord

TOLERANCES = {"32-true": (1e-5, 1e-4)}
LOW_PRECISION_TOLERANCES = (2e-2, 5e-2)
NEGLIGIBLE_GRAD = 1e-3  # of the step's global gradient norm


def tolerances(precision: str) -> tuple[float, float]:
    """``(loss, gradient)`` relative tolerances for a run in ``precision``."""
    return TOLERANCES.get(precision, LOW_PRECISION_TOLERANCES)


def _rel(a: float, b: float, floor: float = 1e-12) -> float:
    return abs(a - b) / max(abs(b), floor)


@dataclass(frozen=True)
class StepDiff:
    step: int
    loss: float
    reference_loss: float
    grad_norm: float
    reference_grad_norm: float
    worst_params: tuple[tuple[str, float], ...]  # (name, relative difference), largest first

    @property
    def loss_diff(self) -> float:
        return _rel(self.loss, self.reference_loss)

    @property
    def grad_norm_diff(self) -> float:
        return _rel(self.grad_norm, self.reference_grad_norm)

    @property
    def worst_param_diff(self) -> float:
        return self.worst_params[0][1] if self.worst_params else 0.0


@dataclass
class ParityReport:
    """``run`` against ``reference``, step by step, with the verdict."""

    run: str
    reference: str
    precision: str
    loss_tolerance: float
    grad_tolerance: float
    steps: list[StepDiff] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # structural differences (steps, parameter names)

    def step_ok(self, diff: StepDiff) -> bool:
        return (diff.loss_diff <= self.loss_tolerance and diff.grad_norm_diff <= self.grad_tolerance
                and diff.worst_param_diff <= self.grad_tolerance)

    @property
    def first_mismatch(self) -> StepDiff | None:
        return next((d for d in self.steps if not self.step_ok(d)), None)

    @property
    def verdict(self) -> str:
        return "match" if not self.problems and self.first_mismatch is None and self.steps else "mismatch"

    def offending_parameters(self, limit: int = 5) -> list[tuple[str, float]]:
        """At the first mismatching step, the parameters whose gradient norms differ beyond tolerance, worst first."""
        first = self.first_mismatch
        if first is None:
            return []
        return [(name, diff) for name, diff in first.worst_params if diff > self.grad_tolerance][:limit]

    def text(self) -> str:
        lines = [
            f"parity: {self.run} against {self.reference} ({self.precision}; tolerances: loss {self.loss_tolerance:g},"
            f" gradient norms {self.grad_tolerance:g} relative)",
            f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'rel diff':>9}  {'grad norm':>11}  {'reference':>11}"
            f"  {'rel diff':>9}  {'worst param':>11}",
        ]
        for d in self.steps:
            flag = "" if self.step_ok(d) else "  <-"
            lines.append(
                f"{d.step:>4}  {d.loss:>12.6f}  {d.reference_loss:>12.6f}  {d.loss_diff:>9.2e}  {d.grad_norm:>11.5f}"
                f"  {d.reference_grad_norm:>11.5f}  {d.grad_norm_diff:>9.2e}  {d.worst_param_diff:>11.2e}{flag}"
            )
        lines += [f"problem: {p}" for p in self.problems]
        first = self.first_mismatch
        if self.verdict == "match":
            lines.append(f"verdict: match ({len(self.steps)} steps within tolerance)")
        elif first is not None:
            what = [name for name, limit, value in (
                ("loss", self.loss_tolerance, first.loss_diff), ("gradient norm", self.grad_tolerance, first.grad_norm_diff),
                ("parameter gradients", self.grad_tolerance, first.worst_param_diff)) if value > limit]
            lines.append(f"verdict: mismatch, first at step {first.step} ({', '.join(what)} beyond tolerance)")
            offending = self.offending_parameters()
            if offending:
                lines.append("gradients that differ most at that step (relative difference of their norms):")
                lines += [f"  {name}: {diff:.3e}" for name, diff in offending]
        else:
            lines.append("verdict: mismatch")
        return "\n".join(lines)


def compare_records(run: RunRecord, reference: RunRecord) -> ParityReport:
    """Compare two recorded runs step by step (the tolerances of ``reference``'s precision)."""
    loss_tol, grad_tol = tolerances(reference.precision)
    report = ParityReport(run.label, reference.label, reference.precision, loss_tol, grad_tol)
    if run.precision != reference.precision:
        report.problems.append(f"precisions differ: {run.precision} vs {reference.precision}")
    if len(run.losses) != len(reference.losses):
        report.problems.append(f"{len(run.losses)} steps vs {len(reference.losses)} in the reference")
    for step, (loss, ref_loss, norm, ref_norm, params, ref_params) in enumerate(zip(
        run.losses, reference.losses, run.grad_norms, reference.grad_norms, run.param_grad_norms,
        reference.param_grad_norms,
    )):
        if step == 0 and set(params) != set(ref_params):
            missing, extra = sorted(set(ref_params) - set(params)), sorted(set(params) - set(ref_params))
            report.problems.append(f"parameters differ: missing {missing[:5]}, extra {extra[:5]}")
        floor = max(NEGLIGIBLE_GRAD * ref_norm, 1e-12)
        worst = sorted(((name, _rel(params.get(name, 0.0), value, floor)) for name, value in ref_params.items()),
                       key=lambda item: -item[1])
        report.steps.append(StepDiff(step, loss, ref_loss, norm, ref_norm, tuple(worst)))
    return report


__all__ = ["ParityReport", "StepDiff", "compare_records", "tolerances"]
