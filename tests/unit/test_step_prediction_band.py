"""The demo's step time calibrated inside the run: its first warm steps scale the planner's figure, the rest is judged
against the band repeated runs measured (``IN_RUN_STEP_BAND``, benchmarks/results/step_prediction_cpu.md)."""

from __future__ import annotations

from lightning_para.instrument.compare import IN_RUN_STEP_BAND, Comparison, PredictionCheck


def test_the_first_warm_steps_calibrate_the_rest():
    check = PredictionCheck("tp2 pp2", [Comparison(0, "step", "step", 0.5, 0.26)])
    steps = [0.25] * 10 + [0.26] * 20
    assert check.in_run_step_band(steps) == ("calibrated on the first 10 warm steps (the model x 0.50): the rest"
                                             " predicted 250 ms (band 112-388 ms), measured 260 ms: inside")


def test_a_run_that_slows_down_past_the_band_is_reported_outside():
    """Planted: the host's load doubles after the calibration steps; the report must say so, not hide it."""
    check = PredictionCheck("x", [Comparison(0, "step", "step", 0.5, 0.5)])
    slowed = [0.25] * 10 + [0.25 * (1 + IN_RUN_STEP_BAND) + 0.01] * 20
    assert check.in_run_step_band(slowed).endswith(": OUTSIDE")


def test_too_few_steps_or_no_prediction_print_nothing():
    check = PredictionCheck("x", [Comparison(0, "step", "step", 0.5, 0.5)])
    assert check.in_run_step_band([0.25] * 12) is None
    assert PredictionCheck("x", [Comparison(0, "memory", "params", 1.0, 1.0)]).in_run_step_band([0.25] * 30) is None
