"""The lazy package faces (``spec/lazy.py``) keep what the eager ones gave: ``Trainer(strategy="para")`` and Fabric's
``"para"`` after ``import lightning_para`` in either import order, the built-in integrations' adapters once a registry
is read, and the public names (``lightning_para.parallelize`` the function, whatever imported its module first).

Each case runs in a fresh interpreter: what a process imported first is the point.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
{imports}
assert not any(m.split(".")[0] == "lightning" for m in sys.modules) or {lightning_first}
from lightning.pytorch import Trainer
import lightning as L
trainer = Trainer(strategy="para_zero2", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
import lightning_para.parallelize
from lightning_para import ParaStrategy, parallelize
assert callable(parallelize) and parallelize.__name__ == "parallelize", parallelize
assert isinstance(trainer.strategy, ParaStrategy) and trainer.strategy.config.zero == 2, trainer.strategy
from lightning_para.fabric import ParaStrategy as FabricParaStrategy
fabric = L.Fabric(strategy="para", accelerator="cpu", devices=1)
assert isinstance(fabric.strategy, FabricParaStrategy), fabric.strategy
from lightning_para.parallel.expert.adapters import expert_adapters
from lightning_para.parallel.tensor.adapters import tensor_parallel_adapter
names = [a.name for a in expert_adapters()]
assert "lightning_para.integrations.transformers" in sys.modules and "lightning_para.integrations.litgpt" in sys.modules
print("ok", names)
"""


@functools.lru_cache(maxsize=None)
def _import_order_outputs() -> dict[bool, tuple[int, str, str]]:
    """Each import order's fresh interpreter, both started at once when the first case asks (the suite runs one test
    at a time, and an interpreter keeps one core busy): ``{lightning_first: (exit code, stdout, stderr)}``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for first in (False, True):
        imports = "import lightning.pytorch\nimport lightning_para" if first else "import lightning_para"
        procs[first] = subprocess.Popen([sys.executable, "-c", CHECK.format(imports=imports, lightning_first=first)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    outputs = {first: proc.communicate(timeout=600) for first, proc in procs.items()}
    return {first: (procs[first].returncode, *outputs[first]) for first in procs}


@pytest.mark.parametrize("lightning_first", [False, True])
def test_strategy_names_and_integrations_in_either_import_order(lightning_first):
    code, out, err = _import_order_outputs()[lightning_first]
    assert code == 0, err[-3000:]
    assert out.startswith("ok") and len(out.split("[", 1)[1]) > 2, out  # the integrations registered experts
