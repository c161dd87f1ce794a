"""lightning-para for Lightning Fabric: ``from lightning_para.fabric import ParaStrategy``.

``L.Fabric(strategy=ParaStrategy(tp=2, zero=3))``, or ``L.Fabric(strategy="para")`` /
``"para_zero1".."para_zero3"`` (registered in Fabric's strategy registry on import of
``lightning_para``). The same layouts, arguments and errors as the Trainer's
:class:`lightning_para.ParaStrategy`, over the same engine (:mod:`lightning_para.core`);
``docs/fabric.md`` shows a LitGPT-style loop.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".precision": ("FabricParaPrecision",),
    ".strategy": ("ParaStrategy",),
})
