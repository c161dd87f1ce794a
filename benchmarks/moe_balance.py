"""Expert load balance of the MoE CPU demo: the auxiliary loss against auxiliary-loss-free balancing.

Trains the model and data of ``recipes/moe-cpu-demo.yaml`` (``MoEGPT`` preset ``tiny``, 4 experts, top-2, z-loss 0.001,
an MoE layer in every other block; byte-level text, 16 sequences of 64 tokens per step, lr 3e-3) for
``--steps`` optimizer steps on one process, on the global batch: the demo's ``ep=2`` layout computes the
same steps (``tests/distributed/test_expert_parallel.py``: ep2 and dp4 x ep2 match one device within
1e-5, bias included). Each run counts the assignments every expert received in each step and reports,
per MoE layer, the max/mean load over the experts: of the last step, and of the last 10 steps summed.

* ``bias``: the demo as configured, DeepSeek-V3's selection bias (``bias_update_rate=0.001``), no balancing loss;
* ``aux``: Switch's balancing loss instead (``balance_loss_weight=0.01``, the recipe's default);
* ``both``: the bias beside the balancing loss.

    python benchmarks/moe_balance.py --steps 200 --out benchmarks/results/moe_balance_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import load_average, machine_header  # noqa: E402
from lightning_para.moe import MoEBiasUpdate, moe_layers  # noqa: E402
from lightning_para.recipes import MoEGPT, TextDataModule  # noqa: E402

DEMO = dict(preset="tiny", num_experts=4, top_k=2, capacity_factor=None, moe_every=2, lr=0.003, warmup_steps=10,
            sample_tokens=0)
RUNS = {"aux": {}, "bias": {"bias_update_rate": 0.001, "balance_loss_weight": 0.0},
        "both": {"bias_update_rate": 0.001}}


class LoadPerStep(L.Callback):
    """Each MoE layer's assignments per expert in every training step (this process routes the global batch)."""

    def __init__(self) -> None:
        self.loads: dict[str, list[list[int]]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for name, layer in moe_layers(pl_module):
            self.loads.setdefault(name, []).append(layer.pop_stats().tokens_per_expert)


def imbalance(counts: list[int]) -> float:
    return max(counts) / (sum(counts) / len(counts))


def train(run: str, steps: int) -> tuple[dict[str, tuple[float, float]], float]:
    L.seed_everything(1234, verbose=False)
    model = MoEGPT(**DEMO, **RUNS[run])
    loads = LoadPerStep()
    callbacks = [loads] + ([MoEBiasUpdate()] if "bias_update_rate" in RUNS[run] else [])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(model, datamodule=TextDataModule(seq_len=64, global_batch_size=16))
    seconds = time.perf_counter() - start
    result = {}
    for name, per_step in loads.loads.items():
        window = [sum(c) for c in zip(*per_step[-10:])]
        result[name] = (imbalance(per_step[-1]), imbalance(window))
    return result, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", default="aux,bias,both")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = load_average()
    rows = ["| run | layer | max/mean load, step {s} | max/mean load, steps {a}-{s} | run time s |".format(
        s=args.steps, a=args.steps - 9), "|---|---|---|---|---|"]
    for run in args.runs.split(","):
        result, seconds = train(run, args.steps)
        for name, (last, window) in result.items():
            rows.append(f"| {run} | `{name}` | {last:.3f} | {window:.3f} | {seconds:.0f} |")
        print(rows[-len(result):], flush=True)
    command = f"python benchmarks/moe_balance.py --steps {args.steps} --runs {args.runs}"
    text = machine_header(command, load_before, threads="one process, one intra-op thread") + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
