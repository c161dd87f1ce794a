"""Kernels per optimizer step: ParaStrategy against Lightning's strategy for the same semantics.

Every aten operator a training step dispatches that is not a view, a detach, an alias or a bare
allocation is a kernel launch on a GPU, where small models are launch-bound. This counts them on CPU
(:class:`~lightning_para.instrument.operators.TrafficCounter`'s ``kernels``) for a TinyLlama-size
transformers ``LlamaForCausalLM`` (hidden 256, 4 layers, 39 parameter tensors) with
``AdamW(foreach=True)``, per training step after warm-up (from the end of one step to the end of the
next: data, forward, backward, step guard, optimizer), on rank 0:

* ``devices=1``: Lightning's default strategy against ``ParaStrategy()`` in ``bf16-mixed``,
  ``32-true``, ``bf16-true`` (Lightning: all-bf16; ParaStrategy: fp32 masters) and ``bf16-true``
  with ``ParaPrecision(master_weights=False)`` (Lightning's semantics);
* ``devices=1``, ``32-true`` with gradient clipping by norm;
* 2 gloo processes, ``bf16-mixed``: Lightning's DDP against ZeRO-0, -1 and -2, and Lightning's
  ``ModelParallelStrategy`` with its FSDP2 recipe (``fully_shard`` per layer, then the root) against ZeRO-3.

    python benchmarks/kernel_counts.py [--cases single-bf16-mixed dp2-zero1 ...] [--out FILE]

``tests/distributed/test_kernel_counts.py`` holds the ratios.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from benchmarks.common import TokenData, quiet_trainer_kwargs  # noqa: E402
from lightning_para.instrument.operators import TrafficCounter  # noqa: E402

SEQ, BATCH, STEPS, WARMUP = 32, 2, 4, 2
# The finite check's kernels, which Lightning's strategies do not run (reliability/step_guard.py): one fused norm of
# the gradients and one concatenation of the notes; with several ranks at most four more: a stack and a dot product
# of the norms (and a division by their replication), the all-reduce.
GUARD_KERNELS = {1: 2, 2: 6}


@dataclass(frozen=True)
class Case:
    """One comparison: ``world`` processes, a precision, Lightning's side and ParaStrategy's, and the target
    (ParaStrategy's count at most ``target`` times Lightning's)."""

    world: int
    precision: str
    lightning: str
    para: str
    target: float = 1.00
    clip: bool = False  # gradient clipping by norm (Trainer(gradient_clip_val=1.0))


CASES = {
    "single-bf16-mixed": Case(1, "bf16-mixed", "auto", "para"),
    "single-32-true": Case(1, "32-true", "auto", "para"),
    "single-bf16-true": Case(1, "bf16-true", "auto", "para", target=1.05),
    "single-bf16-true-no-masters": Case(1, "bf16-true", "auto", "para-no-masters"),
    "single-32-true-clipped": Case(1, "32-true", "auto", "para", clip=True),
    "dp2-zero0": Case(2, "bf16-mixed", "ddp", "para-zero0"),
    "dp2-zero1": Case(2, "bf16-mixed", "ddp", "para-zero1"),
    "dp2-zero2": Case(2, "bf16-mixed", "ddp", "para-zero2"),
    "dp2-zero3": Case(2, "bf16-mixed", "fsdp2", "para-zero3"),
}


class TinyLlama(L.LightningModule):
    """transformers' ``LlamaForCausalLM`` at TinyLlama's shape, scaled down (hidden 256, 4 layers, GQA 4/2)."""

    def __init__(self, fsdp2: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             tie_word_embeddings=False, attn_implementation="sdpa")
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config)
        self.fsdp2 = fsdp2

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        # Through `__call__`: FSDP2's root hooks (Lightning's recipe shards the LightningModule) gather its weights.
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        # Lightning's FSDP2 recipe for ModelParallelStrategy: each layer a unit, then the root.
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class StepKernels(Callback):
    """The kernels counted between consecutive training-step ends, after ``warmup`` steps."""

    def __init__(self, counter: TrafficCounter, warmup: int) -> None:
        self.counter, self.warmup = counter, warmup
        self.marks: list[Counter] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.marks.append(Counter(self.counter.kernels))

    def steps(self) -> list[Counter]:
        return [later - earlier for earlier, later in zip(self.marks[self.warmup - 1 :], self.marks[self.warmup :])]


def _strategy(side: str, world: int) -> tuple[Any, list, TinyLlama]:
    """``side``: ``auto``, ``ddp``, ``fsdp2`` (Lightning's), ``para``, ``para-zeroN``, ``para-no-masters``; a
    ParaStrategy side ending in ``-unguarded`` runs without the step guard (Lightning's semantics)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_para import ParaPrecision, ParaStrategy

    if side in ("auto", "ddp"):
        return side, [], TinyLlama()
    if side == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), [], TinyLlama(fsdp2=True)
    side, unguarded = side.removesuffix("-unguarded"), side.endswith("-unguarded")
    options: dict[str, Any] = {"check_finite": False, "on_sigterm": None} if unguarded else {}
    if side.startswith("para-zero"):
        options["zero"] = int(side[len("para-zero"):])
    plugins = [ParaPrecision("bf16-true", master_weights=False)] if side == "para-no-masters" else []
    return ParaStrategy(**options), plugins, TinyLlama()


def count_side(side: str, precision: str, world: int = 1, clip: bool = False) -> Counter:
    """Kernels per training step (by operator) of one side, on this rank; checks every measured step agrees."""
    strategy, plugins, module = _strategy(side, world)
    counter = TrafficCounter()
    steps = StepKernels(counter, WARMUP)
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=STEPS, callbacks=[steps], plugins=plugins,
                        gradient_clip_val=1.0 if clip else None,
                        **quiet_trainer_kwargs(precision=None if plugins else precision))
    with counter:
        trainer.fit(module, datamodule=TokenData(samples=BATCH * STEPS * world, batch_size=BATCH, seq_len=SEQ))
    counts = steps.steps()
    totals = {sum(c.values()) for c in counts}
    if len(totals) != 1:
        raise RuntimeError(f"{side}: the steps after warm-up dispatched different counts {sorted(totals)}")
    return counts[-1]


def count_case(case: Case, pool: Optional[Any] = None) -> tuple[Counter, Counter]:
    """``(Lightning's kernels, ParaStrategy's)`` per step on rank 0; ``pool``: a WorkerPool of ``case.world``."""
    if pool is None:
        if case.world != 1:
            raise ValueError(f"`pool` is needed for a case of {case.world} processes.")
        return (count_side(case.lightning, case.precision, 1, case.clip),
                _in_own_group(count_side, case.para, case.precision, 1, case.clip))
    return tuple(pool.run(count_side, side, case.precision, case.world, case.clip, timeout=600)[0]  # type: ignore[return-value]
                 for side in (case.lightning, case.para))


def _in_own_group(fn: Any, *args: Any) -> Any:
    """ParaStrategy at devices=1 starts a process group of one rank in this process: leave none behind."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    try:
        return fn(*args)
    finally:
        if dist.is_initialized() and not existed:
            dist.destroy_process_group()


def difference(ours: Counter, theirs: Counter, top: Optional[int] = 6) -> str:
    """The operators whose counts differ most, ``name +n`` (ours minus theirs)."""
    delta = Counter(ours)
    delta.subtract(theirs)
    items = sorted(((n, d) for n, d in delta.items() if d), key=lambda item: -abs(item[1]))[:top]
    return ", ".join(f"`{n}` {d:+d}" for n, d in items) or "none"


def render(results: dict[str, tuple[Counter, Counter]]) -> str:
    lines = ["| case | precision | Lightning | kernels | ParaStrategy | kernels | ratio | target | largest differences |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (theirs, ours) in results.items():
        case = CASES[name]
        a, b = sum(theirs.values()), sum(ours.values())
        lines.append(f"| {name} | {case.precision} | {case.lightning} | {a} | {case.para} | {b} | {b / a:.3f} |"
                     f" <= {case.target:.2f} | {difference(ours, theirs)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--detail", action="store_true", help="print every operator whose count differs")
    args = parser.parse_args(argv)
    from tests.harness import WorkerPool

    results: dict[str, tuple[Counter, Counter]] = {}
    pools: dict[int, Any] = {}
    try:
        for name in args.cases:
            case = CASES[name]
            pool = pools.get(case.world) or pools.setdefault(case.world, WorkerPool(case.world))
            results[name] = count_case(case, pool)
            theirs, ours = results[name]
            print(f"{name}: Lightning {sum(theirs.values())}, ParaStrategy {sum(ours.values())}", flush=True)
            if args.detail:
                print(f"  {difference(ours, theirs, top=None)}", flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    text = (f"# Kernels per optimizer step, ParaStrategy vs Lightning\n\n"
            f"`python benchmarks/kernel_counts.py {' '.join(argv if argv is not None else sys.argv[1:])}`;"
            f" torch {torch.__version__}, lightning {L.__version__}. TinyLlama-size `LlamaForCausalLM` (hidden 256,"
            f" 4 layers, 39 parameter tensors), `AdamW(foreach=True)`, batch {BATCH} x {SEQ} tokens; aten operators per"
            " training step after warm-up on rank 0, views, detaches, aliases, allocations and profiler markers left out.\n\n"
            + render(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
