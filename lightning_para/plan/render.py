"""Text tables, the ``ParaStrategy`` YAML and a PNG memory chart for a :class:`~lightning_para.plan.search.PlanResult`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lightning_para.plan.cost import Estimate, bucket_bytes, format_bytes, memory_unit
from lightning_para.plan.layout import Layout

if TYPE_CHECKING:
    from lightning_para.plan.search import PlanResult

_COMM_DIMS = ("tp", "cp", "ep", "pp", "dp", "edp", "dp_replicate")
_ALWAYS_SHOWN = ("dp", "tp", "pp", "ep", "zero", "sequence_parallel", "schedule", "microbatches", "virtual_stages",
                 "activation_checkpointing")
_DEFAULTS = Layout().strategy_kwargs()  # the layout options' defaults, which are ParaStrategy's


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fits_table(result: "PlanResult", limit: int = 10) -> str:
    """Rank, layout, memory breakdown, bubble, communication per dimension per step, step time, MFU
    (in GB, or MB when every layout needs less than a GB)."""
    largest = max([item.memory.total for item in result.fits[:limit]] + [0.0])
    unit = memory_unit(largest)
    header = ["#", "layout", f"memory {unit[0]} (p/g/o/act/buf)", "bubble", f"comm {unit[0]}/step", "step s", "MFU"]
    rows = []
    for i, item in enumerate(result.fits[:limit], 1):
        m = item.memory
        parts = "/".join(format_bytes(v, unit, False) for v in (m.params, m.grads, m.optimizer, m.activations, m.buffers))
        comm = item.comm_bytes()
        crossing = item.crosses_nodes()
        comm_text = " ".join(
            f"{dim}{'*' if crossing.get(dim) else ''}={comm[dim] / unit[1]:.3g}" for dim in _COMM_DIMS if dim in comm
        )
        rows.append([
            str(i), item.layout.label(), f"{format_bytes(m.total, unit, False)} ({parts})", f"{item.bubble:.1%}",
            comm_text or "-", f"{item.step_seconds:.3g}", f"{item.mfu:.1%}",
        ])
    title = (
        f"{result.model.summary()}\n{result.cluster.world_size} devices ({result.cluster.nodes} x"
        f" {result.cluster.gpus_per_node}), {format_bytes(result.cluster.usable_memory)} usable each;"
        f" seq {result.training.seq_len}, {result.training.batch_label()}, {result.training.precision}\n"
    )
    if not rows:
        return title + "No layout fits; see the rejected layouts."
    shown = f"\n({len(result.fits) - limit} more)" if len(result.fits) > limit else ""
    return title + _grid(header, rows) + shown + "\n(* the dimension's group crosses nodes)"


def rejected_table(result: "PlanResult", limit: int = 20) -> str:
    """The excluded layouts with their reasons."""
    rows = [[r.layout.label(), r.reason] for r in result.rejected[:limit]]
    more = f"\n({len(result.rejected) - limit} more)" if len(result.rejected) > limit else ""
    return _grid(["layout", "why not"], rows) + more if rows else "Nothing rejected."


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


def save_chart(result: "PlanResult", path: Path, limit: int = 12) -> Path:
    """One horizontal bar per ranked layout, split into memory components, against the GPU limit."""
    from PIL import Image, ImageDraw

    items = result.fits[:limit] + [r.estimate for r in result.rejected if r.estimate is not None][: max(0, limit // 3)]
    if not items:
        raise ValueError("Nothing to draw: no layout was priced (every one was rejected by a rule).")
    colors = {"params": (66, 133, 244), "grads": (52, 168, 83), "optimizer": (251, 188, 5),
              "activations": (234, 67, 53), "buffers": (154, 160, 166)}
    label_w, bar_w, row_h, top = 330, 520, 22, 40
    limit_bytes = result.cluster.usable_memory
    scale_max = max(limit_bytes, max(e.memory.total for e in items)) * 1.05
    image = Image.new("RGB", (label_w + bar_w + 20, top + row_h * len(items) + 40), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), f"{result.model.name}: memory per device by layout, fastest first", fill="black")
    for row, item in enumerate(items):
        y = top + row * row_h
        tag = "" if item.fits else "  [does not fit]"
        draw.text((10, y + 4), f"{row + 1}. {item.layout.label()}{tag}"[:52], fill="black")
        x = label_w
        for name, color in colors.items():
            width = getattr(item.memory, name) / scale_max * bar_w
            draw.rectangle([x, y + 3, x + width, y + row_h - 3], fill=color)
            x += width
        draw.text((x + 4, y + 4), format_bytes(item.memory.total), fill="black")
    limit_x = label_w + limit_bytes / scale_max * bar_w
    draw.line([limit_x, top - 6, limit_x, top + row_h * len(items)], fill="black", width=2)
    draw.text((limit_x + 3, top - 16), format_bytes(limit_bytes), fill="black")
    legend_y, x = top + row_h * len(items) + 12, 10
    for name, color in colors.items():
        draw.rectangle([x, legend_y, x + 12, legend_y + 12], fill=color)
        draw.text((x + 16, legend_y), name, fill="black")
        x += 110
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path
