"""The ``ParaStrategy`` YAML of a planned layout, and the text grid of the planner's tables
(:mod:`.result` draws a :class:`~lightning_para.plan.result.PlanResult` with them)."""

from __future__ import annotations

from lightning_para.plan.cost import Estimate, bucket_bytes, format_bytes
from lightning_para.plan.layout import Layout
from lightning_para.spec.options import POSITIONAL

_ALWAYS_SHOWN = (*POSITIONAL, "sequence_parallel", "schedule", "microbatches", "virtual_stages", "activation_checkpointing")
_DEFAULTS = Layout().strategy_kwargs()  # the layout options' defaults, which are ParaStrategy's


def grid(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, a dashed line under the header."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def strategy_yaml(choice: Estimate) -> str:
    """``trainer.strategy`` for LightningCLI: ParaStrategy's arguments for ``choice``, with its prediction."""
    layout = choice.layout
    pipelined = layout.pp > 1
    # Layout.strategy_kwargs() is the one Layout -> ParaStrategy mapping; shown: the degrees and the
    # options always printed, plus any other option away from ParaStrategy's default.
    kwargs = layout.strategy_kwargs()
    kwargs["microbatches"] = choice.microbatches if pipelined else None  # the count the estimate priced
    args: dict[str, object] = {k: kwargs[k] for k in _ALWAYS_SHOWN}
    args.update({k: v for k, v in kwargs.items() if k not in args and v != _DEFAULTS.get(k)})
    args.pop("bucket_size_mb", None)
    if layout.dp_replicate == 1:  # plain data parallel: dp alone says it
        args.pop("dp_replicate", None)
        args.pop("dp_shard", None)
    if layout.zero < 3 and layout.group("dp")[0] > 1:
        bucket = layout.bucket_size_mb or bucket_bytes(layout.group("dp")[0], choice.training.bytes.grad) / 2**20
        args["bucket_size_mb"] = round(bucket)
    m = choice.memory
    lines = [
        f"# lightning-para plan: {choice.model.name} on {choice.cluster.world_size} devices: {layout.label()}",
        (
            f"# predicted per device: {format_bytes(m.total)} of {format_bytes(choice.cluster.usable_memory)};"
            f" bubble {choice.bubble:.1%}; step {choice.step_seconds:.3g} s; MFU {choice.mfu:.1%}"
        ),
    ]
    per_batch = choice.training.micro_batch * choice.microbatches
    lines.append(f"# batch per data-parallel rank and forward: {per_batch} x {choice.training.seq_len} tokens")
    counts = [r.layers for r in choice.ranks]
    if pipelined and len(set(counts)) > 1:
        lines.append(f"# layers per pipeline rank: {counts}")
    lines += ["trainer:", "  strategy:", "    class_path: lightning_para.ParaStrategy", "    init_args:"]
    lines += [f"      {key}: {_yaml_value(value)}" for key, value in args.items()]
    lines.append(f"  precision: {choice.training.precision}")
    if choice.accumulation > 1:
        lines.append(f"  accumulate_grad_batches: {choice.accumulation}")
    return "\n".join(lines) + "\n"


def _yaml_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)
