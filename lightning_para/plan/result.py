"""What :func:`~lightning_para.plan.search.search` returns: :class:`PlanResult` (the ranked layouts
and the rejected ones) and its views: text tables, the ``ParaStrategy`` YAML (:mod:`.render`) and a
PNG memory chart. Its own module so that ``search`` and the rendering need not import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import Estimate, format_bytes, memory_unit
from lightning_para.plan.layout import Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.plan.render import grid, strategy_yaml
from lightning_para.spec.dims import PRICED


@dataclass(frozen=True)
class Rejected:
    """A layout the planner excluded, and why (e.g. "does not fit by 3.2 GB")."""

    layout: Layout
    reason: str
    estimate: Optional[Estimate] = None  # present when the layout was priced (memory rejections)


@dataclass
class PlanResult:
    """What :func:`search` found: ``fits`` ranked fastest first, ``rejected`` with reasons."""

    model: ModelDesc
    cluster: Cluster
    training: Training
    fits: list[Estimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def best(self) -> Optional[Estimate]:
        return self.fits[0] if self.fits else None

    def position(self, predicate: Callable[[Layout], bool]) -> Optional[int]:
        """0-based rank of the first fitting layout for which ``predicate(layout)`` holds."""
        return next((i for i, item in enumerate(self.fits) if predicate(item.layout)), None)

    def table(self, limit: int = 10) -> str:
        """The ranked layouts that fit, as a text table."""
        return fits_table(self, limit)

    def rejected_table(self, limit: int = 20) -> str:
        """The excluded layouts and their reasons, as a text table."""
        return rejected_table(self, limit)

    def strategy_yaml(self, choice: Optional[Estimate] = None) -> str:
        """``ParaStrategy(...)`` arguments of ``choice`` (default: :attr:`best`) as YAML to paste."""
        chosen = choice or self.best
        if chosen is None:
            raise ValueError("No layout fits, so there is no strategy to render; see `rejected` for the reasons.")
        return strategy_yaml(chosen)

    def save_chart(self, path: Union[str, Path], limit: int = 12) -> Path:
        """Draw the ranked layouts' memory against the GPU limit as a PNG; returns the path."""
        return save_chart(self, Path(path), limit)


# Above this fraction of a device's memory in tensors, the caching allocator's reserve (4-18% over the tensors'
# peak on the ranks measured on an H100/H200: docs/planner.md "Reserved memory") may not fit.
RESERVE_WARNING = 0.85


def fits_table(result: PlanResult, limit: int = 10) -> str:
    """Rank, layout, memory breakdown, bubble, communication per dimension per step, step time, MFU
    (in GB, or MB when every layout needs less than a GB)."""
    largest = max([item.memory.total for item in result.fits[:limit]] + [0.0])
    unit = memory_unit(largest)
    header = ["#", "layout", f"memory {unit[0]} (p/g/o/act/buf)", "bubble", f"comm {unit[0]}/step", "step s", "MFU"]
    rows = []
    for i, item in enumerate(result.fits[:limit], 1):
        m = item.memory
        # grads: the ZeRO paper's plus a separate master's fp32 gradients, so the columns add up to the peak
        parts = "/".join(format_bytes(v, unit, False)
                         for v in (m.params, m.held_grads, m.optimizer, m.activations, m.buffers))
        comm = item.comm_bytes()
        crossing = item.crosses_nodes()
        comm_text = " ".join(
            f"{dim}{'*' if crossing.get(dim) else ''}={comm[dim] / unit[1]:.3g}" for dim in PRICED if dim in comm
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
    footer = "\n(* the dimension's group crosses nodes)"
    if largest > RESERVE_WARNING * result.cluster.usable_memory:
        footer += (
            f"\n(memory is the tensors' peak; a GPU's caching allocator reserves more, 4-18% on the ranks measured:"
            f" above {RESERVE_WARNING:.0%} of a device, check the layout with `lightning-para dryrun`, which models it)"
        )
    return title + grid(header, rows) + shown + footer


def rejected_table(result: PlanResult, limit: int = 20) -> str:
    """The excluded layouts with their reasons."""
    rows = [[r.layout.label(), r.reason] for r in result.rejected[:limit]]
    more = f"\n({len(result.rejected) - limit} more)" if len(result.rejected) > limit else ""
    return grid(["layout", "why not"], rows) + more if rows else "Nothing rejected."


def save_chart(result: PlanResult, path: Path, limit: int = 12) -> Path:
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


__all__ = ["PlanResult", "Rejected", "fits_table", "rejected_table", "save_chart"]
