"""The framework-neutral core both front ends drive: :class:`ParaEngine` (``engine.py``).

The Trainer's ``ParaStrategy`` (``lightning_para/strategy.py``) and Fabric's
(``lightning_para/fabric/``) are adapters: each translates its framework's hooks into the
engine's calls, and neither implements a dimension itself. Both take their arguments from
:class:`~lightning_para.core.front_end.ParaFrontEnd` (``front_end.py``).
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".engine": ("ParaEngine",),
})
