"""The ``ParaStrategy`` YAML of a planned layout, and the text grid of the planner's tables
(:mod:`.result` draws a :class:`~lightning_para.plan.result.PlanResult` with them)."""

from __future__ import annotations

from lightning_para.plan.cost import Estimate, bucket_bytes, format_bytes

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
    args: dict[str, object] = {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "zero": layout.zero,
        "sequence_parallel": layout.sequence_parallel,
        "schedule": layout.schedule,
        "microbatches": choice.microbatches if pipelined else None,
        "virtual_stages": layout.virtual_stages,
        "activation_checkpointing": layout.recompute,
    }
    if layout.zero < 3 and layout.group("dp")[0] > 1:
        bucket = layout.bucket_mb or bucket_bytes(layout.group("dp")[0], choice.training.bytes.grad) / 2**20
        args["bucket_size_mb"] = round(bucket)
    if layout.zero >= 2 and layout.zero_accumulation != "no_sync":
        args["zero_accumulation"] = layout.zero_accumulation
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
    return str(value)
