"""The front ends translate their framework's calls into the engine's lifecycle and nothing more: no front end
(``strategy.py``, ``fabric/``, the shared ``core/front_end.py``) touches the engine's run guard (step guard,
integrity checker) or data parallelism itself (``docs/architecture.md``, "The engine as a lifecycle").
Checked statically (``ast``): attribute reads and writes, not words in docstrings."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightning_para"
FRONT_ENDS = [ROOT / "strategy.py", ROOT / "core" / "front_end.py", *sorted((ROOT / "fabric").glob("*.py"))]
# What the engine owns and schedules: its run guard, the step guard in it, the integrity checker, data parallelism.
ENGINE_INTERNALS = {"run_guard", "guard", "integrity", "data_parallel"}


def reaches_into_the_engine(source: str) -> list[str]:
    """``line: .name`` for every attribute access of an engine internal in ``source``."""
    return [
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
    ]


def test_no_front_end_touches_the_engines_guard_integrity_or_data_parallelism():
    found = {str(path.relative_to(ROOT)): reaches_into_the_engine(path.read_text()) for path in FRONT_ENDS}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_scan_finds_a_front_end_scheduling_the_engines_checks_itself():
    # Planted: what the front ends did before the lifecycle (an integrity check scheduled in the front end,
    # the preemption stop read from the step guard, the accumulation policy taken from data parallelism).
    planted = """
def on_train_batch_start(self, batch, batch_idx):
    integrity = self.core.integrity
    if integrity is not None and integrity.due(step):
        self.check_integrity(step)
    if self.core.guard.stop_signal is not None:
        self.core.guard.stop_at_boundary(lambda: None)
    with self.parallel_model.data_parallel.accumulation_no_sync():
        pass
"""
    assert reaches_into_the_engine(planted) == ["3: .integrity", "6: .guard", "7: .guard", "8: .data_parallel"]
    # Words in a docstring or a comment are not access.
    assert reaches_into_the_engine('"""the step guard and data_parallel"""\n# core.guard\n') == []
