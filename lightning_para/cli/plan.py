"""``lightning-para plan``: which layout? The planner from the command line.

::

    # a published model on a cluster
    lightning-para plan --model llama3-8b --gpus 8 --gpu h100 --seq-len 8192 --global-batch 64
    lightning-para plan --model llama3-70b --gpus 64 --gpu-memory 80 --peak-tflops 989 --intra-bw 450 \\
        --inter-bw 50 --seq-len 8192 --global-batch 512 --png plan.png
    # a Hugging Face config.json, explicit shapes, or a preset with some shapes replaced
    lightning-para plan --model path/to/config.json --gpus 8 --gpu h100 --seq-len 4096 --global-batch 64
    lightning-para plan --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 \
        --gpus 8 --gpu h100 --seq-len 8192 --global-batch 64
    lightning-para plan --model llama3-8b --layers 16 --gpus 8 --gpu h100 --seq-len 8192 --global-batch 64
    # your LightningCLI config (its model part, on the meta device), on its devices or others
    lightning-para plan --config recipes/gpt-cpu-demo.yaml
    lightning-para plan --config my.yaml --gpus 16 --gpu a100-80gb
    # ... and check the best layout (or --layout) against a few measured steps on this machine
    lightning-para plan --config recipes/gpt-cpu-demo.yaml --validate --steps 6

It prints the ranked layouts that fit (memory per component, comm per dimension, bubble, step
time, MFU), the excluded layouts with the reason, and the best layout's ``ParaStrategy``
arguments as YAML to paste. ``--png`` draws the memory of the ranked layouts against the
device limit. ``--validate`` runs the layout for ``--steps`` steps with the profiler's
prediction check and prints predicted against measured per rank.

With ``--config``, the run's numbers come from the config unless given: devices x nodes,
``data.init_args.seq_len`` and ``global_batch_size`` (each data-parallel rank loads
``global_batch_size / dp`` sequences per batch, as ``TextDataModule`` does), the precision and
``accumulate_grad_batches``; on a CPU config, the machine's RAM divided among the processes.
Tensor parallelism is searched only for a model with a tensor-parallel plan, pipeline
parallelism only for one with ``configure_pipeline()``.

Bad arguments exit with status 2 and a message naming the argument.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from lightning_para.cli.model_args import add_shape_arguments, model_name, resolve_model, shape_overrides
from lightning_para.plan.cluster import ACTIVATION_PROFILES, GPU_SPECS, PRECISIONS, Cluster, Training
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.presets import PRESETS
from lightning_para.plan.search import SearchSpace, search
from lightning_para.spec.options import ACTIVATION_CHECKPOINTING, ZERO_STAGES

# A config's model, this machine's figures and a validation run need torch, Lightning and the runtime: each is
# imported where that path starts (`# lazy:`), so `--help` and a published model's plan load the planner alone.

PROG = "lightning-para plan"


class PlanError(ValueError):
    """A bad argument or an input the planner cannot use (exit status 2)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Rank the parallel layouts of a model on a cluster.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--config", "-c", help="a LightningCLI config (or a shipped config's name): its model part")
    what.add_argument("--model", type=model_name, help=f"a published model ({', '.join(sorted(PRESETS))}) or a Hugging Face config.json path")
    add_shape_arguments(p, " Not with --config (its model is built as the config says).")
    hw = p.add_argument_group("cluster")
    hw.add_argument("--gpus", type=int, help="devices in total (default with --config: devices x num_nodes)")
    hw.add_argument("--gpus-per-node", type=int, help="devices per node (default: 8, or --gpus if fewer)")
    hw.add_argument("--gpu", choices=sorted(GPU_SPECS), help="a known GPU: memory, peak FLOP/s and links")
    hw.add_argument("--gpu-memory", type=float, metavar="GB", help="memory per device")
    hw.add_argument("--peak-tflops", type=float, help="dense 16-bit peak TFLOP/s per device")
    hw.add_argument("--intra-bw", type=float, metavar="GB/s", help="per-device bandwidth inside a node, one direction")
    hw.add_argument("--inter-bw", type=float, metavar="GB/s", help="per-device bandwidth between nodes, one direction")
    hw.add_argument("--efficiency", type=float,
                    help="fraction of peak the matmuls reach, one figure for every shape (default: with --gpu, the"
                         " GPU's GEMM curve by shape, docs/planner.md; else 0.5)")
    hw.add_argument("--reserved-memory", type=float, metavar="GB", default=0.0, help="memory the framework keeps")
    run = p.add_argument_group("run")
    run.add_argument("--seq-len", type=int, help="tokens per sequence")
    run.add_argument("--global-batch", type=int, help="sequences per optimizer step over all data-parallel ranks")
    run.add_argument("--micro-batch", type=int, help="sequences per forward (default with --config: as the run loads them)")
    run.add_argument("--precision", choices=PRECISIONS)
    run.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    run.add_argument("--activation-profile", choices=ACTIVATION_PROFILES, default="torch",
                     help="whose code's saved tensors: ParaStrategy's (torch, default) or Megatron-LM's fused kernels")
    run.add_argument("--fp32-grad-accumulation", action="store_true",
                     help="gradients accumulate and reduce in fp32 whatever the weights' dtype (Megatron-LM, Llama 3)")
    space = p.add_argument_group("search")
    space.add_argument("--tp", help="tensor-parallel degrees to try, e.g. 1,2,4")
    space.add_argument("--pp", help="pipeline degrees to try")
    space.add_argument("--ep", help="expert-parallel degrees to try")
    space.add_argument("--zero", help="ZeRO stages to try (default 0,1,2,3)")
    space.add_argument("--recompute", default="none,full", help="recomputation to try: none, full, selective, selective_op")
    space.add_argument("--all-variants", action="store_true", help="list every variant, not the fastest per degrees")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="ranked layouts to print")
    out.add_argument("--rejected", type=int, default=15, help="excluded layouts to print")
    out.add_argument("--png", help="draw the ranked layouts' memory against the device limit to this file")
    check = p.add_argument_group("validate")
    check.add_argument("--validate", action="store_true", help="run the layout a few steps here and compare")
    check.add_argument("--layout", help='the layout to validate instead of the best, e.g. "tp=2,pp=2"')
    check.add_argument("--steps", type=int, default=6, help="steps of the validation run (>= 3)")
    return p


def _ints(text: Optional[str], name: str) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PlanError(f"`--{name} {text}` must be comma-separated integers, e.g. --{name} 1,2,4.") from None
    if not values or any(v < (0 if name == "zero" else 1) for v in values):
        raise PlanError(f"`--{name} {text}` must list {'ZeRO stages 0-3' if name == 'zero' else 'positive integers'}.")
    return values


def _cluster(args: argparse.Namespace, gpus: int, cpu_config: bool) -> Cluster:
    per_node = args.gpus_per_node or (gpus if gpus < 8 else 8)
    if gpus % per_node:
        raise PlanError(f"`--gpus {gpus}` is not a multiple of `--gpus-per-node {per_node}`.")
    overrides: dict[str, float] = {}
    for name, key, scale in (("gpu_memory", "memory_bytes", 1e9), ("peak_tflops", "peak_flops", 1e12),
                             ("intra_bw", "intra_node_bw", 1e9), ("inter_bw", "inter_node_bw", 1e9)):
        if getattr(args, name) is not None:
            overrides[key] = getattr(args, name) * scale
    if args.efficiency is not None:
        overrides["efficiency"] = args.efficiency
    overrides["reserved_bytes"] = args.reserved_memory * 1e9
    if args.gpu is not None:
        return Cluster.of(args.gpu, nodes=gpus // per_node, gpus_per_node=per_node, **overrides)
    if cpu_config and "memory_bytes" not in overrides:
        import torch  # lazy: this machine's figures

        from lightning_para.calibrate.machine import local_cluster  # lazy: with them

        local = local_cluster(gpus, per_node, torch.device("cpu"), peak_flops=overrides.get("peak_flops"))
        return Cluster(**{**{f: getattr(local, f) for f in ("nodes", "gpus_per_node", "memory_bytes", "peak_flops",
                          "intra_node_bw", "inter_node_bw", "intra_node_latency", "inter_node_latency")}, **overrides})
    base = dict(GPU_SPECS["h100"])  # `--gpu-memory` without `--gpu` (`_require_all` asked for one of them)
    base.update(overrides)
    return Cluster(nodes=gpus // per_node, gpus_per_node=per_node, **base)


def _shape_of_batch(args: argparse.Namespace, config: Optional[dict[str, Any]]) -> tuple[Optional[int], Optional[int]]:
    """``(seq_len, global_batch)``: the arguments, else the config's data section."""
    if config is None:
        return args.seq_len, args.global_batch
    from lightning_para.cli.run_config import data_value  # lazy: a config's reader (Lightning)

    return args.seq_len or data_value(config, "seq_len"), args.global_batch or data_value(config, "global_batch_size")


def _require_all(args: argparse.Namespace, config: Optional[dict[str, Any]], gpus: Optional[int], cpu_config: bool) -> None:
    """One error naming every missing argument the search needs, rather than one per try."""
    missing = []
    if not gpus:
        missing.append("`--gpus N`" + (" (the config's trainer.devices is not a number)" if config else ""))
    if args.gpu is None and args.gpu_memory is None and not cpu_config:
        missing.append("the devices: `--gpu NAME` (" + ", ".join(sorted(GPU_SPECS)) + ") or `--gpu-memory GB`")
    from_data = " (the config's data section does not say it)" if config else ""
    seq_len, batch = _shape_of_batch(args, config)
    missing += [f"`{flag}`{from_data}" for flag, value in (("--seq-len", seq_len), ("--global-batch", batch)) if not value]
    if missing:
        raise PlanError("Give " + "; ".join(missing) + ".")


def _training(args: argparse.Namespace, config: Optional[dict[str, Any]]) -> Training:
    seq_len, batch = _shape_of_batch(args, config)  # both given: `_require_all` ran first
    if config is None:
        return Training(seq_len=seq_len, global_batch=batch, micro_batch=args.micro_batch or 1,
                        precision=args.precision or "bf16-mixed", optimizer=args.optimizer, **_stack(args))
    from lightning_para.cli.run_config import config_precision, trainer_value  # lazy: a config's reader (Lightning)

    precision = args.precision or config_precision(config) or "bf16-mixed"
    if precision not in PRECISIONS:
        raise PlanError(f"The config's precision {precision!r} is not one the planner models: {', '.join(PRECISIONS)}.")
    accumulation = int(trainer_value(config, "accumulate_grad_batches") or 1)
    if args.micro_batch is not None:
        return Training(seq_len=seq_len, global_batch=batch * accumulation, micro_batch=args.micro_batch,
                        precision=precision, optimizer=args.optimizer, **_stack(args))
    # As the run loads it: each dp rank global_batch / dp per batch, split into pipeline microbatches.
    return Training(seq_len=seq_len, global_batch=batch * accumulation, micro_batch=None, accumulation=accumulation,
                    precision=precision, optimizer=args.optimizer, **_stack(args))


def _stack(args: argparse.Namespace) -> dict[str, Any]:
    """Whose training code is priced (another stack's published run): `Training`'s planner-only settings."""
    return {"activation_profile": args.activation_profile, "fp32_grad_accumulation": args.fp32_grad_accumulation}


def _space(args: argparse.Namespace, module: Any, model: ModelDesc, world: int) -> SearchSpace:
    recompute = []
    for item in args.recompute.split(","):
        value = None if item.strip().lower() in ("none", "null", "") else item.strip()
        if value not in ACTIVATION_CHECKPOINTING:
            raise PlanError(f"`--recompute {args.recompute}`: choose among none, full, selective, selective_op.")
        recompute.append(value)
    capable = None
    if module is not None:  # a config's model: the degrees it supports (its tp plan, its pipeline contract)
        from lightning_para.auto_layout import search_space  # lazy: reads a LightningModule (Lightning)
        from lightning_para.config import ParallelConfig  # lazy: with it

        capable = search_space(ParallelConfig(), module, model, world)
    tp = _ints(args.tp, "tp") or (capable.tp if capable is not None else None)
    pp = _ints(args.pp, "pp") or (capable.pp if capable is not None else None)
    return SearchSpace(
        tp=tp, pp=pp, ep=_ints(args.ep, "ep"), zero=_ints(args.zero, "zero") or ZERO_STAGES,
        recompute=tuple(recompute), best_variant_only=not args.all_variants,
    )


def validate(config_path: str, arguments: dict[str, Any], world: int, steps: int) -> Any:
    """Run ``config_path`` under ``arguments`` (ParaStrategy's) for ``steps`` steps on this machine with the
    profiler's prediction check; returns the comparison. Inside a process group (torchrun, a test pool)
    it runs in this process on every rank; otherwise it launches ``lightning-para fit`` with ``world``
    processes and reads the comparison from the run's ``para_summary.json`` (a
    :class:`~lightning_para.instrument.compare.PredictionCheck`)."""
    import torch.distributed as dist  # lazy: a validation run (torch, Lightning, the runtime)

    from lightning_para.cli.fit import run_cli  # lazy: with it
    from lightning_para.instrument.compare import PredictionCheck  # lazy: with it
    from lightning_para.observe.profiler import ParaProfiler  # lazy: with it
    from lightning_para.run_plan import strategy_overrides  # lazy: with it

    if steps < 3:
        raise PlanError(f"`--steps {steps}`: validation needs at least 3 (a warm-up, a traced and a timed step).")
    with tempfile.TemporaryDirectory(prefix="lightning-para-validate-") as root:
        args = [
            "fit", "--config", config_path, "--trainer.devices", str(world), "--trainer.num_nodes", "1",
            *strategy_overrides(arguments), "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", root,
            "--profiling.comm_every_n_steps", "2", "--profiling.timeline_every_n_steps", "0",
            "--profiling.memory_every_n_steps", "0", "--profiling.check_predictions", "true",
        ]
        if dist.is_available() and dist.is_initialized():
            cli = run_cli(args)
            profiler = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ParaProfiler))
            if profiler.prediction_check is None:
                raise PlanError("The validation run produced no prediction check (see its log for why).")
            return profiler.prediction_check
        done = subprocess.run([sys.executable, "-m", "lightning_para.cli", *args], check=False)
        summaries = sorted(Path(root).glob("lightning_logs/version_*/para_summary.json"))
        if done.returncode != 0 or not summaries:
            raise PlanError(f"The validation run failed (exit status {done.returncode}); see its output above.")
        summary = json.loads(summaries[-1].read_text())
        if "prediction" not in summary:
            raise PlanError("The validation run produced no prediction check (see its log for why).")
        return PredictionCheck.from_dict(summary["prediction"])


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)  # exits 2 with argparse's message on a malformed command line
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch", "micro_batch", "top", "rejected"):
        value = getattr(args, name)
        if value is not None and value < (0 if name in ("top", "rejected") else 1):
            raise PlanError(f"`--{name.replace('_', '-')} {value}` must be a positive integer.")
    shapes = shape_overrides(args)
    if args.config and shapes:
        raise PlanError(f"`--{next(iter(shapes)).replace('_', '-')}` describes a model shape: give it with `--model` or"
                        " alone, not with `--config` (whose model is built as the config says).")
    config, module, gpus, cpu_config = None, None, args.gpus, False
    if args.config:
        from lightning_para.cli.run_config import (  # lazy: a config's model (torch, Lightning)
            describe_config_model, load_config, model_from_config, trainer_value,
        )

        config = load_config(args.config)
        module = model_from_config(config)
        model = describe_config_model(module)
        devices, nodes = trainer_value(config, "devices"), int(trainer_value(config, "num_nodes") or 1)
        gpus = gpus or (int(devices) * nodes if isinstance(devices, int) else None)
        cpu_config = trainer_value(config, "accelerator") == "cpu"
    else:
        model = resolve_model(args.model, shapes)
    _require_all(args, config, gpus, cpu_config)
    cluster = _cluster(args, gpus, cpu_config)
    training = _training(args, config)
    result = search(model, cluster, training, _space(args, module, model, gpus))
    print(result.table(args.top))
    print()
    print("Excluded layouts:")
    print(result.rejected_table(args.rejected))
    if result.best is not None:
        print()
        print(result.strategy_yaml())
    if args.png:
        print(f"chart: {result.save_chart(args.png)}")
    if args.validate:
        if config is None:
            raise PlanError("`--validate` runs your config: give `--config`.")
        if args.layout:
            from lightning_para.run_plan import parse_layout  # lazy: a run's layout (the command's --layout)

            arguments = {"dp": "auto", **parse_layout(args.layout)}
        elif result.best is not None:
            arguments = result.best.layout.strategy_kwargs()
        else:
            raise PlanError("No layout fits, so there is nothing to validate; give `--layout`.")
        check = validate(args.config, arguments, gpus, args.steps)
        import torch.distributed as dist  # lazy: validate ran under torch

        if not dist.is_initialized() or dist.get_rank() == 0:
            print()
            print(check.table())
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-para plan ...``: 0 on success, 2 on a bad argument (with a message, no traceback)."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except ValueError as err:  # PlanError, the config's ConfigurationError, a layout's errors
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


__all__ = ["PlanError", "load_config", "main", "model_from_config", "validate"]
