"""The MoE layer's local experts: grouped GEMMs against one matmul per expert.

One :class:`lightning_para.moe.MoE` layer (width 256, ``--experts`` SwiGLU experts of hidden
``--hidden``, top-2, dropless and with capacity) runs forward + backward on a
``[batch, 64, 256]`` input with each implementation of :mod:`lightning_para.moe.grouped`:

* ``loop``: one matmul per expert (the reference);
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (where the device and dtype support it);
* ``bmm``: rows padded per expert, one batched matmul;
* ``auto``: what the layer picks by default.

Before timing, every implementation's output and gradients are compared with the loop's
(the ``max |diff|`` column, fp32). Timing follows :mod:`benchmarks.common`: rounds alternate
between the implementations (order rotated each round), one intra-op thread, median over
rounds, ratios to the loop measured in the same run.

    python benchmarks/moe_experts.py --rounds 7 --out benchmarks/results/moe_experts_cpu.md
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Comparison, alternate, load_average, machine_header  # noqa: E402
from lightning_para.moe import MoE  # noqa: E402
from lightning_para.moe.grouped import grouped_mm_supported  # noqa: E402


def make_layer(experts: int, hidden: int, capacity_factor) -> MoE:
    torch.manual_seed(0)
    return MoE(256, hidden, experts, top_k=2, capacity_factor=capacity_factor)


def run_once(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.square().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.detach().clone()
    return out.detach(), grads


def max_difference(reference, other) -> float:
    (out_a, grads_a), (out_b, grads_b) = reference, other
    diff = (out_a - out_b).abs().max().item()
    for name, grad in grads_a.items():
        diff = max(diff, (grad - grads_b[name]).abs().max().item())
    return diff


def compare(experts: int, hidden: int, batch: int, capacity_factor, rounds: int, iters: int) -> Comparison:
    base = make_layer(experts, hidden, capacity_factor)
    x = torch.randn(batch, 64, 256, generator=torch.Generator().manual_seed(1))
    implementations = ["loop", "bmm", "auto"]
    if grouped_mm_supported(x.device, x.dtype):
        implementations.insert(1, "grouped_mm")
    layers = {}
    for name in implementations:
        layer = copy.deepcopy(base)
        layer.experts.implementation = name
        layers[name] = layer
    reference = run_once(layers["loop"], x)
    label = "dropless" if capacity_factor is None else f"capacity factor {capacity_factor}"
    comparison = Comparison(f"{experts} experts of hidden {hidden}, top-2, {label}, batch {batch} x 64 tokens", "loop",
                            what="forward+backward")
    comparison.extra_columns["max abs diff vs loop"] = {
        name: f"{max_difference(reference, run_once(layer, x)):.1e}" for name, layer in layers.items()
    }

    def timed(name: str) -> float:
        layer = layers[name]
        run_once(layer, x)  # warm-up
        start = time.perf_counter()
        for _ in range(iters):
            run_once(layer, x)
        return (time.perf_counter() - start) / iters

    alternate(implementations, rounds, timed, comparison, log=lambda line: print(line, flush=True))
    comparison.notes.append(f"Each figure: forward + backward of the whole MoE layer (router included), mean of {iters}"
                            " calls after one warm-up call.")
    comparison.notes.append(f"`auto` picks `{'grouped_mm' if 'grouped_mm' in implementations else 'bmm'}` here.")
    return comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = load_average()
    sections = [compare(args.experts, args.hidden, args.batch, cf, args.rounds, args.iters).markdown()
                for cf in (None, 1.25)]
    command = "python benchmarks/moe_experts.py " + " ".join(sys.argv[1:])
    text = "# MoE experts: grouped GEMMs vs one matmul per expert\n\n" + machine_header(command, load_before)
    text += "\n" + "\n".join(sections)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
