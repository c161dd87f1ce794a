"""Lightning's strategy contracts that ParaStrategy keeps, beyond its own dimensions.

* :mod:`.configured` -- what the user's ``configure_model`` already parallelized (TP with
  ``parallelize_module``, FSDP2 with ``fully_shard``), checked against the degrees, so
  :func:`~lightning_para.parallelize` applies only what is left;
* :mod:`.grads` -- ``grad_norm``: Lightning's utility of the same name, for gradients that
  are DTensors (ZeRO-1/2/3, tensor parallel).
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".configured": ("UserParallelism", "detect_user_parallelism"),
    ".grads": ("grad_norm",),
})
