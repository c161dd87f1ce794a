"""``Cluster`` (the machines) and ``Training`` (the run): the planner's two other inputs.

Bytes per parameter by precision (what lightning-para's ``ParaPrecision`` keeps; the ZeRO
paper's mixed-precision Adam, Rajbhandari et al. 2020 Sec. 3.1, is ``bf16-true``):

============  =======  =====  ==========  ===========  =========================================
precision     weights  grads  fp32 master  activations  note
============  =======  =====  ==========  ===========  =========================================
32-true       4        4      0            4            the weights are the fp32 master
bf16-mixed    4        4      0            2            fp32 weights, bf16 autocast compute
16-mixed      4        4      0            2            as bf16-mixed, with loss scaling
bf16-true     2        2      4            2            ZeRO's K = 12 with Adam: 4 + 8
16-true       2        2      4            2            as bf16-true, in fp16
============  =======  =====  ==========  ===========  =========================================

Optimizer state per parameter, fp32: Adam 8 bytes (two moments), SGD 4 (momentum).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from lightning_para.spec.options import PRECISIONS, choices_text
from lightning_para.plan.gemm import MEASURED_GEMMS, MEASURED_PEAK_FLOPS, Gemm, GemmModel, gpu_gemm_model

OPTIMIZERS = ("adam", "sgd", "muon")
# fp32 state bytes per parameter; Muon's 4 are its matrices' momentum (AdamW's 8 for the rest: plan/shape.py).
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 4, "muon": 4}


# Whose saved tensors the activation model counts (see `Training.activation_profile`).
ACTIVATION_PROFILES = ("torch", "megatron")


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each tensor kind under one precision."""

    weight: int
    grad: int
    master: int
    activation: int
    autocast: bool  # weights are cast to 16 bits on the fly (bf16-mixed, 16-mixed)


_PRECISION_BYTES = {
    "32-true": PrecisionBytes(4, 4, 0, 4, False),
    "bf16-mixed": PrecisionBytes(4, 4, 0, 2, True),
    "16-mixed": PrecisionBytes(4, 4, 0, 2, True),
    "bf16-true": PrecisionBytes(2, 2, 4, 2, False),
    "16-true": PrecisionBytes(2, 2, 4, 2, False),  # ParaPrecision: fp16 weights, fp32 masters under ZeRO
}
assert set(_PRECISION_BYTES) == set(PRECISIONS), "the planner must price every precision ParaStrategy has"


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    bad_type = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if bad_type or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"`{name}={value!r}` must be {kind}.")


# Per-GPU figures: memory one process can allocate, dense bf16 peak FLOP/s, and one direction of
# NVLink (intra) and of the GPU's network adapter (inter), in bytes/s. Vendor datasheets (H100/H800/A100 SXM).
# Memory: what one process can allocate after the driver's reserve and the CUDA context, measured on the lent H100
# and H200 (docs/planner.md, "Published runs"); the other presets keep their datasheet figures.
# * h100: H100 SXM5 80 GB, 989 TFLOP/s dense BF16, NVLink 4 900 GB/s bidirectional (450 one
#   way), one 400 Gb/s ConnectX-7 (50 GB/s) per GPU (NVIDIA H100 datasheet; DGX H100).
# * h100-96gb: the 96 GB HBM2e H100 of Meta's Grand Teton hosts that torchtitan benchmarks on
#   (pytorch/torchtitan docs/performance.md: 96 GB, 400 Gb/s RDMA per GPU, 500 W). Its peak is
#   "between SXM and NVL" and unpublished; torchtitan's MFU uses the SXM figure, and so do we.
# * h200: H200 SXM 141 GB HBM3e, same compute and NVLink as H100 SXM (NVIDIA H200 datasheet).
# * b200: B200 192 GB HBM3e (HGX B200), 2.25 PFLOP/s dense BF16 (4.5 with sparsity), NVLink 5
#   1.8 TB/s bidirectional (900 GB/s one way), ConnectX-7 400 Gb/s per GPU (NVIDIA DGX B200 datasheet).
#
# Element-wise bandwidth (`elementwise_bandwidth`: eager torch code's norms, casts, SwiGLU products, residual adds and
# AdamW), measured on the lent H100 and H200 (benchmarks/gpu_step_model.py; docs/planner.md, "On a GPU"); the other
# presets keep the H100's fraction of their datasheet bandwidth (read them as +-20%).
_H100_ELEMENTWISE = 2.55e12
_H200_ELEMENTWISE = 3.05e12
_HBM_FRACTION = _H100_ELEMENTWISE / 3.35e12
GPU_SPECS: dict[str, dict[str, float]] = {
    "h100": {"memory_bytes": 84.37e9, "peak_flops": 989e12, "intra_node_bw": 450e9, "inter_node_bw": 50e9,
             "elementwise_bandwidth": _H100_ELEMENTWISE},
    "h100-96gb": {"memory_bytes": 96e9, "peak_flops": 989e12, "intra_node_bw": 450e9, "inter_node_bw": 50e9,
                  "elementwise_bandwidth": _H100_ELEMENTWISE},
    "h200": {"memory_bytes": 149.46e9, "peak_flops": 989e12, "intra_node_bw": 450e9, "inter_node_bw": 50e9,
             "elementwise_bandwidth": _H200_ELEMENTWISE},
    "b200": {"memory_bytes": 192e9, "peak_flops": 2250e12, "intra_node_bw": 900e9, "inter_node_bw": 50e9,
             "elementwise_bandwidth": 8.0e12 * _HBM_FRACTION},
    "h800": {"memory_bytes": 80e9, "peak_flops": 989e12, "intra_node_bw": 200e9, "inter_node_bw": 50e9,
             "elementwise_bandwidth": 3.35e12 * _HBM_FRACTION},
    "a100-80gb": {"memory_bytes": 80e9, "peak_flops": 312e12, "intra_node_bw": 300e9, "inter_node_bw": 25e9,
                  "elementwise_bandwidth": 2.039e12 * _HBM_FRACTION},
    "a100-40gb": {"memory_bytes": 40e9, "peak_flops": 312e12, "intra_node_bw": 300e9, "inter_node_bw": 25e9,
                  "elementwise_bandwidth": 1.555e12 * _HBM_FRACTION},
}

# What a multi-GPU run loses beyond one GPU's GEMMs and element-wise bytes, as a factor on the matmul rate
# (`Cluster.at_scale_efficiency`): the published runs' former single efficiency, 0.5, over the measured GEMM efficiency
# it stood for; its derivation and the measurement that agrees with it: docs/planner.md, "Matmul efficiency by GPU".
PUBLISHED_RUNS_EFFICIENCY = 0.5
MEASURED_LLAMA_GEMM_EFFICIENCY = statistics.median(
    g.flops / g.seconds / MEASURED_PEAK_FLOPS for g in MEASURED_GEMMS["h100"] if 16384 in (g.m, g.k))
AT_SCALE_EFFICIENCY: dict[str, float] = {gpu: PUBLISHED_RUNS_EFFICIENCY / MEASURED_LLAMA_GEMM_EFFICIENCY for gpu in GPU_SPECS}


@dataclass(frozen=True)
class Cluster:
    """The machines.

    Args:
        nodes, gpus_per_node: the world is ``nodes * gpus_per_node`` GPUs.
        memory_bytes: memory of one GPU (the planner's limit, less ``reserved_bytes``).
        peak_flops: dense 16-bit peak FLOP/s of one GPU.
        intra_node_bw, inter_node_bw: bytes/s one GPU sends in one direction inside a node
            (NVLink) and to other nodes (its network adapter).
        efficiency: the fraction of ``peak_flops`` the model's matmuls reach, one figure for every shape; used when
            ``gemm`` is None (``--efficiency``, ``Cluster.of(gpu, efficiency=...)``, a hand-built cluster).
        gemm: the processor's GEMM time by shape (:mod:`lightning_para.plan.gemm`): the GPU presets' is fitted to the
            GEMMs measured on the lent H100 and H200; ``lightning-para calibrate`` fits this machine's. The matmul
            efficiency is then each of the model's GEMMs priced by its ``(m, n, k)`` (:meth:`matmul_efficiency`).
        at_scale_efficiency: what a multi-GPU run's step loses beyond one GPU's GEMMs and element-wise bytes, as a
            factor on the matmul rate, applied with ``gemm`` when the world has more than one GPU. Not a measured
            term: the part of the former global 0.5 the GEMM curve does not explain (see :data:`AT_SCALE_EFFICIENCY`).
        intra_node_latency, inter_node_latency: seconds per message hop (alpha of the
            alpha-beta model, Hockney 1994), paid ``n - 1`` times by ring collectives.
        reserved_bytes: memory the framework keeps per GPU (CUDA context, allocator slack).
        reduce_scatter_by_send_recv: the processes talk over gloo, which has no reduce-scatter: ZeRO-1/2
            reduce-scatter each gradient bucket by one send and one receive per peer (a ring's bytes,
            ``parallel/data/layout.py``). ``local_cluster`` sets it for CPU runs.
        op_seconds: fixed seconds per eager aten operator (dispatcher, autograd, launch), added
            to the step per operator (:mod:`lightning_para.plan.overhead`). 0 for the GPU presets
            (launches overlap the device's queue); ``local_cluster`` sets it on CPU from the
            calibration.
        dtensor_op_seconds: fixed seconds per operator that goes through DTensor's dispatch (sharding
            propagation, redistribution, wrapping) under tensor parallelism, counted separately from
            ``op_seconds`` (:mod:`lightning_para.plan.overhead`). 0 for the GPU presets; calibrated on CPU.
        step_overhead_seconds: fixed seconds per optimizer step outside the model's operators (Lightning's
            loop, hooks, callbacks and logging, the strategy's step). 0 for the GPU presets, where it overlaps
            the device's queue; calibrated on CPU (``lightning-para calibrate``).
        elementwise_bandwidth: bytes/s the non-matmul operators (norms, activations, residual adds, casts,
            the optimizer's arithmetic) read and write; their traffic (:mod:`lightning_para.plan.overhead`)
            over it is added to the step of eager torch code (``activation_profile="torch"``). 0: not priced.
            Measured on an H100 for the GPU presets (see :data:`GPU_SPECS`), where it was 28% of a step of
            Llama 3 8B's layers; calibrated on CPU, where it was a third of a step's compute on the README demo.
        dtensor_optimizer_op_seconds: fixed seconds per DTensor operator of the optimizer step (elementwise
            updates with cached sharding, a quarter of a block's on CPU); 0: ``dtensor_op_seconds`` is used.
        efficiency_by_tokens: ``((tokens, efficiency), ...)`` measured at several microbatch sizes (rows of
            the matmuls): the efficiency at a rank's tokens per microbatch is interpolated in ``log(tokens)``
            between them and held at the ends (:meth:`matmul_efficiency`). Empty (the GPU presets):
            ``efficiency`` at every size. Calibrated on CPU, where two threads speed up 1,024-token matmuls
            and barely 256-token ones. With ``gemm`` (a calibration that timed the GEMM curve): the fraction of the
            curve's rate at the calibration model's own GEMMs that the real model's matmuls reached.
    """

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    efficiency: float = 0.5
    intra_node_latency: float = 2e-6
    inter_node_latency: float = 8e-6
    reserved_bytes: float = 0.0
    reduce_scatter_by_send_recv: bool = False
    op_seconds: float = 0.0
    dtensor_op_seconds: float = 0.0
    step_overhead_seconds: float = 0.0
    elementwise_bandwidth: float = 0.0
    dtensor_optimizer_op_seconds: float = 0.0
    efficiency_by_tokens: tuple[tuple[float, float], ...] = ()
    gemm: Optional[GemmModel] = None
    at_scale_efficiency: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("nodes", self.nodes, integer=True)
        _check_positive("gpus_per_node", self.gpus_per_node, integer=True)
        for name in ("memory_bytes", "peak_flops", "intra_node_bw", "inter_node_bw"):
            _check_positive(name, getattr(self, name))
        for name in ("efficiency", "at_scale_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"`{name}={getattr(self, name)!r}` must be in (0, 1].")
        for name in ("intra_node_latency", "inter_node_latency", "reserved_bytes", "op_seconds", "dtensor_op_seconds",
                     "step_overhead_seconds", "elementwise_bandwidth", "dtensor_optimizer_op_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}={value!r}` must be a number >= 0.")
        for tokens, efficiency in self.efficiency_by_tokens:
            if not (tokens > 0 and 0 < efficiency <= 1):
                raise ValueError(f"`efficiency_by_tokens` has ({tokens}, {efficiency}): tokens must be > 0 and the"
                                 " efficiency in (0, 1].")
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(f"`reserved_bytes={self.reserved_bytes}` leaves no memory of {self.memory_bytes}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def matmul_efficiency(self, tokens: float, gemms: tuple[Gemm, ...] = ()) -> float:
        """The fraction of ``peak_flops`` matmuls over ``tokens`` rows reach. With ``gemm`` and the model's ``gemms``
        (:func:`~lightning_para.plan.gemm.model_gemms`): their FLOP-weighted efficiency on the GEMM curve, times
        ``efficiency_by_tokens`` (then the real model's fraction of the curve) and ``at_scale_efficiency`` when the
        world has several GPUs. Else ``efficiency_by_tokens`` interpolated in ``log(tokens)`` and held at the ends,
        or ``efficiency``."""
        if self.gemm is not None and gemms:
            residual = self._by_tokens(tokens) if self.efficiency_by_tokens else 1.0
            at_scale = self.at_scale_efficiency if self.world_size > 1 else 1.0
            return min(1.0, self.gemm.efficiency_of(gemms) * residual * at_scale)
        return self._by_tokens(tokens) if self.efficiency_by_tokens else self.efficiency

    def _by_tokens(self, tokens: float) -> float:
        points = sorted(self.efficiency_by_tokens)
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, e0), (t1, e1) in zip(points, points[1:]):
            if tokens <= t1:
                return e0 + (e1 - e0) * math.log(tokens / t0) / math.log(t1 / t0)
        return points[-1][1]

    @property
    def usable_memory(self) -> float:
        """What a rank may fill: ``memory_bytes - reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    @classmethod
    def of(cls, gpu: str, nodes: int, gpus_per_node: int = 8, **overrides: Any) -> "Cluster":
        """A cluster of a known GPU (see :data:`GPU_SPECS`) with its GEMM curve (:mod:`lightning_para.plan.gemm`) and
        :data:`AT_SCALE_EFFICIENCY`; any field can be overridden. ``efficiency=`` replaces the curve by that one
        figure (``lightning-para plan --efficiency``)."""
        if gpu not in GPU_SPECS:
            raise ValueError(f"`gpu={gpu!r}` is unknown. Choose one of {choices_text(GPU_SPECS)}, or build Cluster(...).")
        specs = GPU_SPECS[gpu]
        curve: dict[str, Any] = {}
        if "efficiency" not in overrides:
            curve = {"gemm": gpu_gemm_model(gpu, overrides.get("peak_flops", specs["peak_flops"]),
                                            overrides.get("elementwise_bandwidth", specs["elementwise_bandwidth"])),
                     "at_scale_efficiency": AT_SCALE_EFFICIENCY[gpu]}
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, **{**specs, **curve, **overrides})


@dataclass(frozen=True)
class Training:
    """The run.

    Args:
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step, over all data-parallel ranks.
        batch_per_rank: instead of ``global_batch``: sequences each data-parallel rank loads per
            batch (a per-device ``batch_size``), so the global batch grows with ``dp``; implies
            ``micro_batch=None``.
        micro_batch: sequences per forward pass (one pipeline microbatch). ``None``: as a
            Lightning run under ParaStrategy does it: each data-parallel rank loads
            ``global_batch / (accumulation * dp)`` sequences per batch and the pipeline splits
            that batch into its ``microbatches`` (default ``pp * virtual_stages``).
        accumulation: batches per optimizer step (Lightning's ``accumulate_grad_batches``);
            used with ``micro_batch=None``.
        precision: one of :data:`~lightning_para.spec.options.PRECISIONS` (ParaStrategy's).
        optimizer: ``"adam"``, ``"sgd"`` (with momentum) or ``"muon"`` (``lightning_para.optim.Muon``: one
            momentum for the hidden matrices, AdamW's two moments for the rest; its routing all-to-alls).
        flash_attention: attention does not store its ``a s^2`` scores (FlashAttention or
            PyTorch SDPA); ``False`` is Megatron-LM's 2022 baseline.
        activation_profile: whose code's saved tensors the activations count (measured
            by ``lightning-para dryrun``): ``"torch"`` (default) -- ParaStrategy's, as torchtitan's:
            DTensor sequence parallelism keeps the q/k/v, MLP and output projections' inputs
            all-gathered, an unfused SwiGLU keeps 4 ``f``-wide tensors, a ``*-true`` run's
            cross-entropy keeps 16-bit log-probabilities; ``"megatron"`` -- Megatron-LM's
            (Korthikanti et al. 2022): sharded inputs, fused SwiGLU (3), fp32 cross-entropy.
        fp32_grad_accumulation: gradients accumulate over the microbatches, and are reduced, in
            fp32 whatever the weights' dtype (the Llama 3 paper, Sec. 3.3.2, "Numerical stability":
            FP32 gradient accumulation and FP32 reduce-scatter; Megatron-LM's ``main_grad``).
            Planner-only: ParaStrategy accumulates in the gradients' dtype of ``precision``.
        persistent_grad_buffer: the gradients live in one buffer allocated once and zeroed in place (Megatron-LM's
            ``DistributedDataParallel`` grad buffer), so a pipeline rank holds all of them from the schedule's first
            forward. ``False`` (torch's DDP and FSDP, ParaStrategy): autograd allocates them at each chunk's first
            backward, later than the activations' peak in GPipe and in a fully warmed-up interleaved schedule
            (:func:`~lightning_para.plan.pipeline.lazy_gradient_peak`).

    Each data-parallel rank runs ``global_batch / (dp * micro_batch)`` microbatches per step
    (:meth:`microbatches_per_step`): the pipeline's microbatches times gradient accumulation.
    """

    seq_len: int
    global_batch: Optional[int] = None
    micro_batch: Optional[int] = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adam"
    flash_attention: bool = True
    accumulation: int = 1
    activation_profile: str = "torch"
    batch_per_rank: Optional[int] = None
    fp32_grad_accumulation: bool = False
    persistent_grad_buffer: bool = False

    def __post_init__(self) -> None:
        if (self.global_batch is None) == (self.batch_per_rank is None):
            raise ValueError("Give exactly one of `global_batch` (sequences per step) and `batch_per_rank`.")
        if self.batch_per_rank is not None:
            _check_positive("batch_per_rank", self.batch_per_rank, integer=True)
            object.__setattr__(self, "micro_batch", None)
        for name in ("seq_len", "accumulation") + (("global_batch",) if self.global_batch is not None else ()):
            _check_positive(name, getattr(self, name), integer=True)
        if self.micro_batch is not None:
            _check_positive("micro_batch", self.micro_batch, integer=True)
        elif self.global_batch is not None and self.global_batch % self.accumulation:
            raise ValueError(
                f"`accumulation={self.accumulation}` must divide `global_batch={self.global_batch}` (batches per step)."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision={self.precision!r}` is unknown. Choose one of {choices_text(PRECISIONS)}.")
        if self.activation_profile not in ACTIVATION_PROFILES:
            raise ValueError(
                f"`activation_profile={self.activation_profile!r}` is unknown. Choose one of {choices_text(ACTIVATION_PROFILES)}."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"`optimizer={self.optimizer!r}` is unknown. Choose one of {choices_text(OPTIMIZERS)}.")
        if self.micro_batch is not None and self.global_batch % self.micro_batch:  # type: ignore[operator]
            raise ValueError(f"`micro_batch={self.micro_batch}` must divide `global_batch={self.global_batch}`.")

    @property
    def bytes(self) -> PrecisionBytes:
        """Bytes per weight, gradient, master and activation element."""
        return _PRECISION_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element while accumulating and reducing (``fp32_grad_accumulation``: 4)."""
        return 4 if self.fp32_grad_accumulation else self.bytes.grad

    @property
    def optimizer_state_bytes(self) -> int:
        """fp32 optimizer state per parameter (masters not included)."""
        return OPTIMIZER_STATE_BYTES[self.optimizer]

    @property
    def tokens_per_step(self) -> int:
        if self.global_batch is None:
            raise ValueError("`batch_per_rank` gives a global batch only for a layout; see `resolve_batch`.")
        return self.global_batch * self.seq_len

    def batch_label(self) -> str:
        """``"global batch 64"`` or ``"batch 8 per data-parallel rank"``."""
        if self.global_batch is None:
            return f"batch {self.batch_per_rank} per data-parallel rank"
        return f"global batch {self.global_batch}"

    def microbatches_per_step(self, dp: int) -> int:
        """Microbatches each data-parallel rank runs per optimizer step; ``ValueError`` if ``dp``
        and ``micro_batch`` do not divide ``global_batch`` (``micro_batch`` must be set)."""
        if self.micro_batch is None or self.global_batch is None:
            raise ValueError("`micro_batch=None` depends on the layout's pipeline microbatches; see `resolve_batch`.")
        if self.global_batch % (dp * self.micro_batch):
            raise ValueError(
                f"`global_batch={self.global_batch}` is not divisible by dp * micro_batch = {dp} * {self.micro_batch}."
            )
        return self.global_batch // (dp * self.micro_batch)
