"""Calibrate the planner's step-time model on this machine, once, and cache it.

The CPU figures of :data:`~lightning_para.calibrate.machine.CPU_PROCESS` are nominal; on a real machine the
step-time prediction was off by 165% (README demo). :func:`calibrate` measures, for one thread
budget (``torch.get_num_threads()`` of a rank):

* the matmul FLOP/s one rank reaches: the median of ``repeats`` timed ``n x n`` fp32 matmuls
  (``2 n^3`` FLOPs each, after a warm-up);
* gloo's all-reduce on 2 processes: the median time of each message size, fitted to the
  alpha-beta model the planner uses (Hockney 1994; ring all-reduce on ``p = 2`` ranks:
  ``t = 2 (p-1) alpha + 2 (p-1)/p n / beta = 2 alpha + n / beta``) by least squares;
* the fixed cost of one eager aten operator (dispatcher, autograd, launch): a chain of
  operators on 8 x 8 tensors (where arithmetic is negligible), forward and backward, timed
  and divided by the aten operators it dispatched (counted with ``TorchDispatchMode``);
  :mod:`lightning_para.plan.overhead` multiplies it by the operators of a step;
* the bandwidth of the non-matmul operators (norms, activations, residual adds, the optimizer's
  element-wise arithmetic): a chain of those on activation-sized tensors (a norm on 1,024 x 128, a
  gated activation on 1,024 x 384: the README demo's sizes), forward and backward, its bytes read
  and written (counted with :class:`~lightning_para.instrument.operators.TrafficCounter`) over its time less its operators' fixed cost;
  freshly allocated outputs, as in a step, so page faults and cache misses are in the figure;
  :mod:`lightning_para.plan.overhead` multiplies it by a step's traffic;
* the matmul efficiency: the fraction of that FLOP/s a real model's matmuls and attention reach, from
  one training step of a plain model (``lightning-para calibrate``: two blocks of the GPT recipe at
  4 x 64 and 16 x 64 tokens) less its operators' fixed cost and its element-wise bytes; what a square
  matmul does not show (smaller and skinnier shapes, CPU attention kernels, caches shared with other
  ranks) is in it, and the planner interpolates between the two sizes;
* the fixed cost of one operator through DTensor's dispatch (tensor parallelism): blocks of a
  sequence-parallel norm, a column- and a row-parallel linear (torch's own TP styles) on a 2-rank
  mesh of torch's fake process group (collectives return at once, so only the CPU-side cost is
  timed; the planner prices the bytes separately); forward + backward and the AdamW step are timed
  apart (on this VM ~240 and ~64 us per operator: one average mispriced both), each less its plain
  operators at the figure above, divided by the operators DTensor dispatched in it.

**Under load.** A run's ranks fill the machine's cores, and cores share caches, memory bandwidth and
(on a VM) physical cores: on the development VM one rank's transformer block ran 1.37x slower while a
second process ran beside it. So the per-rank figures (matmul, operator, bandwidth, DTensor's dispatch)
are measured in ``cores // threads`` processes at once, started together, and their medians kept.

Medians of repeats keep one preempted run (a loaded machine) from skewing the figure. Each measurement runs in
processes of its own (:func:`~lightning_para.calibrate.processes.run_measurement`: the fake process group and gloo
are process-wide); the record and its cache are :mod:`lightning_para.calibrate.cache`'s.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_para.calibrate.gemm_curve import GEMM_CURVE_SHAPES, GemmShapes, measure_gemm_curve, median_seconds
from lightning_para.calibrate.processes import measurement_context, run_measurement
from lightning_para.instrument.operators import DTensorOpCounter, TrafficCounter

__all__ = ["EFFICIENCY_BATCHES", "EFFICIENCY_SEQ_LEN", "fit_alpha_beta", "measure_dtensor_op_costs",
           "measure_dtensor_op_seconds", "measure_elementwise_bandwidth", "measure_gemm_curve", "measure_gloo",
           "measure_matmul_efficiency", "measure_matmul_flops", "measure_rank_gemms", "GEMM_CURVE_SHAPES", "measure_op_seconds", "measure_rank_rates", "synthetic_tp_workload"]


def measure_matmul_flops(threads: Optional[int] = None, size: int = 512, repeats: int = 7) -> float:
    """Median FLOP/s of ``repeats`` fp32 ``size x size`` matmuls under ``threads`` intra-op threads."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        calls = max(1, int(2e8 // (2 * size**3)))  # ~0.2 GFLOP per sample
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            times.append((time.perf_counter() - start) / calls)
    finally:
        torch.set_num_threads(before)
    return 2.0 * size**3 / statistics.median(times)


def _op_chain(x: torch.Tensor, w: torch.Tensor, links: int) -> torch.Tensor:
    # The block's kinds of operators: a norm (pow, mean, rsqrt, mul), a matmul, views, an activation.
    for _ in range(links):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = torch.nn.functional.silu((x @ w).view(-1, 8)) + x.transpose(0, 1)
    return x.sum()


def measure_op_seconds(threads: Optional[int] = None, links: int = 50, repeats: int = 7) -> float:
    """Median seconds per aten operator of a chain of tiny operators, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        _op_chain(x, w, links).backward()  # warm-up
        with _Count() as counter:
            _op_chain(x, w, links).backward()
        seconds = median_seconds(lambda: _op_chain(x, w, links).backward(), repeats)
    finally:
        torch.set_num_threads(before)
    return seconds / counter.ops


def _elementwise_chain(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # A layer's kinds of non-matmul operators: an RMS norm, a gated activation, a residual add.
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    return (normed + x).sum() + (torch.nn.functional.silu(gate) * up).sum()


def measure_elementwise_bandwidth(threads: Optional[int] = None, tokens: int = 1024, width: int = 128,
                                  repeats: int = 9, op_seconds: Optional[float] = None) -> float:
    """Bytes/s of the non-matmul operators: :func:`_elementwise_chain` forward and backward on ``tokens x width``
    and ``tokens x 3 width`` fp32 tensors, its bytes (:class:`TrafficCounter`) over its median time less its
    operators' fixed cost (``op_seconds``, measured when not given)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        leaves = [torch.randn(tokens, width), torch.randn(width), torch.randn(tokens, 3 * width),
                  torch.randn(tokens, 3 * width)]
        leaves = [t.requires_grad_() for t in leaves]

        def run() -> None:
            _elementwise_chain(*leaves).backward()
            for t in leaves:
                t.grad = None  # fresh gradients every time, as a step allocates them

        run()  # warm-up
        with TrafficCounter() as counter:
            run()
        seconds = median_seconds(run, repeats)
        fixed = counter.ops * (op_seconds if op_seconds is not None else measure_op_seconds(threads))
    finally:
        torch.set_num_threads(before)
    return counter.bytes / max(seconds - fixed, 1e-9)


# Microbatch sizes (sequences of 64 tokens) the matmul efficiency is measured at: the rows of a small CPU
# run's matmuls, from a pipeline's or tensor-parallel rank's microbatch to a whole batch on one process.
EFFICIENCY_BATCHES = (4, 16)
EFFICIENCY_SEQ_LEN = 64


def measure_matmul_efficiency(workload: Callable[[int, int], Callable[[], None]], batch: int, flops: float,
                              op_seconds: float, bandwidth: float, repeats: int = 9) -> float:
    """The fraction of the ``flops`` rate a real model's matmuls reach: ``workload(batch, seq_len)`` returns a
    training step (forward and backward) of a plain model on ``batch`` sequences of :data:`EFFICIENCY_SEQ_LEN`
    tokens; its matmul and attention FLOPs
    (``FlopCounterMode``), operators and element-wise bytes (:class:`TrafficCounter`) are counted, and what its
    median time leaves after the operators' fixed cost and the bytes at ``bandwidth`` is the matmuls' time.
    Clamped to [0.05, 1]."""
    return _matmul_efficiency_and_shapes(workload, batch, flops, op_seconds, bandwidth, repeats)[0]


def _matmul_efficiency_and_shapes(workload: Callable[[int, int], Callable[[], None]], batch: int, flops: float,
                                  op_seconds: float, bandwidth: float, repeats: int = 9,
                                  ) -> tuple[float, list[tuple[int, int, int, int]]]:
    """:func:`measure_matmul_efficiency` and the ``(m, n, k, count)`` of the step's matmuls (its GEMMs on the curve)."""
    from torch.utils.flop_counter import FlopCounterMode

    step = workload(batch, EFFICIENCY_SEQ_LEN)
    step()  # warm-up
    gemms = GemmShapes()
    with gemms.mode:
        step()
    with FlopCounterMode(display=False) as flop_counter, TrafficCounter() as traffic:
        step()
    matmul_seconds = median_seconds(step, repeats) - traffic.ops * op_seconds - traffic.bytes / bandwidth
    efficiency = flop_counter.get_total_flops() / max(matmul_seconds, 1e-9) / flops
    return min(1.0, max(0.05, efficiency)), gemms.shapes


def _rank_rates_worker(threads: int, start_together: Any, workload: Optional[Callable[[int, int], Callable[[], None]]],
                       out: Any) -> None:
    torch.set_num_threads(threads)
    start_together.wait()  # every process measures while the others do: the machine as loaded as in a run
    op_seconds = measure_op_seconds(threads)
    flops = measure_matmul_flops(threads)
    bandwidth = measure_elementwise_bandwidth(threads, op_seconds=op_seconds)
    gemm_curve = measure_gemm_curve(threads)
    efficiencies = tuple(_matmul_efficiency_and_shapes(workload, batch, flops, op_seconds, bandwidth)
                         for batch in EFFICIENCY_BATCHES) if workload is not None else ()
    out.put((flops, op_seconds, bandwidth, efficiencies, gemm_curve))


def measure_rank_rates(threads: int, processes: int = 1, timeout: float = 300.0,
                       workload: Optional[Callable[[int, int], Callable[[], None]]] = None,
                       ) -> tuple[float, float, float, tuple[tuple[float, float], ...]]:
    """``(matmul FLOP/s, seconds per operator, element-wise bytes/s, ((tokens, matmul efficiency), ...))`` of one
    rank with ``threads`` intra-op threads while ``processes`` such ranks run at once (each measured in a
    fresh process; medians across them). The efficiencies are :func:`measure_matmul_efficiency` on
    ``workload`` (a picklable module-level function of the batch and sequence length) at :data:`EFFICIENCY_BATCHES` sequences of
    :data:`EFFICIENCY_SEQ_LEN` tokens; none without a workload. :func:`measure_rank_gemms` adds the GEMM curve."""
    return measure_rank_gemms(threads, processes, timeout, workload)[:4]  # type: ignore[return-value]


def measure_rank_gemms(threads: int, processes: int = 1, timeout: float = 300.0,
                       workload: Optional[Callable[[int, int], Callable[[], None]]] = None,
                       ) -> tuple[float, float, float, tuple[tuple[float, float], ...], list[list[float]],
                                  dict[float, list[tuple[int, int, int, int]]]]:
    """:func:`measure_rank_rates`, then this rank's GEMM curve (:func:`measure_gemm_curve`: ``[[m, n, k, seconds],
    ...]``, medians across the processes) and the workload's matmul shapes per tokens (``{tokens: [(m, n, k,
    count), ...]}``: where the measured efficiencies sit on that curve)."""
    start_together = measurement_context().Barrier(processes)
    results = run_measurement(_rank_rates_worker, [(threads, start_together, workload)] * processes, timeout,
                              "one rank's matmul, operator and bandwidth figures", results=processes)
    flops, op_seconds, bandwidth = (statistics.median(r[i] for r in results) for i in range(3))
    curve = tuple((float(batch * EFFICIENCY_SEQ_LEN), statistics.median(r[3][k][0] for r in results))
                  for k, batch in enumerate(EFFICIENCY_BATCHES)) if workload is not None else ()
    shapes = {float(batch * EFFICIENCY_SEQ_LEN): results[0][3][k][1]
              for k, batch in enumerate(EFFICIENCY_BATCHES)} if workload is not None else {}
    gemm_curve = [[*results[0][4][i][:3], statistics.median(r[4][i][3] for r in results)]
                  for i in range(len(results[0][4]))]
    return flops, op_seconds, bandwidth, curve, gemm_curve, shapes


class _SequenceParallelBlock(torch.nn.Module):
    """``x + down(silu(up(norm(x))))``: a transformer MLP's kinds of DTensor operators under TP + SP."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def synthetic_tp_workload() -> tuple[Callable[[], None], Callable[[], None]]:
    """``(forward and backward, optimizer step)`` of blocks of a sequence-parallel RMSNorm, a column- and a row-parallel linear (torch's own TP
    styles) on a 2-rank mesh; called once the (fake) process group exists. Its DTensor operators are cheap
    ones (cached sharding propagation, no views or attention): ``lightning-para calibrate`` measures the
    GPT recipe's block instead, whose operator counts the planner uses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(*[_SequenceParallelBlock() for _ in range(8)])
    for block in model:
        parallelize_module(block, mesh, {
            "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = DTensor.from_local(torch.randn(2, 8, 8), mesh, [Shard(1)]).requires_grad_()

    def forward_backward() -> None:
        model(x).to_local().sum().backward()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return forward_backward, optimizer_step


def _dtensor_worker(threads: int, workload: Callable[[], tuple[Callable[[], None], Callable[[], None]]],
                    repeats: int, start_together: Any, out: Any) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend (no network)

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # the fake collectives leave their outputs uninitialised
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        phases = workload()  # (forward and backward, optimizer step)
        for phase in phases:
            phase()  # warm-up: sharding propagation caches
        start_together.wait()
        counters = []
        for phase in phases:
            with DTensorOpCounter() as counter:
                phase()
            counters.append(counter)
        # Alternately, as in training: the optimizer step needs the gradients of a backward (its zero_grad
        # drops them, and AdamW skips parameters without one).
        times: list[list[float]] = [[], []]
        for _ in range(repeats):
            for k, phase in enumerate(phases):
                start = time.perf_counter()
                phase()
                times[k].append(time.perf_counter() - start)
        seconds = [statistics.median(t) for t in times]
        plain_seconds = measure_op_seconds(threads)
        # Per phase: its DTensor operators cost apart (a block's views and redistributions 2-4x an optimizer's
        # elementwise update on this VM), so one average would misprice both.
        out.put(tuple(max(0.0, t - c.plain * plain_seconds) / max(1, c.dtensor) for t, c in zip(seconds, counters)))
    finally:
        dist.destroy_process_group()


def measure_dtensor_op_costs(threads: Optional[int] = None, repeats: int = 9, timeout: float = 180.0,
                             workload: Optional[Callable[[], tuple[Callable[[], None], Callable[[], None]]]] = None,
                             processes: int = 1) -> tuple[float, float]:
    """``(seconds per DTensor operator in forward and backward, in the optimizer step)``: ``workload()`` (default
    :func:`synthetic_tp_workload`; a picklable module-level function that builds a tensor-parallel model on a
    2-rank mesh and returns its ``(forward and backward, optimizer step)``) timed phase by phase on torch's fake
    process group, in a process of its own (the fake group is process-wide), each phase less its plain
    operators at :func:`measure_op_seconds`, divided by the operators DTensor dispatched in it. ``processes``
    copies run at once (a loaded machine, see the module docstring); the medians of theirs are returned."""
    start_together = measurement_context().Barrier(processes)
    args = (threads or torch.get_num_threads(), workload or synthetic_tp_workload, repeats, start_together)
    found = run_measurement(_dtensor_worker, [args] * processes, timeout, "DTensor's dispatch", results=processes)
    return float(statistics.median(f[0] for f in found)), float(statistics.median(f[1] for f in found))


def measure_dtensor_op_seconds(threads: Optional[int] = None, repeats: int = 9, timeout: float = 180.0,
                               workload: Optional[Callable[[], tuple[Callable[[], None], Callable[[], None]]]] = None,
                               processes: int = 1) -> float:
    """Median seconds per DTensor operator in forward and backward (:func:`measure_dtensor_op_costs`)."""
    return measure_dtensor_op_costs(threads, repeats, timeout, workload, processes)[0]


def _gloo_worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fastest = []
        for nbytes in sizes:
            x = torch.zeros(max(1, nbytes // 4))
            dist.all_reduce(x)  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - start)
            # The fastest repeat, not the median: on a shared machine preemption only ever adds time, and a
            # median of a few repeats under load can make a 4 KiB all-reduce slower than a 1 MiB one.
            fastest.append(min(times))
        if rank == 0:
            out.put(fastest)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_gloo(sizes: tuple[int, ...] = (4096, 65536, 1 << 20, 4 << 20), repeats: int = 9,
                 timeout: float = 120.0) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of gloo's all-reduce between 2 local processes."""
    port = _free_port()
    seconds = run_measurement(_gloo_worker, [(r, port, sizes, repeats) for r in range(2)], timeout,
                              "gloo's all-reduce")
    return fit_alpha_beta(sizes, seconds)


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` from all-reduce times of 2 ranks: least squares ``t = 2 alpha + n / beta``.

    When noise makes the fitted slope non-positive (a small message timed slower than a large one), the
    slope says nothing about bandwidth; the largest message's bytes over its time is then used instead,
    a lower bound on the bandwidth (it includes the latency), and the latency is the smallest time / 2.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 (size, seconds) pairs, got {len(sizes)} and {len(seconds)}")
    n_mean, t_mean = statistics.fmean(sizes), statistics.fmean(seconds)
    cov = sum((n - n_mean) * (t - t_mean) for n, t in zip(sizes, seconds))
    var = sum((n - n_mean) ** 2 for n in sizes)
    slope = cov / var if var > 0 else 0.0
    if slope <= 0:
        largest = max(range(len(sizes)), key=lambda i: sizes[i])
        return sizes[largest] / max(seconds[largest], 1e-12), min(seconds) / 2.0
    intercept = max(t_mean - slope * n_mean, 0.0)
    return 1.0 / slope, intercept / 2.0
