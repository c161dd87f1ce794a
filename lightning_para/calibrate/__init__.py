"""Machine calibration: measure this machine once, cache it, and describe it to the planner.

* :mod:`.measure`: the measurements (matmul FLOP/s and efficiency, an operator's fixed cost, element-wise
  bandwidth, DTensor's dispatch, gloo's alpha-beta), each in processes of its own (:mod:`.processes`);
* :mod:`.cache`: the record (:class:`Calibration`), its cache and :func:`calibrate`;
* :mod:`.machine`: this machine as the planner's ``Cluster`` (:func:`local_cluster`), the cache's figures
  when there are some;
* :mod:`.traffic`: the non-matmul bytes of a model, fitted to the planner's traffic coefficients.

A package of its own, above the planner and the instrumentation layer: it starts processes and runs
models, which the pure cost model (``plan/``) never does; ``plan/`` only reads the figures it produces
(as :class:`~lightning_para.plan.cluster.Cluster` fields). The command line is ``lightning-para calibrate``.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".machine": ("CPU_PROCESS", "UNKNOWN_GPU_LINKS", "detect_peak_flops", "device_memory_bytes", "local_cluster"),
    ".cache": ("Calibration", "cache_path", "cached_calibration", "calibrate", "machine_key"),
    ".measure": ("EFFICIENCY_BATCHES", "GEMM_CURVE_SHAPES", "EFFICIENCY_SEQ_LEN", "fit_alpha_beta",
        "measure_dtensor_op_costs", "measure_dtensor_op_seconds", "measure_elementwise_bandwidth", "measure_gloo",
        "measure_matmul_efficiency", "measure_matmul_flops", "measure_op_seconds", "measure_gemm_curve",
        "measure_rank_gemms", "measure_rank_rates", "synthetic_tp_workload"),
    ".processes": ("run_measurement",),
})
