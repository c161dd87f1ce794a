"""The parity check as a user tool: does a layout train a model like one device?

::

    from lightning_para.parity import compare

    report = compare("recipes/gpt-cpu-demo.yaml", "tp=2,pp=2", steps=20)
    print(report.text())          # per-step loss / gradient-norm differences, verdict
    assert report.verdict == "match", report.offending_parameters()

or ``lightning-para parity --config X.yaml --layout "tp=2,pp=2" --steps 20``. See
``docs/planner.md`` ("Is my layout numerically right?").

Why a package of its own, not ``lightning_para.plan``: the planner is a pure cost model that
``ParaStrategy(layout="auto")`` and the profiler import; the parity tool *runs* training (the
LightningCLI, the strategy, subprocesses), so inside ``plan`` it would close an import cycle
(strategy -> plan -> parity -> strategy).
"""

from lightning_para.parity.record import ParityRecorder, RunRecord, record_run
from lightning_para.parity.report import ParityReport, StepDiff, compare_records, tolerances
from lightning_para.parity.run import compare, run_layout, strategy_arguments

__all__ = [
    "ParityRecorder", "ParityReport", "RunRecord", "StepDiff", "compare", "compare_records", "record_run",
    "run_layout", "strategy_arguments", "tolerances",
]
