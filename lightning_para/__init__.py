"""lightning-para: scale a LightningModule over data, tensor, pipeline and expert parallelism.

``Trainer(strategy=ParaStrategy(dp=..., tp=8, pp=4, ep=..., zero=1))`` -- importing this
package also registers ``Trainer(strategy="para")`` (and ``"para_zero1"``/``2``/``3``), and the same
names for Fabric (``L.Fabric(strategy="para")``: :class:`lightning_para.fabric.ParaStrategy`).
The package map is in ``docs/architecture.md``.

This module is the public facade, the one place that wires the built-in integrations in: importing
:mod:`lightning_para.integrations.transformers` registers its expert-parallel adapter and its
checkpoint record, :mod:`lightning_para.integrations.litgpt` its tensor-, context- and expert-parallel
adapters and its checkpoint record (generic code never imports an integration; transformers and litgpt
themselves stay optional).
"""

__version__ = "0.1.0"

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_para.checkpoint import ParaModelCheckpoint, consolidate_checkpoint
from lightning_para.compat import grad_norm
from lightning_para.config import ParallelConfig
from lightning_para.fabric import ParaStrategy as _FabricParaStrategy
from lightning_para.integrations import litgpt as _litgpt_integration  # noqa: F401  (registers)
from lightning_para.integrations import transformers as _transformers_integration  # noqa: F401  (registers)
from lightning_para.mesh import ParallelDims
from lightning_para.observe import ParaProfiler
from lightning_para.parallel.pipeline import PipelineSpec
from lightning_para.parallelize import ParallelModel, parallelize
from lightning_para.precision import ParaPrecision
from lightning_para.reliability import ResumableDataLoader
from lightning_para.strategy import ParaStrategy

if "para" not in StrategyRegistry:
    ParaStrategy.register_strategies(StrategyRegistry)
if "para" not in _FABRIC_STRATEGIES:
    _FabricParaStrategy.register_strategies(_FABRIC_STRATEGIES)

__all__ = [
    "ParaModelCheckpoint",
    "ParaPrecision",
    "ParaProfiler",
    "ParaStrategy",
    "ParallelConfig",
    "ParallelDims",
    "ParallelModel",
    "PipelineSpec",
    "ResumableDataLoader",
    "__version__",
    "consolidate_checkpoint",
    "grad_norm",
    "parallelize",
]
