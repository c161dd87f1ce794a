"""``torch.compile`` per transformer block: ``ParaStrategy(compile=True)``.

Each block (the same blocks activation checkpointing wraps: :func:`find_blocks`) is compiled
with ``nn.Module.compile``, which keeps the module and its parameter names (checkpoints are the
same with and without compile) and compiles its call, hooks included. ``parallelize()`` calls
:func:`apply_compile` after tensor/sequence parallelism, context parallelism and activation
checkpointing (so the compiled region contains the block's TP collectives and its
recomputation) and before data parallelism (FSDP2 and the ZeRO hooks sit around the compiled
blocks, as in torchtitan's ``apply_compile``).

Blocks of one class share one compiled graph: dynamo inlines ``nn.Module`` calls and treats
parameters as graph inputs (``inline_inbuilt_nn_modules``), so the second block of a class
reuses the first one's code cache. :class:`CompileWatch` counts the graphs and the
recompilations from dynamo's compilation metrics and warns, naming dynamo's recompile reasons,
when a block class recompiles more than a few times (a recompile storm: a changing shape, a
Python value guarded on, a new grad mode).

What stays outside the graphs, on purpose:

* an MoE layer's expert dispatch and expert GEMMs (``MoE._run_experts``, the expert-parallel
  all-to-all) and its statistics/aux-loss attachment run eagerly (``torch.compiler.disable``):
  the rows per expert are host integers that change every step, and torch's fake kernel of
  ``_grouped_mm`` takes only bf16. The router, top-k, sort, combine and aux losses around them
  compile, so an MoE block is four graphs (block up to the MoE call, MoE up to the dispatch, MoE
  after it, rest of the block), each compiled once for all blocks of the class;
* under TP+SP, Megatron-SP's "keep the input shard, all-gather again in backward"
  (``sp_save_input_shard``) is not applied: the compiled graph's saved tensors are chosen by
  AOTAutograd's partitioner, and the storage-pointer-matched saved-tensor hooks cannot be traced.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_para.parallel.activation_checkpoint import find_blocks

# Compilations of one compiled frame (a block class, or a piece of one) beyond which CompileWatch
# warns: one training graph, one for evaluation (no_grad) and a last batch of another size are expected.
RECOMPILE_WARN = 4


@dataclass
class CompileInfo:
    """What :func:`apply_compile` compiled in one part (a pipeline stage or the whole model)."""

    blocks: list[nn.Module] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def block_types(self) -> list[str]:
        """The distinct block classes: one compiled graph each."""
        return sorted({type(b).__qualname__ for b in self.blocks})


def check_blocks(module: nn.Module) -> None:
    """Raise ``ValueError`` naming ``compile`` when ``module`` has no blocks (entries of an
    ``nn.ModuleList``/``nn.Sequential``) to compile."""
    if not find_blocks(module):
        raise ValueError(
            f"`compile=True`: {type(module).__name__} has no blocks (entries of an nn.ModuleList or nn.Sequential)"
            " to compile. Keep the transformer blocks in a ModuleList, or compile the model yourself."
        )


def apply_compile(module: nn.Module, *, options: Mapping[str, Any], require_blocks: bool = True) -> CompileInfo:
    """Compile every block of ``module`` in place with ``torch.compile(**options)``; returns what was compiled.

    Raises ``ValueError`` naming ``compile`` when the module has no blocks (entries of an
    ``nn.ModuleList``/``nn.Sequential``), unless ``require_blocks=False``: a pipeline stage may
    hold only the embedding or the head (the whole model is checked with :func:`check_blocks`
    before the split, on every rank alike).
    """
    if require_blocks:
        check_blocks(module)
    blocks = find_blocks(module)
    for block in blocks:
        block.compile(**options)
    return CompileInfo(blocks=blocks, options=dict(options))


def _compilation_metrics() -> list[Any]:
    from torch._dynamo.utils import get_compilation_metrics  # private: see docs/architecture.md

    return get_compilation_metrics()


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters  # private: see docs/architecture.md

    return int(counters["stats"]["unique_graphs"])


@dataclass
class CompileWatch:
    """Counts dynamo's compilations from the moment it is made; warns once on a recompile storm.

    ``graphs()`` is the number of graphs compiled since (one per block class when nothing
    recompiled); ``recompiles()`` maps each recompile reason dynamo gave to its count.
    """

    block_types: list[str]
    start: int = field(default_factory=lambda: len(_compilation_metrics()))
    start_graphs: int = field(default_factory=_unique_graphs)
    warned: bool = False

    def _since(self) -> list[Any]:
        return _compilation_metrics()[self.start:]

    def graphs(self) -> int:
        """Graphs dynamo compiled since the watch began (first compilations and recompilations; the
        backward of a graph is part of it)."""
        return _unique_graphs() - self.start_graphs

    def recompiles(self) -> collections.Counter:
        """Dynamo's recompile reason -> how often it caused a recompilation."""
        return collections.Counter(m.recompile_reason for m in self._since() if m.recompile_reason)

    def compilations(self) -> collections.Counter:
        """``(function, file, first line)`` of each frame dynamo compiled since the watch began -> how
        often. A block compiles as one frame, or as a few pieces where it breaks the graph on purpose
        (an MoE layer's eager expert dispatch); each piece compiles once unless it recompiles."""
        return collections.Counter((m.co_name, m.co_filename, m.co_firstlineno) for m in self._since())

    def check(self) -> Optional[str]:
        """Warn (once) when one compiled frame (a block, or a piece of one) compiled more than
        ``RECOMPILE_WARN`` times; returns the message."""
        if self.warned:
            return None
        worst = max(self.compilations().values(), default=0)
        if worst <= RECOMPILE_WARN:
            return None
        reasons = "; ".join(f"{n}x {r.strip()[:200]}" for r, n in self.recompiles().most_common(3))
        message = (
            f"`compile=True`: a compiled frame of the blocks ({', '.join(self.block_types)}) compiled {worst} times"
            f" (more than {RECOMPILE_WARN}; {self.graphs()} graphs in all): a recompile storm. Dynamo's reasons:"
            f" {reasons or 'none given'}. Keep batch and sequence shapes fixed (drop_last=True), or pass"
            " compile={'dynamic': True}."
        )
        warnings.warn(message)
        self.warned = True
        return message


__all__ = ["CompileInfo", "CompileWatch", "apply_compile", "check_blocks"]
