"""The parity check's library part: record a run and compare two records.

::

    from lightning_para.cli.parity import compare   # runs the config twice (the command's Python side)

    report = compare("recipes/gpt-cpu-demo.yaml", "tp=2,pp=2", steps=20)
    print(report.text())          # per-step loss / gradient-norm differences, verdict
    assert report.verdict == "match", report.offending_parameters()

or ``lightning-para parity --config X.yaml --layout "tp=2,pp=2" --steps 20``. See
``docs/planner.md`` ("Is my layout numerically right?").

This package holds what runs inside a training run or after it: :class:`ParityRecorder` (a
callback), :class:`RunRecord`, :func:`compare_records` and the layouts' arguments
(:func:`strategy_arguments`). Running configs (``compare``, ``record_run``, ``run_layout``) is the
command's job (:mod:`lightning_para.cli.parity`): it needs the LightningCLI runner, and library
code never imports ``cli/``. Not inside ``lightning_para.plan`` either: the planner is a pure cost
model below the strategy, and the recorder reads the strategy's record of the layout.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".record": ("ParityRecorder", "RunRecord"),
    ".report": ("ParityReport", "StepDiff", "compare_records", "tolerances"),
    ".run": ("strategy_arguments",),
})
