"""One rank of an N-rank ZeRO-3 job, on one real GPU: what the caching allocator reserves (issue 23).

    python benchmarks/gpu_fake_world.py --world 8          # on 1 GPU: rank 0 of dp=8, Llama 3 8B, 2 x 8,192
    python benchmarks/gpu_fake_world.py --tiny --world 8   # anywhere (CPU): the same code on a small shape

torchtitan's published memory column (``benchmarks/llama3_h100_202412_torchtitan.md``) is the caching
allocator's peak *reserved* memory; the planner counts tensors (allocated bytes), and the dry run counts them on
the meta device. This script runs rank 0 of the same layout with real CUDA kernels and the real allocator:
torch's fake process group at world size ``--world`` (collectives return at once, no other rank exists), the
real mesh and ``parallelize`` (FSDP2 shards 1/N of every weight on this GPU and gathers whole units, as a
real rank does), the GPT recipe at Llama 3 8B's widths (32 layers), ``bf16-mixed`` under autocast as
``ParaPrecision`` runs it, torchtitan's per-op selective recomputation, AdamW (foreach), and Lightning's
order within a step (forward, ``zero_grad``, backward, ``step``). The values are garbage (no rank sends
anything), the shapes and the allocations are a real rank's.

It prints, per step, the allocator's peak allocated and reserved bytes, and the planner's prediction of the
allocated peak for the same rank (``plan.estimate``). Run it with and without
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's launcher sets it). Results:
``benchmarks/results/gpu_fake_world.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_para.config import ParallelConfig  # noqa: E402
from lightning_para.parallelize import parallelize  # noqa: E402
from lightning_para.parallel.tensor import (  # noqa: E402
    loss_parallel_backward,
    loss_parallel_step,
    step_mixed_groups_per_tensor,
)
from lightning_para.plan import Cluster, Layout, Training, estimate  # noqa: E402
from lightning_para.simulate import start_fake_world  # noqa: E402
from lightning_para.plan.model import ModelDesc  # noqa: E402
from lightning_para.precision import ParaPrecision  # noqa: E402
from lightning_para.recipes import GPT  # noqa: E402

GIB = 2**30


def _allocated(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0.0


def _peak(device: torch.device) -> float:
    """The allocated peak since the last call (GiB); the reserved peak keeps counting over the step."""
    if device.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated(device) / GIB
    reserved = torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    _peak.reserved = max(getattr(_peak, "reserved", 0), reserved)
    return peak


def predict(world: int, layers: int, precision: str, recompute: str, seq: int, batch: int,
            widths: tuple[int, int, int, int, int] = (4096, 32, 8, 14336, 128256), loss_upcast: bool = False,
            zero: int = 3, tp: int = 1) -> Any:
    """The planner's estimate for rank 0 of the run (``plan.estimate``; ``widths``: hidden, heads, kv heads,
    ffn, vocab; ``tp > 1`` with sequence parallelism)."""
    hidden, heads, kv_heads, ffn, vocab = widths
    desc = ModelDesc(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, name="gpt",
                     loss_upcast=loss_upcast)
    training = Training(seq_len=seq, global_batch=batch * world, micro_batch=batch, precision=precision)
    layout = Layout(dp=world // tp, tp=tp, zero=zero, sequence_parallel=tp > 1, activation_checkpointing=recompute)
    return estimate(desc, Cluster.of("h100", nodes=max(1, world // 8)), training, layout)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    start_fake_world(args.world, 0)
    config = ParallelConfig(dp=args.world // args.tp, tp=args.tp, zero=args.zero, sequence_parallel=args.tp > 1,
                            activation_checkpointing=args.recompute)
    dims = config.resolve_dims(args.world)
    dims.build_mesh(device.type)
    # FSDP2 (ZeRO-3) shards a model built on meta; ZeRO-0/1/2 and TP take a materialized one, as ParaStrategy does.
    with torch.device("meta" if args.zero == 3 else device):
        model = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.hidden, n_kv_head=args.kv_heads, mlp_hidden=args.ffn, sample_tokens=0,
                    loss_fp32=args.loss_upcast)  # torchtitan's loss casts the logits to fp32 first
    precision = ParaPrecision(args.precision)
    precision.device_type = device.type
    parallel = parallelize(model, dims, config, param_dtype=precision.param_dtype,
                           master_dtype=precision.master_dtype)
    if args.zero == 3:
        model.to_empty(device=device)  # this rank's shards only: FSDP2 built them on meta
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    parallel.data_parallel.attach_optimizer(optimizer, is_expert=parallel.expert_predicate())
    step_mixed_groups_per_tensor(optimizer)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    steps = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            _peak.reserved = 0
        t0 = time.perf_counter()
        phases = {"start": _allocated(device)}
        with precision.forward_context(), loss_parallel_step(parallel.loss_parallel):
            logits = model(tokens)
            phases["blocks_and_head_peak"], phases["after_logits"] = _peak(device), _allocated(device)
            loss = model.loss_fn(logits, tokens)
            phases["loss_peak"], phases["after_loss_with_logits"] = _peak(device), _allocated(device)
            del logits
        phases["after_forward"] = _allocated(device)
        optimizer.zero_grad(set_to_none=True)  # Lightning's order: after the forward, before backward
        with loss_parallel_backward(parallel.loss_parallel):
            loss.backward()
        parallel.data_parallel.flush()
        phases["backward_peak"], phases["after_backward"] = _peak(device), _allocated(device)
        optimizer.step()
        phases["step_peak"] = _peak(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - t0, "phases_gib": phases,
                          "max_allocated_gib": max(v for k, v in phases.items() if k.endswith("peak")),
                          "max_reserved_gib": _peak.reserved / GIB,
                          "num_alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)})
        else:
            steps.append({"seconds": time.perf_counter() - t0})
        print(f"step {step}: {steps[-1]}", flush=True)
    est = predict(args.world, args.layers, args.precision, args.recompute, args.seq, args.batch,
                  (args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab), loss_upcast=args.loss_upcast,
                  zero=args.zero, tp=args.tp)
    return {"world": args.world, "zero": args.zero, "tp": args.tp, "layers": args.layers, "loss_upcast": args.loss_upcast, "precision": args.precision, "recompute": args.recompute,
            "seq": args.seq, "batch": args.batch, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "steps": steps, "planner_allocated_gib": est.memory.total / GIB,
            "planner_memory_gib": {k: v / GIB for k, v in asdict(est.memory).items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a small shape, on CPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--recompute", default="selective_op")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage (the published 8B rows: 3)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with sequence parallelism)")
    parser.add_argument("--loss-upcast", action="store_true", help="cast the logits to fp32 before the loss")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    shape = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=224, vocab=512, seq=64, batch=2) if args.tiny else \
        dict(layers=args.layers, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, batch=2)
    for key, value in shape.items():
        setattr(args, key, value)
    result = run(args)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
