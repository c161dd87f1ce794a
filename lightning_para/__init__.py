"""lightning-para: scale a LightningModule over data, tensor, pipeline and expert parallelism.

``Trainer(strategy=ParaStrategy(dp=..., tp=8, pp=4, ep=..., zero=1))`` -- importing this
package also registers ``Trainer(strategy="para")`` (and ``"para_zero1"``/``2``/``3``), and the same
names for Fabric (``L.Fabric(strategy="para")``: :class:`lightning_para.fabric.ParaStrategy`).
The package map is in ``docs/architecture.md``.

The public facade, and it loads nothing (``import lightning_para.plan`` and ``lightning-para plan --help`` import
no Lightning and no runtime): each name below is imported on first use; the registration waits for Lightning to
create its registries (now, if it already has); the built-in integrations (transformers: its expert-parallel
adapter and checkpoint record; LitGPT: its tensor-, context- and expert-parallel adapters and checkpoint record)
are imported when a registry is first read (:mod:`lightning_para.spec.plugins`). Generic code never imports an
integration; transformers and litgpt themselves stay optional.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from lightning_para.spec.lazy import lazy_face
from lightning_para.spec.plugins import add_plugins

__version__ = "0.1.0"

add_plugins("lightning_para.integrations.transformers", "lightning_para.integrations.litgpt")

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".checkpoint": ("ParaModelCheckpoint", "consolidate_checkpoint"),
    ".compat": ("grad_norm",),
    ".config": ("ParallelConfig",),
    ".mesh": ("ParallelDims",),
    ".observe": ("ParaProfiler",),
    ".parallel.pipeline": ("PipelineSpec",),
    ".parallelize": ("ParallelModel", "parallelize"),
    ".precision": ("ParaPrecision",),
    ".reliability": ("ResumableDataLoader",),
    ".strategy": ("ParaStrategy",),
})
__all__ += ["__version__"]

# Lightning's strategy registries -> (the registry's name in its module, the front end "para" builds there).
_REGISTRIES = {
    "lightning.pytorch.strategies": ("StrategyRegistry", "lightning_para.strategy"),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", "lightning_para.fabric.strategy"),
}


def _build(front_end: str, **kwargs: Any) -> Any:
    """What Lightning's registry calls for ``"para"``: the front end's ``ParaStrategy``, imported then."""
    return importlib.import_module(front_end).ParaStrategy(**kwargs)


def _register(module: Any) -> None:
    registry_name, front_end = _REGISTRIES[module.__name__]
    registry = getattr(module, registry_name)
    if "para" in registry:
        return
    build = functools.partial(_build, front_end)
    registry.register("para", build, description="lightning-para: ZeRO/TP/PP/EP on one DeviceMesh")
    for stage in (1, 2, 3):
        registry.register(f"para_zero{stage}", build, description=f"lightning-para with ZeRO stage {stage}", zero=stage)


class _RegisterAfter:
    """A registry module's loader (the one its finder gave) that registers ``"para"`` once the module has run."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # create_module, get_code, is_package, ...: the loader's
        return getattr(self.loader, name)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _register(module)


class _RegistryWatch:
    """Finds Lightning's registry modules as the other finders do, with a loader that registers after them."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _REGISTRIES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


for _name in set(_REGISTRIES) & set(sys.modules):
    _register(sys.modules[_name])
if not all(name in sys.modules for name in _REGISTRIES):
    sys.meta_path.insert(0, _RegistryWatch())
