"""One command for the first GPU: the GPT recipe under ParaStrategy and under plain Lightning.

    python benchmarks/gpu.py                      # on 1 GPU: ~125M GPT, seq 1024
    python benchmarks/gpu.py --preset tiny --seq 64 --batch 2 --steps 4 --rounds 1   # anywhere (CPU)

For each configuration -- ``bf16-mixed`` and ``bf16-true``, each with and without full
activation checkpointing -- it trains the same model on the same random tokens with

* ``para``: ``ParaStrategy()`` at ``devices=1`` (its precision plugin: ``bf16-true`` keeps fp32
  master weights for AdamW, ``bf16-mixed`` autocasts);
* ``lightning``: Lightning's default strategy with ``Trainer(precision=...)`` (``bf16-true``
  casts the model and steps AdamW on bf16 weights);

in alternating rounds (order rotated each round, as in :mod:`benchmarks.common`), and
reports per configuration and side the median over rounds of:

* **tokens/s** in steady state (steps after ``--warmup``, data loading included);
* **MFU**: ``flops_per_token * tokens/s / peak``, with the recipe's ``flops_per_token``
  (6N + 12 L d T; recomputation not counted as useful work) and the peak FLOP/s of the device
  from Lightning's table (``lightning_para.observe.profiler.detect_peak_flops``; "n/a" on CPU);
* **peak memory**: ``torch.cuda.max_memory_allocated`` over the run (n/a on CPU);
* the ratio of ParaStrategy's step time to Lightning's in the same round.

Activation checkpointing is applied the same way on both sides: ParaStrategy's
``activation_checkpointing="full"``, and for Lightning the same helper
(``apply_activation_checkpointing``) called in ``configure_model``.

The Markdown table goes to ``--out`` (default ``benchmarks/results/gpu_<device>.md``).
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
from lightning_para.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from lightning_para.recipes import GPT  # noqa: E402

PRECISIONS = ("bf16-mixed", "bf16-true")
CHECKPOINTING = (None, "full")
SIDES = ("para", "lightning")
# `--sides` may add ParaStrategy with issue 25's speed options: torch.compile per block, and compile plus
# torchao float8 (tensorwise) linears. torchtitan's Llama 3.1 8B H100 figures are the reason to use them
# (5,762 -> 6,667 -> 8,532 tokens/s/GPU, docs/performance.md).
FAST_SIDES = {"para+compile": {"compile": True}, "para+compile+fp8": {"compile": True, "fp8": "tensorwise"}}


class CheckpointedGPT(GPT):
    """The recipe with full activation checkpointing applied in ``configure_model`` (for plain Lightning)."""

    def configure_model(self) -> None:
        apply_activation_checkpointing(self, "full")


@dataclass
class Measurement:
    step_s: list[float] = field(default_factory=list)
    peak_bytes: list[Optional[int]] = field(default_factory=list)


def config_name(precision: str, checkpointing: Optional[str]) -> str:
    return f"{precision}, {'full AC' if checkpointing else 'no AC'}"


def run_one(side: str, precision: str, checkpointing: Optional[str], args: argparse.Namespace) -> tuple[float, Optional[int]]:
    """One fit; returns (seconds per step after warm-up, peak allocated bytes or None)."""
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    gc.collect()
    if accelerator == "gpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model_kwargs: dict[str, Any] = dict(preset=args.preset, block_size=args.seq, vocab_size=args.vocab,
                                        tie_weights=not args.untied, sample_tokens=0, warmup_steps=2)
    L.seed_everything(0, verbose=False)
    if side.startswith("para"):
        model = GPT(**model_kwargs)
        strategy: Any = ParaStrategy(activation_checkpointing=checkpointing, **FAST_SIDES.get(side, {}))
    else:
        model = (CheckpointedGPT if checkpointing else GPT)(**model_kwargs)
        strategy = "auto"
    clock = StepClock(args.warmup)
    trainer = L.Trainer(**quiet_trainer_kwargs(accelerator=accelerator), devices=1, strategy=strategy,
                        precision=precision, max_steps=args.steps, callbacks=[clock])
    data = TokenData(samples=args.batch * args.steps, batch_size=args.batch, seq_len=args.seq, vocab_size=args.vocab)
    trainer.fit(model, datamodule=data)
    peak = torch.cuda.max_memory_allocated() if accelerator == "gpu" else None
    step = clock.step_time
    del trainer, model
    return step, peak


def main(argv: Optional[list[str]] = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-125m", help="GPT preset (gpt-125m: 12 layers, 768 wide)")
    parser.add_argument("--vocab", type=int, default=50304, help="vocabulary (GPT-2's, padded to 64)")
    parser.add_argument("--untied", action="store_true", help="separate output head (default: tied, as GPT-2: 124M)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (1024-2048 on a GPU)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=None,
                        help="subset, e.g. bf16-mixed:none bf16-true:full (default: all four)")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=[*SIDES, *FAST_SIDES],
                        help="what to run: para, lightning (the baseline of the ratio column), para+compile, para+compile+fp8")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise ValueError(f"`--warmup={args.warmup}` must be smaller than `--steps={args.steps}`.")
    configs = [(p, c) for p in PRECISIONS for c in CHECKPOINTING]
    if args.configs:
        wanted = {tuple(item.split(":")) for item in args.configs}
        configs = [(p, c) for p, c in configs if (p, c or "none") in wanted]
        if not configs:
            known = [f"{p}:{c or 'none'}" for p in PRECISIONS for c in CHECKPOINTING]
            raise ValueError(f"`--configs {' '.join(args.configs)}` matches none of {known}.")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    load_before = load_average()
    results: dict[tuple[str, str, Optional[str]], Measurement] = {}
    runs = [(side, p, c) for p, c in configs for side in args.sides]
    for r in range(args.rounds):
        shift = r % len(runs)
        for side, precision, checkpointing in runs[shift:] + runs[:shift]:
            step, peak = run_one(side, precision, checkpointing, args)
            m = results.setdefault((side, precision, checkpointing), Measurement())
            m.step_s.append(step)
            m.peak_bytes.append(peak)
            print(f"round {r + 1}/{args.rounds} {side} {config_name(precision, checkpointing)}:"
                  f" {1e3 * step:.1f} ms/step", flush=True)
    text = render(results, configs, args, device, device_name, load_before)
    out = args.out or Path(__file__).resolve().parent / "results" / f"gpu_{device_name.replace(' ', '_').lower()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return out


def render(results, configs, args, device: torch.device, device_name: str, load_before: str) -> str:
    probe = GPT(preset=args.preset, block_size=args.seq, vocab_size=args.vocab, tie_weights=not args.untied,
                sample_tokens=0)
    params = sum(p.numel() for p in probe.parameters())
    flops_per_token = probe.flops_per_token(args.seq)
    tokens_per_step = args.batch * args.seq
    lines = [
        f"# GPT recipe on {device_name}: ParaStrategy vs Lightning's default strategy", "",
        machine_header("python benchmarks/gpu.py " + " ".join(sys.argv[1:]), load_before,
                       threads=f"device {device}"),
        f"Model: preset `{args.preset}`, vocab {args.vocab}, {params / 1e6:.1f}M parameters, sequence {args.seq},"
        f" batch {args.batch} ({tokens_per_step} tokens/step), {flops_per_token / 1e9:.2f} GFLOP/token (6N + 12LdT)."
        f" {args.rounds} alternating rounds of {args.steps} steps ({args.warmup} warm-up). Baseline of the ratio:"
        f" {'lightning' if 'lightning' in args.sides else args.sides[0]}.", "",
        "| precision | activation ckpt | side | tokens/s | MFU | peak memory GiB | step time / baseline (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    peak_flops = detect_peak_flops(device, torch.bfloat16)
    for precision, checkpointing in configs:
        baseline = "lightning" if "lightning" in args.sides else args.sides[0]
        base = results[(baseline, precision, checkpointing)].step_s
        for side in args.sides:
            m = results[(side, precision, checkpointing)]
            step = statistics.median(m.step_s)
            tokens_per_s = tokens_per_step / step
            mfu = f"{100 * flops_per_token * tokens_per_s / peak_flops:.1f}%" if peak_flops else "n/a"
            peaks = [b for b in m.peak_bytes if b is not None]
            memory = f"{max(peaks) / 2**30:.2f}" if peaks else "n/a"
            ratio = statistics.median(a / b for a, b in zip(m.step_s, base))
            lines.append(f"| {precision} | {checkpointing or 'none'} | {side} | {tokens_per_s:,.0f} | {mfu} | {memory} |"
                         f" {ratio:.3f} |")
    lines += ["", f"Peak FLOP/s ({device_name}, bf16, Lightning's table): "
              + (f"{peak_flops / 1e12:.0f} TFLOP/s." if peak_flops else "unknown (MFU not computed).")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
