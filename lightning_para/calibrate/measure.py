"""Calibrate the planner's step-time model on this machine, once, and cache it (issue 23, item 3).

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

Medians of repeats keep one preempted run (a loaded machine) from skewing the figure. The result
is cached in ``~/.cache/lightning-para/calibration.json`` (``$LIGHTNING_PARA_CACHE`` to move it),
keyed by host, CPU model, torch version and thread count; :func:`cached_calibration` only reads
it, so ``local_cluster`` never measures inside a training run. Run
``lightning-para calibrate`` once per machine (or ``calibrate()``).

Why this module is long: it holds seven measurements (matmul, operator, bandwidth, efficiency, DTensor
dispatch, gloo, and the alpha-beta fit), all but the last run in processes of their own (the fake process group and gloo are
process-wide), plus the one runner that keeps a dying measurement process from hanging the caller.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_para.instrument.operators import DTensorOpCounter, TrafficCounter
from lightning_para.threads import available_cores

__all__ = ["Calibration", "measure_dtensor_op_costs", "measure_elementwise_bandwidth", "measure_matmul_efficiency",
           "measure_rank_rates", "cache_path", "cached_calibration", "calibrate", "machine_key", "measure_gloo",
           "measure_dtensor_op_seconds", "run_measurement", "synthetic_tp_workload", "measure_matmul_flops", "measure_op_seconds"]


def cache_path() -> Path:
    """``$LIGHTNING_PARA_CACHE/calibration.json`` (default ``~/.cache/lightning-para``)."""
    root = os.environ.get("LIGHTNING_PARA_CACHE", os.path.join("~", ".cache", "lightning-para"))
    return Path(root).expanduser() / "calibration.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> str:
    """What a calibration holds for: host, CPU model, torch version, intra-op threads per rank."""
    return f"{socket.gethostname()}|{_cpu_model()}|torch {torch.__version__}|threads {threads}"


@dataclass(frozen=True)
class Calibration:
    """Measured figures of one rank on this machine (see the module docstring)."""

    matmul_flops: float  # FLOP/s of one rank's fp32 matmuls under its thread budget
    bandwidth: float  # bytes/s, beta of the alpha-beta model (gloo, 2 processes)
    latency: float  # seconds per message hop, alpha
    threads: int
    key: str
    measured_at: float  # time.time()
    load: float  # 1-minute load average when measured
    op_seconds: Optional[float] = None  # seconds per eager aten operator (None: a cache from before it was measured)
    dtensor_op_seconds: Optional[float] = None  # seconds per operator through DTensor's dispatch (None: not measured)
    step_overhead_seconds: Optional[float] = None  # the training loop's fixed seconds per step (None: not measured)
    elementwise_bandwidth: Optional[float] = None  # bytes/s the non-matmul operators move (None: not measured)
    processes: int = 1  # processes measured at once (cores // threads: the machine as loaded as in a run)
    # [[tokens, fraction of matmul_flops a real model's matmuls reach at that microbatch], ...] (None: 1)
    matmul_efficiency: Optional[list[list[float]]] = None
    dtensor_optimizer_op_seconds: Optional[float] = None  # per DTensor operator of the optimizer step (None: not apart)

    def cluster_figures(self) -> dict[str, float]:
        """:class:`~lightning_para.plan.cluster.Cluster` fields: ``peak_flops`` is the square matmuls' rate and
        ``efficiency_by_tokens`` the fraction of it a real model's matmuls reached per microbatch size
        (``efficiency`` 1 when not measured)."""
        figures: dict[str, Any] = {
            "peak_flops": self.matmul_flops, "efficiency": 1.0, "intra_node_bw": self.bandwidth,
            "inter_node_bw": self.bandwidth, "intra_node_latency": self.latency, "inter_node_latency": self.latency,
        }
        if self.op_seconds is not None:
            figures["op_seconds"] = self.op_seconds
        if self.dtensor_op_seconds is not None:
            figures["dtensor_op_seconds"] = self.dtensor_op_seconds
        if self.dtensor_optimizer_op_seconds is not None:
            figures["dtensor_optimizer_op_seconds"] = self.dtensor_optimizer_op_seconds
        if self.step_overhead_seconds is not None:
            figures["step_overhead_seconds"] = self.step_overhead_seconds
        if self.elementwise_bandwidth is not None:
            figures["elementwise_bandwidth"] = self.elementwise_bandwidth
        if self.matmul_efficiency:
            figures["efficiency_by_tokens"] = tuple((float(t), float(e)) for t, e in self.matmul_efficiency)
            figures["efficiency"] = min(e for _, e in figures["efficiency_by_tokens"])
        return figures


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


def _median_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``run`` (a preempted call skews a median less than a mean)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
        seconds = _median_seconds(lambda: _op_chain(x, w, links).backward(), repeats)
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
        seconds = _median_seconds(run, repeats)
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
    from torch.utils.flop_counter import FlopCounterMode

    step = workload(batch, EFFICIENCY_SEQ_LEN)
    step()  # warm-up
    with FlopCounterMode(display=False) as flop_counter, TrafficCounter() as traffic:
        step()
    matmul_seconds = _median_seconds(step, repeats) - traffic.ops * op_seconds - traffic.bytes / bandwidth
    efficiency = flop_counter.get_total_flops() / max(matmul_seconds, 1e-9) / flops
    return min(1.0, max(0.05, efficiency))


def _rank_rates_worker(threads: int, start_together: Any, workload: Optional[Callable[[int, int], Callable[[], None]]],
                       out: Any) -> None:
    torch.set_num_threads(threads)
    start_together.wait()  # every process measures while the others do: the machine as loaded as in a run
    op_seconds = measure_op_seconds(threads)
    flops = measure_matmul_flops(threads)
    bandwidth = measure_elementwise_bandwidth(threads, op_seconds=op_seconds)
    efficiencies = tuple(measure_matmul_efficiency(workload, batch, flops, op_seconds, bandwidth)
                         for batch in EFFICIENCY_BATCHES) if workload is not None else ()
    out.put((flops, op_seconds, bandwidth, efficiencies))


def measure_rank_rates(threads: int, processes: int = 1, timeout: float = 300.0,
                       workload: Optional[Callable[[int, int], Callable[[], None]]] = None,
                       ) -> tuple[float, float, float, tuple[tuple[float, float], ...]]:
    """``(matmul FLOP/s, seconds per operator, element-wise bytes/s, ((tokens, matmul efficiency), ...))`` of one
    rank with ``threads`` intra-op threads while ``processes`` such ranks run at once (each measured in a
    fresh process; medians across them). The efficiencies are :func:`measure_matmul_efficiency` on
    ``workload`` (a picklable module-level function of the batch and sequence length) at :data:`EFFICIENCY_BATCHES` sequences of
    :data:`EFFICIENCY_SEQ_LEN` tokens; none without a workload."""
    start_together = _measurement_context().Barrier(processes)
    results = run_measurement(_rank_rates_worker, [(threads, start_together, workload)] * processes, timeout,
                              "one rank's matmul, operator and bandwidth figures", results=processes)
    flops, op_seconds, bandwidth = (statistics.median(r[i] for r in results) for i in range(3))
    curve = tuple((float(batch * EFFICIENCY_SEQ_LEN), statistics.median(r[3][k] for r in results))
                  for k, batch in enumerate(EFFICIENCY_BATCHES)) if workload is not None else ()
    return flops, op_seconds, bandwidth, curve


class _SequenceParallelBlock(torch.nn.Module):
    """``x + down(silu(up(norm(x))))``: a transformer MLP's kinds of DTensor operators under TP + SP."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _measurement_context() -> Any:
    """Where measurement processes come from: a fork server that imports torch and this module once, so each
    process starts in about a second instead of a new interpreter's ~10 s on two busy cores (torch and Lightning
    imported again each time); spawn where the platform has no fork server. Each process is still fresh: its
    threads, its (fake) process group and its measurements are its own."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])  # no effect once the server runs (e.g. the test harness's)
    return context


def run_measurement(target: Callable[..., None], args_per_process: Sequence[tuple[Any, ...]], timeout: float,
                    what: str, results: Optional[int] = None) -> Any:
    """Start one fresh process (:func:`_measurement_context`) per ``args_per_process`` entry running
    ``target(*args, queue)``, and return
    the first thing one of them puts on the queue (``results=k``: a list of the first ``k`` things). Never
    waits on a dead process: if every process has exited without the results, or ``timeout`` seconds pass,
    it raises :class:`RuntimeError` naming ``what`` (the children's own error is on stderr)."""
    import queue as queue_module

    ctx = _measurement_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out), daemon=True) for args in args_per_process]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    wanted, got = results or 1, []
    try:
        while len(got) < wanted:
            try:
                got.append(out.get(timeout=0.5))
                continue
            except queue_module.Empty:
                pass
            if all(not proc.is_alive() for proc in procs):
                try:  # results put just before the processes exited
                    while len(got) < wanted:
                        got.append(out.get(timeout=1.0))
                    break
                except queue_module.Empty:
                    codes = [proc.exitcode for proc in procs]
                    raise RuntimeError(f"Calibrating {what} failed: its process exited with {codes} without a"
                                       " result (its error is printed above).") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"Calibrating {what} took more than {timeout:.0f} s; is the machine overloaded?")
        return got if results is not None else got[0]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


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
    start_together = _measurement_context().Barrier(processes)
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


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_calibration(threads: Optional[int] = None, path: Optional[Path] = None) -> Optional[Calibration]:
    """The cached calibration of this machine for ``threads`` (default: this process's), or ``None``."""
    threads = threads or torch.get_num_threads()
    entry = _load(path or cache_path()).get(machine_key(threads))
    return Calibration(**entry) if entry else None


def calibrate(threads: Optional[int] = None, *, path: Optional[Path] = None, refresh: bool = False,
              measure_comm: bool = True, measure_dtensor: bool = True,
              dtensor_workload: Optional[Callable[[], tuple[Callable[[], None], Callable[[], None]]]] = None,
              step_overhead: Optional[Callable[[int], float]] = None,
              compute_workload: Optional[Callable[[int, int], Callable[[], None]]] = None) -> Calibration:
    """Measure this machine (see the module docstring) unless cached, cache it and return it.

    ``measure_comm=False`` / ``measure_dtensor=False`` skip the two measurements that start processes
    of their own (gloo's sweep: nominal figures instead; DTensor's dispatch: not calibrated).
    ``dtensor_workload``: the tensor-parallel ``(forward and backward, optimizer step)`` DTensor's dispatch is timed
    on (see :func:`measure_dtensor_op_costs`; ``lightning-para calibrate`` passes the GPT recipe's).
    ``step_overhead(threads)``: measures the training loop's fixed seconds per step (the planner sits below
    the strategy, so ``lightning-para calibrate`` passes a Lightning run's); not measured without it.
    ``compute_workload(batch, seq_len)``: a plain model's training step whose matmuls set ``matmul_efficiency`` at
    :data:`EFFICIENCY_BATCHES` (:func:`measure_matmul_efficiency`; ``lightning-para calibrate`` passes the GPT
    recipe's); 1 without it."""
    threads = threads or torch.get_num_threads()
    path = path or cache_path()
    if not refresh:
        found = cached_calibration(threads, path)
        if found is not None:
            return found
    processes = max(1, available_cores() // threads)  # the ranks of a run that fills this machine
    flops, op_seconds, bandwidth_elementwise, curve = measure_rank_rates(threads, processes, workload=compute_workload)
    dtensor_op_seconds, dtensor_optimizer_op_seconds = (
        measure_dtensor_op_costs(threads, workload=dtensor_workload, processes=processes)
        if measure_dtensor else (None, None))
    step_overhead_seconds = step_overhead(threads) if step_overhead is not None else None
    bandwidth, latency = measure_gloo() if measure_comm else (2e9, 5e-5)
    result = Calibration(
        matmul_flops=flops, bandwidth=bandwidth, latency=latency, threads=threads, key=machine_key(threads),
        measured_at=time.time(), load=os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
        op_seconds=op_seconds, dtensor_op_seconds=dtensor_op_seconds, step_overhead_seconds=step_overhead_seconds,
        elementwise_bandwidth=bandwidth_elementwise, processes=processes,
        matmul_efficiency=[list(point) for point in curve] if curve else None,
        dtensor_optimizer_op_seconds=dtensor_optimizer_op_seconds,
    )
    data = _load(path)
    data[result.key] = asdict(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
    return result

