"""What the planner prices for one GPU, measured on one GPU (issue 23: the published-runs table).

    python benchmarks/gpu_step_model.py                 # on 1 GPU: Llama-3-8B widths, 4 layers, seq 8192
    python benchmarks/gpu_step_model.py --tiny          # anywhere (CPU): the same code on a small shape

The planner's GPU presets price a step as matmul FLOPs at ``efficiency`` of the peak, and (until
issue 23's GPU pass) nothing for the non-matmul operators: norms, RoPE, SwiGLU's products, residual
adds, the loss's softmax, AdamW. In eager PyTorch each of those reads and writes HBM. This script
measures, on the device at hand, each term the planner needs, then the real thing:

1. **matmul efficiency**: bf16 GEMMs of the model's own shapes (the layer's projections at the
   microbatch's tokens), as a fraction of the preset's dense peak;
2. **element-wise bandwidth**: ``calibrate.measure._elementwise_chain`` (an RMS norm, a SwiGLU product,
   a residual add), forward and backward at the layer's size, its bytes (``TrafficCounter``) over its time;
3. **the real step**: the GPT recipe at that shape under ``ParaStrategy()`` at ``devices=1``
   (``bf16-mixed``, torchtitan's per-op selective recomputation, AdamW), steps timed after warm-up,
   the allocator's peak allocated and reserved bytes; one step profiled, its kernel time split into
   matmul, attention, optimizer (``multi_tensor_apply``) and everything else; one step's non-matmul
   bytes counted (``TrafficCounter``);
4. **the planner's prediction** of that run (``plan.estimate``), with the GPU preset as it is and with the
   GEMM efficiency and bandwidth measured in 1 and 2, beside the measurements.

The counts of 3 (``count_traffic_coefficients``) are where ``plan/overhead.py``'s bf16 rows come from. Results:
``benchmarks/results/gpu_step_model_h100.md``.

Writes ``--out`` (JSON) and prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from benchmarks.common import TokenData, quiet_trainer_kwargs  # noqa: E402
from lightning_para import ParaStrategy  # noqa: E402
from lightning_para.plan import Cluster, Layout, Training, estimate  # noqa: E402
from lightning_para.calibrate.measure import _elementwise_chain  # noqa: E402
from lightning_para.instrument.operators import TrafficCounter  # noqa: E402
from lightning_para.plan.model import ModelDesc  # noqa: E402
from lightning_para.recipes import GPT  # noqa: E402

GIB = 2**30
# Kernel names by what the planner prices them as (CUDA kernel names of cuBLAS/CUTLASS, flash attention
# and torch's fused optimizers; aten names on CPU).
MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "cudnn")
OPTIMIZER_KERNELS = ("multi_tensor_apply", "_foreach", "adam")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], None], device: torch.device, repeats: int = 7) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_efficiency(tokens: int, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype,
                      peak: float) -> dict[str, float]:
    """FLOP/s of the layer's two largest GEMM shapes (up/gate projection and its transpose, as backward
    runs them), and their fraction of ``peak``."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, ffn, device=device, dtype=dtype)
    g = torch.randn(tokens, ffn, device=device, dtype=dtype)
    flops = 2.0 * tokens * hidden * ffn
    forward = median_seconds(lambda: x @ w, device)
    backward_input = median_seconds(lambda: g @ w.t(), device)
    backward_weight = median_seconds(lambda: x.t() @ g, device)
    rate = 3 * flops / (forward + backward_input + backward_weight)
    return {"flops_per_s": rate, "efficiency": rate / peak if peak else float("nan"),
            "forward_s": forward, "backward_input_s": backward_input, "backward_weight_s": backward_weight}


def elementwise_bandwidth(tokens: int, hidden: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Bytes/s of the non-matmul chain at the layer's size (fixed per-operator costs are negligible there)."""
    leaves = [torch.randn(tokens, hidden, device=device, dtype=dtype), torch.randn(hidden, device=device, dtype=dtype),
              torch.randn(tokens, 3 * hidden, device=device, dtype=dtype),
              torch.randn(tokens, 3 * hidden, device=device, dtype=dtype)]
    leaves = [t.requires_grad_() for t in leaves]

    def run() -> None:
        _elementwise_chain(*leaves).backward()
        for t in leaves:
            t.grad = None

    run()
    with TrafficCounter() as counter:
        run()
    seconds = median_seconds(run, device)
    return {"bytes": counter.bytes, "seconds": seconds, "bandwidth": counter.bytes / seconds}


class StepProbe(Callback):
    """Synchronized step times; one step profiled (kernel time by kind) and one step's traffic counted."""

    def __init__(self, profile_step: int, count_step: int) -> None:
        self.ends: list[float] = []
        self.profile_step, self.count_step = profile_step, count_step
        self.profiler: Any = None
        self.counter: Any = None
        self.kernel_seconds: dict[str, float] = {}
        self.top_kernels: list[tuple[str, float]] = []
        self.traffic: dict[str, float] = {}
        self.phase_peaks_gib: dict[str, float] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.profile_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        if batch_idx == self.count_step:
            self.counter = TrafficCounter()
            self.counter.__enter__()
        if batch_idx == self.profile_step - 1 and module.device.type == "cuda":  # peaks of one step, by phase
            torch.cuda.reset_peak_memory_stats(module.device)
            self.phase_peaks_gib["step_start_allocated"] = torch.cuda.memory_allocated(module.device) / GIB

    def _phase_peak(self, module: L.LightningModule, phase: str, batch_idx: int) -> None:
        if batch_idx == self.profile_step - 1 and module.device.type == "cuda":
            self.phase_peaks_gib[phase] = torch.cuda.max_memory_allocated(module.device) / GIB
            self.phase_peaks_gib[phase + "_end_allocated"] = torch.cuda.memory_allocated(module.device) / GIB
            torch.cuda.reset_peak_memory_stats(module.device)

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: Any) -> None:
        self._phase_peak(module, "forward_and_loss", trainer.fit_loop.batch_idx)

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._phase_peak(module, "backward", trainer.fit_loop.batch_idx)

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.counter is not None:  # forward and backward counted; the optimizer step apart
            self.traffic["microbatch_bytes"], self.traffic["microbatch_ops"] = self.counter.bytes, self.counter.ops
            self.counter.bytes = self.counter.ops = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        sync(module.device)
        self.ends.append(time.perf_counter())
        self._phase_peak(module, "optimizer_step", batch_idx)
        if self.counter is not None:
            self.traffic["optimizer_bytes"], self.traffic["optimizer_ops"] = self.counter.bytes, self.counter.ops
            self.counter.__exit__(None, None, None)
            self.counter = None
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.kernel_seconds, self.top_kernels = kernel_time_by_kind(self.profiler, module.device)
            self.profiler = None


def kernel_time_by_kind(profiler: Any, device: torch.device) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Seconds of device kernels (CPU: of aten operators' self time) by what the planner prices them as, and
    the 25 kernels (names cut to 90 characters) with the most time."""
    totals = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    by_name: dict[str, float] = {}

    def add(name: str, micros: float) -> None:
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + micros / 1e6
        name = name.lower()
        kind = ("matmul" if any(k in name for k in MATMUL_KERNELS) else
                "attention" if any(k in name for k in ATTENTION_KERNELS) else
                "optimizer" if any(k in name for k in OPTIMIZER_KERNELS) else "other")
        totals[kind] += micros / 1e6

    events = list(profiler.events())
    if device.type == "cuda":
        for event in events:  # the kernels themselves
            if str(event.device_type).split(".")[-1] == "CUDA":
                add(event.name, event.device_time_total)
        if sum(totals.values()) == 0:
            for event in events:  # no kernel events: the operators' self device time
                if event.name.startswith("aten::"):
                    add(event.name, event.self_device_time_total)
    else:
        for event in events:
            if event.name.startswith("aten::"):
                add(event.name, event.self_cpu_time_total)
    return totals, sorted(by_name.items(), key=lambda item: -item[1])[:25]


def run_recipe(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    steps = args.warmup + args.steps
    model = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden,
                n_kv_head=args.kv_heads, mlp_hidden=args.ffn, warmup_steps=1, sample_tokens=0)
    probe = StepProbe(profile_step=args.warmup + args.steps, count_step=args.warmup + args.steps + 1)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=steps + 2,
        strategy=ParaStrategy(activation_checkpointing=args.recompute), precision=args.precision, callbacks=[probe]))
    data = TokenData(samples=args.batch * (steps + 2), batch_size=args.batch, seq_len=args.seq, vocab_size=args.vocab)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(model, data)
    timed = probe.ends[args.warmup - 1: steps]
    step_times = [b - a for a, b in zip(timed, timed[1:])]
    result: dict[str, Any] = {
        "step_seconds": statistics.median(step_times), "step_times": step_times,
        "kernel_seconds": probe.kernel_seconds, "top_kernels": probe.top_kernels, "traffic": probe.traffic,
        "phase_peaks_gib": probe.phase_peaks_gib,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        result["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return result


def count_coefficients(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """:func:`~lightning_para.calibrate.traffic.count_traffic_coefficients` at each ``--count-widths`` entry
    (``hidden:heads:kv_heads:ffn``), one block, ``--vocab``, under bf16-mixed and bf16-true."""
    from dataclasses import asdict

    from lightning_para.calibrate.traffic import count_traffic_coefficients

    shapes = ((2, 64), (1, 16)) if args.tiny else ((2, 8192), (1, 2048))
    out: dict[str, Any] = {}
    for spec in filter(None, args.count_widths.split(",")):
        hidden, heads, kv_heads, ffn = (int(v) for v in spec.split(":"))
        with torch.device(device):
            model = GPT(vocab_size=args.vocab, block_size=max(seq for _, seq in shapes), n_layer=1, n_head=heads,
                        n_embd=hidden, n_kv_head=kv_heads, mlp_hidden=ffn, sample_tokens=0)
        for precision in ("bf16-mixed", "bf16-true"):
            coefficients = count_traffic_coefficients(model, precision, shapes,
                                                      optimizer_params=lambda m: m.blocks[0].parameters())
            out[f"{spec} {precision}"] = asdict(coefficients)
            print(spec, precision, coefficients, flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def predict(args: argparse.Namespace, bandwidth: float, efficiency: float, gpu: str) -> dict[str, Any]:
    """The planner's step and peak memory for the run: with the preset as it is (``Cluster.efficiency`` 0.5,
    the preset's element-wise bandwidth) and with the GEMM efficiency and bandwidth measured here."""
    model = ModelDesc(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
                      vocab=args.vocab, name="measured")
    training = Training(seq_len=args.seq, global_batch=args.batch, micro_batch=args.batch, precision=args.precision)
    layout = Layout(activation_checkpointing=args.recompute)
    out: dict[str, Any] = {}
    base = Cluster.of(gpu, nodes=1, gpus_per_node=1)
    measured = replace(base, elementwise_bandwidth=bandwidth)
    if not math.isnan(efficiency):  # NaN on CPU (no GPU peak to divide by): the preset's
        measured = replace(measured, efficiency=efficiency, gemm=None)  # the measured figure, not the GEMM curve
    for name, cluster in (("preset", base), ("measured_efficiency_and_bandwidth", measured)):
        est = estimate(model, cluster, training, layout)
        memory = est.memory
        out[name] = {"step_seconds": est.step_seconds, "memory_gib": memory.total / GIB,
                     "memory": {k: getattr(memory, k) / GIB for k in ("params", "grads", "optimizer", "activations",
                                                                      "buffers", "recomputed")}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape that runs anywhere (CPU check)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (one microbatch)")
    parser.add_argument("--recompute", default="selective_op", help="ParaStrategy's activation_checkpointing ('none')")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu", default="h100", help="the planner's preset to compare with")
    parser.add_argument("--out", default="gpu_step_model.json")
    parser.add_argument("--count-widths", default="4096:32:8:14336",
                        help="count the traffic coefficients at these hidden:heads:kv_heads:ffn ('' skips)")
    parser.add_argument("--skip-recipe", action="store_true", help="only the microbenchmarks and the counts")
    args = parser.parse_args(argv)
    if args.recompute in ("none", ""):
        args.recompute = None
    if args.tiny:
        args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab = 2, 128, 4, 2, 384, 512
        args.seq, args.batch, args.warmup, args.steps = 64, 2, 2, 3
        args.count_widths = "128:4:2:384" if args.count_widths == "4096:32:8:14336" else args.count_widths
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = Cluster.of(args.gpu, nodes=1, gpus_per_node=1).peak_flops if device.type == "cuda" else 0.0
    tokens = args.seq * args.batch
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "args": vars(args)}
    report["matmul"] = matmul_efficiency(tokens, args.hidden, args.ffn, device, dtype, peak)
    report["elementwise"] = elementwise_bandwidth(tokens, args.hidden, device, dtype)
    print(json.dumps({k: report[k] for k in ("device", "matmul", "elementwise")}, indent=1), flush=True)
    report["traffic_coefficients"] = count_coefficients(args, device)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.skip_recipe:
        return 0
    report["recipe"] = run_recipe(args, device)
    print(json.dumps(report["recipe"], indent=1), flush=True)
    report["planner"] = predict(args, report["elementwise"]["bandwidth"], report["matmul"]["efficiency"], args.gpu)
    print(json.dumps(report["planner"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
