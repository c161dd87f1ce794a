"""Lightning's strategy contracts that ParaStrategy keeps, beyond its own dimensions.

* :mod:`.configured` -- what the user's ``configure_model`` already parallelized (TP with
  ``parallelize_module``, FSDP2 with ``fully_shard``), checked against the degrees, so
  :func:`~lightning_para.parallelize` applies only what is left;
* :mod:`.grads` -- ``grad_norm``: Lightning's utility of the same name, for gradients that
  are DTensors (ZeRO-1/2/3, tensor parallel).
"""

from lightning_para.compat.configured import UserParallelism, detect_user_parallelism
from lightning_para.compat.grads import grad_norm

__all__ = ["UserParallelism", "detect_user_parallelism", "grad_norm"]
