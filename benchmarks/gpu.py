"""One command for a lent GPU: GPT-2 124M at llm.c's settings and Llama-3-8B-width blocks, ParaStrategy vs Lightning.

    python benchmarks/gpu.py                          # one GPU: both workloads, compiled, fused AdamW
    python benchmarks/gpu.py --tiny --no-compile      # anywhere (CPU, seconds): the same code at toy sizes

Workloads (``--workloads``), each trained on random tokens under both sides on the same machine:

* ``gpt2-124m``: GPT-2 small as llm.c and nanoGPT train it -- 12 layers, width 768, 12 heads, LayerNorm,
  learned positions, GELU MLP, biases, tied embedding, vocabulary 50,304 (50,257 padded), sequence 1024,
  ``--batch`` sequences per GPU (default 32; llm.c and nanoGPT use 16-64), ``bf16-mixed``;
* ``llama3-8b-block``: ``--layers`` (default 4) Llama-3-8B blocks -- width 4096, 32 heads, 8 key/value heads,
  SwiGLU 14,336, RMSNorm, RoPE -- at sequence 4096, batch 4, with a byte vocabulary so the blocks are the step
  (MFU of the blocks, not of a 128K-vocabulary head), ``bf16-true`` (ParaStrategy: fp32 master weights, the
  default; Lightning: all-bf16 weights and AdamW).

Sides: ``para`` (``ParaStrategy(compile=...)``, which compiles each block) and ``lightning`` (Lightning's default
strategy, each block compiled the same way in ``configure_model``); both step ``AdamW(fused=True)`` (llm.c and
nanoGPT's). ``--sides para+fp8`` adds ParaStrategy with torchao's float8 linears. Alternating rounds, the order rotated each round (:mod:`benchmarks.common`); per workload and side the
median over rounds of

* **tokens/s** in steady state (steps after ``--warmup``; data loading included);
* **MFU**: ``flops_per_token * tokens/s / peak`` with the recipe's ``6N + 12 L d T`` and the device's peak bf16
  FLOP/s from Lightning's table ("n/a" on CPU);
* **peak memory** (``torch.cuda.max_memory_allocated``; n/a on CPU);
* the **ratio** of ParaStrategy's step time to Lightning's in the same round (below 1: ParaStrategy is faster).

The reference points: llm.c trains GPT-2 124M at about 468K tokens/s per H100; nanochat reports 50% MFU on
H100s. The Markdown goes to ``--out`` (default ``benchmarks/results/gpu_<device>.md``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import StepClock, TokenData, load_average, machine_header, quiet_trainer_kwargs  # noqa: E402
from lightning_para import ParaStrategy  # noqa: E402
from lightning_para.observe.profiler import detect_peak_flops  # noqa: E402
from lightning_para.parallel.compile import apply_compile  # noqa: E402
from lightning_para.recipes import GPT  # noqa: E402

SIDES = ("para", "lightning")
EXTRA_SIDES = ("para+fp8",)  # ParaStrategy with torchao float8 linears (tensorwise) as well


@dataclass(frozen=True)
class Workload:
    model: dict[str, Any]  # GPT recipe arguments
    seq: int
    batch: int
    precision: str


WORKLOADS = {
    "gpt2-124m": Workload(dict(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, norm="layernorm", pos="learned",
                               mlp="gelu", bias=True, tie_weights=True), seq=1024, batch=32, precision="bf16-mixed"),
    "llama3-8b-block": Workload(dict(vocab_size=256, n_layer=4, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336),
                                seq=4096, batch=4, precision="bf16-true"),
}
# `--tiny`: the same workloads at toy widths (the CPU path the tests run).
TINY = {"gpt2-124m": dict(vocab_size=256, n_layer=2, n_head=2, n_embd=32),
        "llama3-8b-block": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64)}


class BenchGPT(GPT):
    """The recipe stepped by a fused AdamW (the recipe's groups and schedule) and, for plain Lightning, compiled per
    block in ``configure_model`` as ``ParaStrategy(compile=True)`` does."""

    def __init__(self, *, compile_blocks: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.compile_blocks = compile_blocks

    def configure_model(self) -> None:
        if self.compile_blocks:
            apply_compile(self, options={})

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        adamw, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in adamw.param_groups]
        fused = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                  fused=torch.cuda.is_available())
        config["optimizer"] = fused
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(fused, schedule.lr_lambdas[0])
        return config


@dataclass
class Measurement:
    step_s: list[float] = field(default_factory=list)
    peak_bytes: list[Optional[int]] = field(default_factory=list)


def model_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = WORKLOADS[name]
    kwargs = {**work.model, **(TINY[name] if args.tiny else {})}
    if name == "llama3-8b-block" and args.layers is not None:
        kwargs["n_layer"] = args.layers
    return dict(kwargs, block_size=args.seq or work.seq, sample_tokens=0, warmup_steps=2)


def run_one(side: str, name: str, args: argparse.Namespace) -> tuple[float, Optional[int]]:
    """One fit; returns (seconds per step after warm-up, peak allocated bytes or None)."""
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    gc.collect()
    if accelerator == "gpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    work, kwargs = WORKLOADS[name], model_kwargs(name, args)
    L.seed_everything(0, verbose=False)
    if side.startswith("para"):
        fp8 = {"fp8": "tensorwise"} if side == "para+fp8" else {}
        model, strategy = BenchGPT(**kwargs), ParaStrategy(compile=args.compile, **fp8)
    else:
        model, strategy = BenchGPT(compile_blocks=args.compile, **kwargs), "auto"
    clock = StepClock(args.warmup)
    trainer = L.Trainer(**quiet_trainer_kwargs(accelerator=accelerator), devices=1, strategy=strategy,
                        precision=work.precision, max_steps=args.steps, callbacks=[clock])
    batch, seq = args.batch or work.batch, kwargs["block_size"]
    data = TokenData(samples=batch * args.steps, batch_size=batch, seq_len=seq, vocab_size=kwargs["vocab_size"])
    trainer.fit(model, datamodule=data)
    peak = torch.cuda.max_memory_allocated() if accelerator == "gpu" else None
    step = clock.step_time
    del trainer, model
    return step, peak


def main(argv: Optional[list[str]] = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the workload's)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the workload's)")
    parser.add_argument("--layers", type=int, default=None, help="llama3-8b-block: blocks (default 4)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager (default: compile blocks)")
    parser.add_argument("--tiny", action="store_true", help="toy widths (the CPU path)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed (compilation happens here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=[*SIDES, *EXTRA_SIDES],
                        help="para, lightning (the ratio's baseline), para+fp8 (not by default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise ValueError(f"`--warmup={args.warmup}` must be smaller than `--steps={args.steps}`.")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    load_before = load_average()
    results: dict[tuple[str, str], Measurement] = {}
    runs = [(side, name) for name in args.workloads for side in args.sides]
    for r in range(args.rounds):
        shift = r % len(runs)
        for side, name in runs[shift:] + runs[:shift]:
            step, peak = run_one(side, name, args)
            m = results.setdefault((side, name), Measurement())
            m.step_s.append(step)
            m.peak_bytes.append(peak)
            print(f"round {r + 1}/{args.rounds} {side} {name}: {1e3 * step:.1f} ms/step", flush=True)
    text = render(results, args, device, device_name, load_before)
    out = args.out or Path(__file__).resolve().parent / "results" / f"gpu_{device_name.replace(' ', '_').lower()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return out


def render(results: dict[tuple[str, str], Measurement], args: argparse.Namespace, device: torch.device,
           device_name: str, load_before: str) -> str:
    peak_flops = detect_peak_flops(device, torch.bfloat16)
    baseline = "lightning" if "lightning" in args.sides else args.sides[0]
    lines = [
        f"# ParaStrategy vs Lightning on {device_name}: GPT-2 124M and Llama-3-8B-width blocks", "",
        machine_header("python benchmarks/gpu.py " + " ".join(sys.argv[1:]), load_before, threads=f"device {device}"),
        f"{args.rounds} alternating rounds of {args.steps} steps ({args.warmup} warm-up, compilation included);"
        f" blocks {'compiled' if args.compile else 'eager'}; AdamW fused on a GPU. Ratio: step time over"
        f" {baseline}'s in the same round (median).", "",
        "| workload | params | precision | tokens/step | side | tokens/s | MFU | peak memory GiB | step time / baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.workloads:
        kwargs = model_kwargs(name, args)
        probe = GPT(**kwargs)
        params, flops_per_token = sum(p.numel() for p in probe.parameters()), probe.flops_per_token(kwargs["block_size"])
        tokens = (args.batch or WORKLOADS[name].batch) * kwargs["block_size"]
        base = results[(baseline, name)].step_s
        for side in args.sides:
            m = results[(side, name)]
            tokens_per_s = tokens / statistics.median(m.step_s)
            mfu = f"{100 * flops_per_token * tokens_per_s / peak_flops:.1f}%" if peak_flops else "n/a"
            peaks = [b for b in m.peak_bytes if b is not None]
            memory = f"{max(peaks) / 2**30:.2f}" if peaks else "n/a"
            ratio = statistics.median(a / b for a, b in zip(m.step_s, base))
            lines.append(f"| {name} | {params / 1e6:.1f}M | {WORKLOADS[name].precision} | {tokens} | {side} |"
                         f" {tokens_per_s:,.0f} | {mfu} | {memory} | {ratio:.3f} |")
    lines += ["", f"Peak FLOP/s ({device_name}, bf16, Lightning's table): "
              + (f"{peak_flops / 1e12:.0f} TFLOP/s." if peak_flops else "unknown (MFU not computed).")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
