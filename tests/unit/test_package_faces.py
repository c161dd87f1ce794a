"""The lazy package faces (``spec/lazy.py``) keep what the eager ones gave: ``Trainer(strategy="para")`` and Fabric's
``"para"`` after ``import lightning_para`` in either import order, the built-in integrations' adapters once a registry
is read, and the public names (``lightning_para.parallelize`` the function, whatever imported its module first).

Each case runs in a fresh interpreter: what a process imported first is the point.
"""

from __future__ import annotations

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


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("lightning_first", [False, True])
def test_strategy_names_and_integrations_in_either_import_order(lightning_first):
    imports = "import lightning.pytorch\nimport lightning_para" if lightning_first else "import lightning_para"
    out = _run(CHECK.format(imports=imports, lightning_first=lightning_first))
    assert out.startswith("ok") and len(out.split("[", 1)[1]) > 2, out  # the integrations registered experts
