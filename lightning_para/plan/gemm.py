"""Matmul efficiency by GPU and shape: a GEMM's time from its ``(m, n, k)``, anchored on measured GEMMs.

A ``m x k`` by ``k x n`` GEMM does ``F = 2 m n k`` FLOPs. Its time on one GPU (:meth:`GemmModel.seconds`) is a fixed
cost plus the larger of its compute and its memory time, ``t0 + max(compute, memory)``:

* **compute**: ``F / (peak x plateau x waves(m, n))``:

  - ``plateau``: the fraction of the dense peak a large GEMM sustains (clocks under the power limit,
    the tensor cores' issue rate);
  - ``waves(m, n)``: wave quantization. The output is cut into ``tile_m x tile_n`` tiles, one per
    streaming multiprocessor at a time. ``t`` tiles on ``s`` SMs run in ``ceil(t / s)`` waves, and a tile
    computes its whole area even where the output ends inside it; so the useful fraction of the SMs' work is
    ``m n / (ceil(t / s) s tile_m tile_n)`` (NVIDIA's "Matrix Multiplication Background" user guide, "Wave
    quantization"). A GEMM's time therefore never falls as ``m``, ``n`` or ``k`` grow;
* **memory**: ``bytes / bandwidth``, the roofline bound (Williams et al. 2009). It reads both
  operands and writes the output once, ``e (m k + k n + m n)`` bytes. It binds small-``m`` and
  small-``k`` shapes: an expert's few tokens, a decoding step;
* ``t0``: the fixed seconds of one GEMM call (launch, pipeline fill and drain, the epilogue's writes), added once
  -- not spread over the waves, or a GEMM with few tiles would take longer than a larger one.

The measured GEMMs (:data:`MEASURED_GEMMS`) are this module's data: per GPU, the shapes timed on the lent machines
and the records they come from. :func:`fit_gemm_model` fits ``plateau`` and ``t0`` to measured GEMMs by least
squares (``lightning-para calibrate``'s CPU curve). The GPU presets take ``t0 = 0``
(:func:`gpu_gemm_model`): the isolated GEMMs were each timed alone between two synchronizations, so their
intercept (about 110 us on the H100) holds the host's launch and synchronization, which a training step overlaps;
the matmul kernels the profiler timed inside the recorded steps show no fixed cost at these sizes (docs/planner.md,
"Matmul efficiency"). All measured GEMMs have 8,192 rows or more: below that the curve extrapolates.
``lightning-para calibrate`` times this machine's GEMMs and fits the same curve (:mod:`lightning_para.calibrate`).

A training step runs three GEMMs per linear layer: the forward ``(m, n, k)``, the input gradient
``(m, k, n)`` and the weight gradient ``(k, n, m)``. :func:`model_gemms` lists a model's linear
layers at a microbatch's tokens, as a tensor-parallel rank runs them. :meth:`GemmModel.efficiency_of`
gives their FLOP-weighted efficiency: total FLOPs over total time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from lightning_para.plan.model import ModelDesc

BF16_BYTES = 2


@dataclass(frozen=True)
class Gemm:
    """One ``m x k`` by ``k x n`` product, run ``count`` times."""

    m: float
    n: float
    k: float
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def training(self) -> tuple["Gemm", "Gemm", "Gemm"]:
        """The forward, the input gradient ``(m, k, n)`` and the weight gradient ``(k, n, m)``."""
        return (self, Gemm(self.m, self.k, self.n, self.count), Gemm(self.k, self.n, self.m, self.count))


@dataclass(frozen=True)
class GemmMeasurement:
    """One timed GEMM: its shape, its median seconds, and the record it comes from."""

    m: int
    n: int
    k: int
    seconds: float
    source: str

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmModel:
    """A processor's GEMM time by shape (module docstring).

    Args:
        peak_flops: the dense 16-bit peak (a GPU preset's) or the peak the curve is expressed against.
        plateau: the fraction of ``peak_flops`` a large, wave-aligned GEMM sustains (above 1 when ``peak_flops`` is a
            measured reference rate that some shapes beat).
        fixed_seconds: ``t0``: the fixed seconds of one GEMM call.
        bandwidth: bytes/s the operands stream at (the roofline's memory bound); 0: no bound.
        units: streaming multiprocessors (wave quantization); 1 with ``tile = (1, 1)`` turns it off (CPU).
        tile: ``(tile_m, tile_n)`` output tile of one unit.
        element_bytes: bytes per operand element (2: bf16).
    """

    peak_flops: float
    plateau: float
    fixed_seconds: float = 0.0
    bandwidth: float = 0.0
    units: int = 1
    tile: tuple[int, int] = (1, 1)
    element_bytes: int = BF16_BYTES

    def __post_init__(self) -> None:
        # `plateau` may exceed 1 when `peak_flops` is a measured rate, not a datasheet peak (a CPU calibration's
        # square matmul, timed while other processes ran, against GEMMs that fit its caches better).
        if not (self.peak_flops > 0 and self.plateau > 0 and self.fixed_seconds >= 0 and self.bandwidth >= 0):
            raise ValueError(f"GemmModel needs peak_flops > 0, plateau > 0, fixed_seconds >= 0 and bandwidth >= 0;"
                             f" got {self.peak_flops}, {self.plateau}, {self.fixed_seconds}, {self.bandwidth}.")
        if self.units < 1 or min(self.tile) < 1:
            raise ValueError(f"GemmModel needs units >= 1 and tile sides >= 1; got {self.units}, {self.tile}.")

    def wave_fraction(self, m: float, n: float) -> float:
        """Useful fraction of the SMs' work: ``m n / (ceil(tiles / units) units tile_m tile_n)`` (whole tiles, whole
        waves)."""
        tiles = math.ceil(m / self.tile[0]) * math.ceil(n / self.tile[1])
        return m * n / (math.ceil(tiles / self.units) * self.units * self.tile[0] * self.tile[1])

    def seconds(self, gemm: Gemm) -> float:
        """One GEMM's time (times its ``count``): its fixed cost plus the larger of its compute and its operands'
        bytes."""
        flops = 2.0 * gemm.m * gemm.n * gemm.k
        compute = flops / (self.peak_flops * self.plateau * self.wave_fraction(gemm.m, gemm.n))
        memory = (self.element_bytes * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n) / self.bandwidth
                  if self.bandwidth else 0.0)
        return (self.fixed_seconds + max(compute, memory)) * gemm.count

    def efficiency(self, m: float, n: float, k: float) -> float:
        """The fraction of ``peak_flops`` one ``(m, n, k)`` GEMM reaches."""
        gemm = Gemm(m, n, k)
        return gemm.flops / self.seconds(gemm) / self.peak_flops

    def efficiency_of(self, gemms: Iterable[Gemm], training: bool = True) -> float:
        """The FLOP-weighted efficiency of a training step's GEMMs: each of ``gemms`` (forward shapes) with its two
        backward products (``training=False``: ``gemms`` as they are), total FLOPs over total seconds."""
        flops = seconds = 0.0
        for forward in gemms:
            for gemm in (forward.training() if training else (forward,)):
                flops += gemm.flops
                seconds += self.seconds(gemm)
        return flops / seconds / self.peak_flops if seconds else self.plateau


def fit_gemm_model(measurements: Sequence[GemmMeasurement], peak_flops: float, bandwidth: float = 0.0,
                   units: int = 1, tile: tuple[int, int] = (1, 1), fixed_seconds: Optional[float] = None,
                   element_bytes: int = BF16_BYTES) -> GemmModel:
    """The :class:`GemmModel` whose compute time best fits ``measurements``: least squares on
    ``t = t0 + x / plateau`` with ``x = F / (peak x waves)``, linear in ``t0`` and ``1 / plateau``.
    ``fixed_seconds`` given (or fewer than two distinct sizes measured): only ``plateau`` is fitted, as the median
    ratio. The roofline's ``bandwidth`` is not fitted: the measured shapes are compute-bound."""
    if not measurements:
        raise ValueError("fit_gemm_model needs at least one GemmMeasurement.")
    shape = GemmModel(peak_flops, 1.0, 0.0, 0.0, units, tile, element_bytes)
    xs = [g.flops / (peak_flops * shape.wave_fraction(g.m, g.n)) for g in measurements]
    ys = [g.seconds for g in measurements]
    if fixed_seconds is None and len({round(g.flops) for g in measurements}) >= 2:
        x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
        slope = (sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys))
                 / sum((x - x_mean) ** 2 for x in xs))
        intercept = y_mean - slope * x_mean
        if slope > 0 and intercept >= 0:
            return GemmModel(peak_flops, 1.0 / slope, intercept, bandwidth, units, tile, element_bytes)
        fixed_seconds = 0.0  # noise made the fixed cost negative: a plateau alone
    fixed = fixed_seconds or 0.0
    plateau = statistics.median(x / (y - fixed) for x, y in zip(xs, ys) if y > fixed)
    return GemmModel(peak_flops, plateau, fixed, bandwidth, units, tile, element_bytes)


def model_gemms(model: "ModelDesc", tokens: float, tp: int = 1, ep: int = 1) -> tuple[Gemm, ...]:
    """The forward GEMMs of ``model``'s linear layers at ``tokens`` rows per microbatch, as one tensor-parallel rank
    of ``tp`` runs them (column-parallel layers split ``n``, row-parallel ones ``k``; sequence parallelism gathers the
    rows first), each counted once per layer that has it. Routed experts: each of a rank's ``num_experts / ep``
    experts multiplies ``ep x tokens x top_k / num_experts`` rows (balanced routing, dropless). Attention's score
    products are not GEMMs of weights and are left out (the planner prices them at the same efficiency)."""
    h, q, kv = model.hidden, model.q_dim, model.kv_dim
    mlp_matrices = 3 if model.gated_mlp else 2
    moe_layers = model.num_moe_layers
    dense_layers = model.layers - moe_layers
    out = [Gemm(tokens, (q + 2 * kv) / tp, h, model.layers), Gemm(tokens, h, q / tp, model.layers)]
    if dense_layers:
        out += [Gemm(tokens, model.ffn / tp, h, (mlp_matrices - 1) * dense_layers),
                Gemm(tokens, h, model.ffn / tp, dense_layers)]
    if moe_layers:
        width = model.moe_ffn or model.ffn
        rows = max(1.0, ep * tokens * model.top_k / model.num_experts)
        experts = moe_layers * model.num_experts / ep
        out += [Gemm(rows, width / tp, h, (mlp_matrices - 1) * experts), Gemm(rows, h, width / tp, experts)]
        if model.shared_expert_ffn:
            shared = model.shared_expert_ffn
            out += [Gemm(tokens, shared / tp, h, (mlp_matrices - 1) * moe_layers),
                    Gemm(tokens, h, shared / tp, moe_layers)]
    out.append(Gemm(tokens, model.vocab / tp, h))
    return tuple(out)


# --- The measured GEMMs -------------------------------------------------------------------------------------------
# bf16 `x @ w`, `g @ w.t()` and `x.t() @ g` at Llama 3 8B's MLP widths (h = 4,096, f = 14,336), median of 7 after a
# warm-up (`benchmarks/gpu_step_model.py`, `matmul_efficiency`), on the lent machines, torch 2.11.0+cu130, 2026-11-26.
# Each triple is one record's forward, input-gradient and weight-gradient seconds;
# `tests/unit/test_gemm_model.py` checks them against the JSON records, so they cannot drift apart.
_H = 4096
_F = 14336


def _triple(tokens: int, seconds: tuple[float, float, float], source: str) -> tuple[GemmMeasurement, ...]:
    fwd, bwd_input, bwd_weight = seconds
    return (GemmMeasurement(tokens, _F, _H, fwd, source), GemmMeasurement(tokens, _H, _F, bwd_input, source),
            GemmMeasurement(_H, _F, tokens, bwd_weight, source))


_RESULTS = "benchmarks/results/"
MEASURED_GEMMS: dict[str, tuple[GemmMeasurement, ...]] = {
    # NVIDIA H100 80GB HBM3 (SXM, 700 W).
    "h100": (
        *_triple(16384, (2.4576130e-3, 2.4909730e-3, 2.4238070e-3), _RESULTS + "gpu_step_model_h100_l2.json"),
        *_triple(16384, (2.4715660e-3, 2.5489050e-3, 2.4808920e-3), _RESULTS + "gpu_step_model_h100_l4_bf16_mixed.json"),
        *_triple(16384, (2.4574590e-3, 2.4548170e-3, 2.4952620e-3), _RESULTS + "gpu_step_model_h100_l4_bf16_true.json"),
        *_triple(16384, (2.4192690e-3, 2.4457780e-3, 2.3859990e-3),
                 _RESULTS + "gpu_step_model_h100_heldout_layers4batch2recomputefull.json"),
        *_triple(8192, (1.3044300e-3, 1.2834120e-3, 1.2862300e-3),
                 _RESULTS + "gpu_step_model_h100_heldout_layers3batch1recomputenone.json"),
        *_triple(8192, (1.2968980e-3, 1.2782740e-3, 1.2999530e-3),
                 _RESULTS + "gpu_step_model_h100_heldout_layers3batch1recomputenoneprecisionbf16true.json"),
    ),
    # NVIDIA H200 (141 GB HBM3e, 700 W).
    "h200": _triple(16384, (2.4336480e-3, 2.4570240e-3, 2.4067880e-3), _RESULTS + "gpu_step_model_h200_l4.json"),
}

# Streaming multiprocessors per GPU (the datasheets / whitepapers: H100 SXM5 132, H200 132 (the same GH100), H800
# 132, A100 108, B200 148) and one output tile for all: 128 x 256. The recorded H100 step's cuBLAS kernels
# (`gpu_step_model_h100_l4_bf16_mixed.json`, top kernels) tile 320 x 128, 192 x 192 and 256 x 128; 128 x 256 has
# their size (32-41 K outputs), and cuBLAS picks among them per shape, which one fixed tile only approximates.
GPU_UNITS: dict[str, int] = {"h100": 132, "h100-96gb": 132, "h200": 132, "h800": 132, "b200": 148,
                             "a100-80gb": 108, "a100-40gb": 108}
GPU_TILE = (128, 256)

# Which measured GPU a preset's curve comes from. Measured: h100 and h200. The others borrow the H100's plateau, a
# fraction of *their own* peak (read as +-15%: not measured).
MEASURED_AS: dict[str, str] = {"h100": "h100", "h200": "h200", "h100-96gb": "h100", "h800": "h100", "b200": "h100",
                               "a100-80gb": "h100", "a100-40gb": "h100"}


# The dense bf16 peak the measured GPUs' fractions are taken against (H100 and H200 SXM datasheets).
MEASURED_PEAK_FLOPS = 989e12
# A GEMM's fixed seconds inside a training step on the GPU presets: none measurable at the recorded sizes (the
# matmul kernels the profiler timed in the recorded steps fit -95 us; the isolated timings' +110 us is the host's
# per-call launch and synchronization). docs/planner.md, "Matmul efficiency".
GPU_FIXED_SECONDS = 0.0


def gpu_gemm_model(gpu: str, peak_flops: float, bandwidth: float) -> GemmModel:
    """The GEMM curve of a GPU preset: ``plateau`` fitted to :data:`MEASURED_GEMMS` of the GPU it is measured as
    (:data:`MEASURED_AS`) with no fixed cost (:data:`GPU_FIXED_SECONDS`, module docstring), carried to the preset's
    own peak (the same fraction of it), SM count and memory bandwidth (the roofline)."""
    source = MEASURED_AS[gpu]
    fitted = fit_gemm_model(MEASURED_GEMMS[source], MEASURED_PEAK_FLOPS, units=GPU_UNITS[source], tile=GPU_TILE,
                            fixed_seconds=GPU_FIXED_SECONDS)
    return GemmModel(peak_flops, fitted.plateau, fitted.fixed_seconds, bandwidth, GPU_UNITS[gpu], GPU_TILE)


__all__ = ["GPU_FIXED_SECONDS", "GPU_TILE", "GPU_UNITS", "Gemm", "GemmMeasurement", "GemmModel", "MEASURED_AS", "MEASURED_GEMMS", "MEASURED_PEAK_FLOPS",
           "fit_gemm_model", "gpu_gemm_model", "model_gemms"]
