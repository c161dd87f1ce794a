"""The dry run: one rank of an N-rank job, the real code on torch's fake process group and the meta device.

It sits above :func:`~lightning_para.parallelize.parallelize` (it calls it, as ``ParaStrategy`` does):
:mod:`.world` (the fake world and the lifts for meta), :mod:`.kernels` (the fused kernels' saved tensors),
:mod:`.step` (one rank's forwards and backwards), :mod:`.rank` (:func:`dry_run_rank`: the driver and the
record). What it counts, and the planner's prediction beside it, are :mod:`lightning_para.instrument`'s.
The command line is ``lightning-para dryrun``.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".rank": ("RankDryRun", "dry_run_rank"),
    ".step": ("causal_lm_step_loss",),
    ".world": ("start_fake_world",),
})
