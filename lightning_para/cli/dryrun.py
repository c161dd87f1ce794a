"""``lightning-para dryrun``: run the real code of chosen ranks of an N-rank job, on the meta device.

::

    lightning-para dryrun --model llama3-405b --gpus 16384 --layout "tp=8,pp=16,zero=1,sp=true" \\
        --seq-len 8192 --global-batch 2048 --ranks first,last
    lightning-para dryrun --model llama3-8b --gpus 64 --layout "tp=4,pp=2" --ranks 0,63 --json

Each chosen rank runs in a process of its own (:mod:`lightning_para.simulate.rank`: torch's fake
process group of ``--gpus`` ranks, the real mesh, stage split, TP/SP plans and ZeRO sharding, one
training step on meta tensors) and is printed beside the planner's prediction for its pipeline
rank, with the difference in %. ``--ranks first,last`` means global rank 0 and ``--gpus - 1``
(the first and the last pipeline rank). ``--precision`` (default ``bf16-true``: bf16 weights with fp32
masters) is the precision both the ranks and the planner use. Models: the planner's dense presets, a Hugging Face
``config.json`` or explicit shapes (``--layers --hidden --heads --kv-heads --ffn --vocab``, alone or replacing a
preset's; the same arguments as ``lightning-para plan``, :mod:`lightning_para.cli.model_args`), built as the
project's GPT recipe (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied), MoE models (``mixtral-8x7b``,
``deepseek-v3``, ``--experts``) as its MoE recipe, routed with the dry run's balanced assignment
(:func:`lightning_para.moe.balanced_routing`); DeepSeek's MLA is built as multi-head attention of about
its parameter count (:func:`gpt_arguments`)::

    lightning-para dryrun --model deepseek-v3 --gpus 2048 \\
        --layout "pp=16,ep=64,zero=1,activation_checkpointing=full" --seq-len 4096 --global-batch 15360

ZeRO-3 runs on FSDP2 itself (torchtitan's Llama 3 8B layout on 8 H100s)::

    lightning-para dryrun --model llama3-8b --gpus 8 --layout "zero=3,activation_checkpointing=selective_op" \\
        --seq-len 8192 --global-batch 16 --micro-batch 2 --ranks first

``--config CFG.yaml`` dry-runs a LightningCLI config instead (``recipes/*.yaml``, read as
``lightning-para plan --config`` reads it: :mod:`lightning_para.cli.run_config`)::

    lightning-para dryrun --config recipes/gpt-cpu-demo.yaml --gpus 8 --ranks first,last

Its LightningModule is built as the config says (on the meta device) and described for the planner
from that module; the layout is the strategy's (``trainer.strategy.init_args``: tp, pp, ep, cp,
zero, schedule, microbatches, sequence_parallel, ...) with ``dp`` derived from ``--gpus`` (default:
the config's devices x num_nodes), and ``--layout`` replaces single arguments; the sequence length and
global batch are the data section's (``seq_len``, ``global_batch_size``), each data-parallel rank
taking ``global_batch_size / dp`` sequences split into the pipeline's microbatches, as the run loads
them. The precision is the config's, which must be a ``*-true`` one (or give ``--precision``). The module
may wrap a transformers model (``recipes/hf-llama-cpu-demo.yaml``, ``hf-mixtral-cpu-demo.yaml``). A config
key the dry run cannot use (``zero=3`` under a pipeline, a strategy argument ParaStrategy does not take, ...) exits with status 2
and a message naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from lightning_para.calibrate.processes import measurement_context
from lightning_para.config import ParallelConfig
from lightning_para.spec.options import PRECISIONS, WORLD_SIZED
from lightning_para.plan.cluster import Training
from lightning_para.simulate.rank import RankDryRun, dry_run_rank
from lightning_para.cli.model_args import add_shape_arguments, model_name, resolve_model, shape_overrides
from lightning_para.cli.run_config import (
    RunConfigError,
    config_precision,
    data_value,
    describe_config_model,
    load_config,
    model_from_config,
    strategy_layout_arguments,
    trainer_value,
)
from lightning_para.plan.model import ModelDesc
from lightning_para.run_plan import parse_layout
from lightning_para.recipes.gpt import GPT
from lightning_para.recipes.moe import MoEGPT

PROG = "lightning-para dryrun"
# Autocast (`*-mixed`) does not act on meta tensors: the dry run runs the true precisions.
DRY_RUN_PRECISIONS = tuple(p for p in PRECISIONS if p.endswith("-true"))
GiB = 1024**3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Dry-run chosen ranks of an N-rank job on the meta device.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--config", "-c", help="a LightningCLI config (or a shipped config's name): its model, layout and data")
    what.add_argument("--model", type=model_name,
                      help="a published model (llama3-8b, -70b, -405b, mixtral-8x7b, deepseek-v3) or a Hugging Face"
                      " config.json path")
    add_shape_arguments(p, " Not with --config (its model is built as the config says).")
    p.add_argument("--gpus", type=int, help="ranks in the job (default with --config: devices x num_nodes)")
    p.add_argument("--layout", default="", help='ParaStrategy degrees, e.g. "tp=8,pp=16,zero=1,sp=true"'
                   " (with --config: replaces those of the config's strategy)")
    p.add_argument("--ranks", default="first,last", help="global ranks to run: first, last or numbers (comma-separated)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 8192; with --config: data.init_args.seq_len)")
    p.add_argument("--micro-batch", type=int,
                   help="sequences per forward (default: 1; with --config: global batch / dp / pipeline microbatches)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: dp x micro-batch x pp;"
                   " with --config: data.init_args.global_batch_size)")
    p.add_argument("--precision", choices=DRY_RUN_PRECISIONS,
                   help="bf16-true (default: bf16 weights, fp32 masters, as Llama trains), 16-true or 32-true"
                   " (with --config: the config's, if it is one of these)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def gpt_arguments(model: ModelDesc, seq_len: int) -> dict[str, Any]:
    """The GPT recipe's arguments for a planner model of the Llama kind (RMSNorm, RoPE, SwiGLU, untied);
    for an MoE model also :class:`~lightning_para.recipes.moe.MoEGPT`'s (routed experts, shared expert,
    dense first layers).

    Attention the recipe cannot build exactly (DeepSeek's MLA: ``attention_params`` set, or a head dim
    other than hidden / heads) becomes standard attention with the model's head dim,
    ``hidden / head_dim`` query heads and the divisor of them as key/value heads whose parameter count
    is nearest the model's (DeepSeek-V3: 56 x 128 multi-head, 205.5M parameters per layer against MLA's
    187.1M, +9.8%); :func:`attention_note` says what was built."""
    if model.norm != "rmsnorm" or not model.gated_mlp or model.tied_embeddings or model.bias:
        raise ValueError(
            f"`--model {model.name}`: the dry run builds Llama-style models (RMSNorm, SwiGLU, untied, no biases)."
            " Choose llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b or deepseek-v3, a config.json of that kind,"
            " or explicit shapes."
        )
    heads, kv_heads = _attention_heads(model)
    out: dict[str, Any] = dict(
        n_layer=model.layers, n_embd=model.hidden, n_head=heads, n_kv_head=kv_heads,
        mlp_hidden=model.ffn, vocab_size=model.vocab, block_size=seq_len,
    )
    if model.loss_upcast:  # torchtitan's and transformers' loss: fp32 logits
        out["loss_fp32"] = True
    if model.is_moe:
        out.update(
            num_experts=model.num_experts, top_k=model.top_k, capacity_factor=model.capacity_factor,
            moe_every=model.moe_every, first_k_dense=model.first_k_dense, expert_hidden=model.moe_ffn,
            shared_expert_hidden=model.shared_expert_ffn or None,
        )
    return out


def _attention_heads(model: ModelDesc) -> tuple[int, int]:
    """``(query heads, kv heads)`` of the recipe's attention for ``model`` (see :func:`gpt_arguments`)."""
    if model.attention_params is None and model.head_dim * model.heads == model.hidden:
        return model.heads, model.kv_heads or model.heads
    if model.hidden % model.head_dim:
        raise ValueError(
            f"`--model {model.name}`: the GPT recipe's head dim is hidden / heads; hidden={model.hidden} is not a"
            f" multiple of the model's head dim {model.head_dim}, so the dry run cannot build its attention."
        )
    heads = model.hidden // model.head_dim
    target = model.attention_params if model.attention_params is not None else \
        2 * model.hidden * (model.q_dim + model.kv_dim)
    kv = min((k for k in range(1, heads + 1) if heads % k == 0),
             key=lambda k: abs(2 * model.hidden * (model.hidden + k * model.head_dim) - target))
    return heads, kv


def attention_note(model: ModelDesc) -> str:
    """What :func:`gpt_arguments` built for ``model``'s attention, when it is not the model's own ("" if it is)."""
    heads, kv = _attention_heads(model)
    if (heads, kv) == (model.heads, model.kv_heads or model.heads) and model.attention_params is None:
        return ""
    built = 2 * model.hidden * (model.hidden + kv * model.hidden // heads)
    target = model.attention_params if model.attention_params is not None else 2 * model.hidden * (model.q_dim + model.kv_dim)
    return (
        f"attention built as {heads} query / {kv} kv heads of {model.hidden // heads}: {built / 1e6:.1f}M parameters"
        f" per layer against the model's {target / 1e6:.1f}M ({100 * (built - target) / target:+.1f}%)"
    )


def _ranks(text: str, world: int) -> list[int]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank = 0 if item == "first" else world - 1 if item == "last" else int(item) if item.isdigit() else -1
        if not 0 <= rank < world:
            raise ValueError(f"`--ranks` entry {item!r} is not first, last or a rank in [0, {world - 1}].")
        out.append(rank)
    return sorted(set(out))


@dataclass
class DryRunJob:
    """What the chosen ranks run: the model (``build`` makes it, on the meta device, as the planner's
    ``model`` describes it), the layout, the run, and the job's size."""

    model: ModelDesc
    config: ParallelConfig
    training: Training
    gpus: int
    build: Callable[[], nn.Module]


def _setup(args: argparse.Namespace) -> DryRunJob:
    return _config_setup(args) if args.config else _args_setup(args)


def _args_setup(args: argparse.Namespace) -> DryRunJob:
    if not args.gpus:
        raise ValueError("Give `--gpus N` (the ranks in the job).")
    model = resolve_model(args.model, shape_overrides(args))
    seq_len, micro_batch = args.seq_len or 8192, args.micro_batch or 1
    arguments = parse_layout(args.layout)
    pp = arguments.get("pp", 1)
    probe = ParallelConfig(**{**arguments, "microbatches": arguments.get("microbatches") or (pp if pp > 1 else None)})
    dims = probe.resolve_dims(args.gpus)
    global_batch = args.global_batch or dims.dp * micro_batch * max(pp, 1)
    per_rank = global_batch // (dims.dp * micro_batch)
    if per_rank * dims.dp * micro_batch != global_batch:
        raise ValueError(f"`--global-batch {global_batch}` must be a multiple of dp x micro-batch = {dims.dp * micro_batch}.")
    config = ParallelConfig(**{**arguments, "microbatches": per_rank if pp > 1 else None})
    training = Training(seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                        precision=args.precision or "bf16-true")
    kwargs = gpt_arguments(model, seq_len)
    cls = MoEGPT if model.is_moe else GPT
    return DryRunJob(model, config, training, args.gpus, lambda: cls(**kwargs))


def _config_setup(args: argparse.Namespace) -> DryRunJob:
    """The job a LightningCLI config describes, scaled to ``--gpus`` (see the module docstring)."""
    shapes = shape_overrides(args)
    if shapes:
        raise RunConfigError(f"`--{next(iter(shapes)).replace('_', '-')}` describes a model shape: give it with"
                             " `--model` or alone, not with `--config` (whose model is built as the config says).")
    cfg = load_config(args.config)
    where = f"(in {args.config})"
    devices, nodes = trainer_value(cfg, "devices"), trainer_value(cfg, "num_nodes") or 1
    gpus = args.gpus or (devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None)
    if not gpus:
        raise RunConfigError(f"`trainer.devices: {devices}` {where} is not a number of devices: give `--gpus N`.")
    arguments = strategy_layout_arguments(cfg)
    # --gpus sizes the job: data parallelism takes what the other degrees leave (dp_replicate is kept).
    for key in (*WORLD_SIZED, "layout_memory_gb"):
        arguments.pop(key, None)
    if arguments.pop("layout", None) is not None and not args.layout:
        raise RunConfigError(f"`trainer.strategy.init_args.layout` {where}: the dry run runs the degrees the config"
                             " gives; remove `layout` or give them with `--layout`.")
    arguments.update(parse_layout(args.layout))
    precision = args.precision or config_precision(cfg) or "32-true"
    if precision not in DRY_RUN_PRECISIONS:
        raise RunConfigError(
            f"`trainer.precision: {precision}` {where}: the dry run cannot run autocast, which does not act on meta"
            f" tensors; give `--precision` ({', '.join(DRY_RUN_PRECISIONS)})."
        )
    seq_len = args.seq_len or data_value(cfg, "seq_len")
    global_batch = args.global_batch or data_value(cfg, "global_batch_size")
    for value, key, flag in ((seq_len, "seq_len", "--seq-len"), (global_batch, "global_batch_size", "--global-batch")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RunConfigError(f"`data.init_args.{key}: {value}` {where} is not a positive integer; give `{flag}`.")
    try:
        probe = ParallelConfig(**arguments)
        dims = probe.resolve_dims(gpus)
    except (TypeError, ValueError) as err:
        raise RunConfigError(f"`trainer.strategy.init_args` {where} with `--gpus {gpus}`: {err}") from None
    batch_key = "--global-batch" if args.global_batch else "data.init_args.global_batch_size"
    if global_batch % dims.dp:
        raise RunConfigError(f"`{batch_key}: {global_batch}` is not divisible by dp={dims.dp} (`--gpus {gpus}`"
                             f" over the config's other degrees); give `--global-batch` or another `--gpus`.")
    per_rank = global_batch // dims.dp  # what each data-parallel rank loads per batch (TextDataModule)
    micro_batch = args.micro_batch
    if dims.pp > 1:
        microbatches = per_rank // micro_batch if micro_batch else probe.pipeline_microbatches
        if not microbatches or per_rank % microbatches or (micro_batch and microbatches * micro_batch != per_rank):
            raise RunConfigError(f"`{batch_key}: {global_batch}` gives {per_rank} sequences per dp rank (dp={dims.dp}),"
                                 f" which {microbatches} pipeline microbatches do not split evenly; give"
                                 " `--global-batch`, `--micro-batch` or `--layout microbatches=M`.")
        micro_batch = per_rank // microbatches
        arguments["microbatches"] = microbatches
    micro_batch = micro_batch or per_rank
    config = ParallelConfig(**arguments)
    training = Training(seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch, precision=precision)
    module = model_from_config(cfg)
    return DryRunJob(describe_config_model(module), config, training, gpus, lambda: model_from_config(cfg))


def _rank_process(args: argparse.Namespace, rank: int, env: dict[str, str], cwd: str, log: str) -> None:
    """One simulated rank in a process of its own (the fake process group is process-wide), in the command's
    environment and directory; ``log`` gets all it prints: its result's line, or its traceback."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for stream in (1, 2):
        os.dup2(fd, stream)
    sys.stdout = sys.stderr = open(fd, "w", buffering=1)  # noqa: SIM115 - the process's streams until it exits
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    job = _setup(args)
    result = dry_run_rank(job.build, job.config, job.gpus, rank, seq_len=job.training.seq_len, hidden=job.model.hidden,
                          micro_batch=job.training.micro_batch, model=job.model, training=job.training)
    print("DRYRUN-RESULT " + json.dumps(result.to_dict()), flush=True)


def _pct(measured: float, predicted: float) -> str:
    if predicted == 0:
        return "n/a" if measured else "0%"
    return f"{100 * (measured - predicted) / predicted:+.1f}%"


def render(results: list[RankDryRun]) -> str:
    """The per-rank table: measured, planner and difference, memory in GiB, collectives in GiB per step
    (MiB both, for a job whose peaks stay under 1 GiB: a CPU recipe's)."""
    lines = []
    largest = max((max(r.measured.peak, r.predicted_peak.total) for r in results), default=0.0)
    unit, size = ("GiB", GiB) if largest >= GiB else ("MiB", 1024**2)
    for r in results:
        coords = " ".join(f"{k}={v}" for k, v in r.coordinates.items())
        lines.append(
            f"rank {r.rank} of {r.world_size} ({coords}; pipeline rank {r.pipeline_rank}, {r.layers} layers,"
            + f" {r.microbatches} microbatch(es) through the pipeline runner, {r.in_flight} in flight)  wall: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items())
        )
        lines.append(f"  {'memory (' + unit + ')':<14}{'dry run':>10}{'planner':>10}{'diff':>9}")
        for row in r.memory_rows():
            m, p = row.measured, row.predicted
            lines.append(f"  {row.name:<14}{m / size:>10.2f}{p / size:>10.2f}{_pct(m, p):>9}")
        if r.measured.reserved is not None:  # modelled from the step's allocations; the planner counts tensors
            lines.append(f"  {'reserved':<14}{r.measured.reserved / size:>10.2f}{'-':>10}{'':>9}"
                         "   (the caching allocator's peak, modelled;"
                         f" {r.measured.reserved_expandable / size:.2f} with expandable_segments)")
        lines.append(f"  {'collectives':<28}{'calls':>7}{unit:>10}   planner: calls, {unit}")
        predicted = {}
        for c in r.predicted_comm:
            entry = predicted.setdefault((c.dim, c.op), [0, 0.0])
            entry[0] += c.calls
            entry[1] += c.bytes
        for c in r.comm:
            pc = predicted.get((c.dim, c.op))
            other = f"{pc[0]}, {pc[1] / size:.3f}" if pc else "-"
            lines.append(f"  {c.dim + ' ' + c.op:<28}{c.calls:>7}{c.bytes / size:>10.3f}   {other}")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        job = _setup(args)  # bad arguments (and a bad config) fail here, before any process starts
        ranks = _ranks(args.ranks, job.gpus)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    # Fresh processes from a fork server that imported torch, Lightning and this command once (not once per rank).
    context = measurement_context(["torch", "lightning_para.cli.dryrun"])

    def run_rank(rank: int) -> tuple[int, Optional[int], str, float]:
        start, log = time.perf_counter(), Path(logs, f"rank{rank}.log")
        log.touch()  # read even if the process dies before it starts
        process = context.Process(target=_rank_process, args=(args, rank, dict(os.environ), os.getcwd(), str(log)), daemon=True)
        process.start()
        process.join()
        return rank, process.exitcode, log.read_text(), time.perf_counter() - start

    # One process per rank (the fake process group is process-wide), as many at once as there are cores.
    with tempfile.TemporaryDirectory(prefix="lightning-para-dryrun-") as logs, \
            ThreadPoolExecutor(max_workers=max(1, min(len(ranks), os.cpu_count() or 1))) as pool:
        done = list(pool.map(run_rank, ranks))
    results = []
    for rank, exitcode, out, seconds in done:
        line = next((l for l in out.splitlines() if l.startswith("DRYRUN-RESULT ")), None)
        if exitcode != 0 or line is None:
            print(f"{PROG}: rank {rank} failed:\n{out[-4000:]}", file=sys.stderr)
            return 1
        result = RankDryRun.from_dict(json.loads(line[len("DRYRUN-RESULT "):]))
        result.seconds["process"] = seconds
        results.append(result)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        note = "" if args.config else attention_note(job.model)
        print((f"note: {note}\n\n" if note else "") + render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
