"""The pipeline contract a LightningModule states, and the module that holds one stage.

The contract (see ``docs/pipeline_parallel.md``)::

    class MyModel(L.LightningModule):
        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(
                layers=[self.embed, *self.blocks, self.head],   # submodules, in execution order
                split_batch=lambda batch: (batch["x"], batch["y"]),  # -> (stage-0 inputs, last-stage targets)
                loss_fn=lambda logits, y: F.cross_entropy(logits, y),  # mean loss of one microbatch
            )

Each layer is called as ``x = layer(x)``. :func:`pipeline_spec_of` and :func:`named_layers_of`
check what the module returns, without communication, so every rank raises the same
``ValueError`` before any send/recv.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor, nn

CONTRACT = (
    "A LightningModule trained with pp>1 must implement `configure_pipeline(self) -> lightning_para.PipelineSpec`:"
    " PipelineSpec(layers=[...submodules in execution order, each called as x = layer(x)...],"
    " split_batch=lambda batch: (stage0_inputs, last_stage_targets), loss_fn=lambda outputs, targets: mean_loss)."
    " See docs/pipeline_parallel.md."
)


@dataclass
class PipelineSpec:
    """How a LightningModule runs as a pipeline.

    Args:
        layers: submodules of the LightningModule in execution order (e.g. embedding, blocks,
            final norm + head); each is called as ``x = layer(x)`` (a tuple is unpacked into
            the next layer's arguments). Every trainable parameter must belong to one layer.
        split_batch: ``batch -> (inputs, targets)``: what the first layer takes and what the
            loss compares the last layer's output with. Both are split along dim 0 into
            microbatches.
        loss_fn: ``(outputs, targets) -> loss`` for one microbatch, a mean over its samples;
            the step's loss is the mean over microbatches (equal to the full batch's mean).
        example_input: a stage-0 input for ``pipeline_balance="time"`` (default: the module's
            ``example_input_array``).
        log_name: the loss is logged as ``train_<log_name>``, ``val_<log_name>`` and
            ``test_<log_name>``; ``None`` logs nothing.
    """

    layers: Sequence[nn.Module]
    split_batch: Callable[[Any], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    example_input: Optional[Any] = None
    log_name: Optional[str] = "loss"


# The LightningModule keeps its `training_step` (what pp=1 runs, and Lightning requires one);
# under pp>1 the pipeline runs instead of it and of validation/test/predict_step.


class PipelineStageModule(nn.Module):
    """The layers of one stage under their original names (``blocks.3`` stays ``blocks.3``).

    So a TP plan or FSDP unit written against the LightningModule's names applies to the
    stage unchanged. Layers are looked up by name at every call, so wrappers applied to this
    module later (activation checkpointing) take effect.
    """

    def __init__(self, stage_index: int, named_layers: Sequence[tuple[str, nn.Module]], source: nn.Module) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.layer_names = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for depth, part in enumerate(path):
                if part not in parent._modules:  # private: see docs/architecture.md
                    original = source.get_submodule(".".join(path[: depth + 1]))
                    parent.add_module(part, _empty_like_container(original))
                parent = parent._modules[part]
            parent.add_module(leaf, layer)

    def forward(self, *args: Any) -> Any:
        x: Any = args if len(args) != 1 else args[0]
        for name in self.layer_names:
            layer = self.get_submodule(name)
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x


def _empty_like_container(module: nn.Module) -> nn.Module:
    """An empty container of the same kind: block lists stay ``nn.ModuleList`` (activation
    checkpointing and tensor-parallel plans look for them); anything else is a plain holder."""
    for kind in (nn.ModuleList, nn.Sequential, nn.ModuleDict):
        if isinstance(module, kind):
            return kind()
    return nn.Module()


# ----------------------------------------------------------------------------- checking the contract
def pipeline_spec_of(module: nn.Module) -> PipelineSpec:
    """Call the module's ``configure_pipeline()`` and check what it returns (``ValueError`` if wrong)."""
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise ValueError(f"`{type(module).__name__}` has no `configure_pipeline()`. {CONTRACT}")
    spec = hook()
    if not isinstance(spec, PipelineSpec):
        raise ValueError(f"`configure_pipeline()` returned {type(spec).__name__}, not a PipelineSpec. {CONTRACT}")
    if not callable(spec.split_batch) or not callable(spec.loss_fn):
        raise ValueError(f"`PipelineSpec.split_batch` and `PipelineSpec.loss_fn` must be callables. {CONTRACT}")
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            "Pipeline parallelism runs the backward inside the schedule, so it needs"
            " `automatic_optimization=True`; manual optimization cannot call backward on a loss no rank holds."
        )
    return spec


def named_layers_of(module: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name in module, layer)`` for each pipeline layer, checked to be distinct, non-nested submodules."""
    if not layers:
        raise ValueError(f"`PipelineSpec.layers` is empty. {CONTRACT}")
    names: dict[int, str] = {}
    for name, sub in module.named_modules():
        names.setdefault(id(sub), name)
    result: list[tuple[str, nn.Module]] = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module) or names.get(id(layer), "") == "":
            raise ValueError(
                f"`PipelineSpec.layers[{i}]` ({type(layer).__name__}) is not a submodule of the LightningModule."
                " Register each layer as an attribute (or in an nn.ModuleList) and list those objects."
            )
        result.append((names[id(layer)], layer))
    seen = [name for name, _ in result]
    for i, name in enumerate(seen):
        for j, other in enumerate(seen):
            if i != j and (name == other or other.startswith(name + ".")):
                raise ValueError(
                    f"`PipelineSpec.layers` lists `{name}` and `{other}`: each layer must appear once and not"
                    " contain another listed layer."
                )
    in_layers = {id(p) for _, layer in result for p in layer.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_layers]
    if outside:
        raise ValueError(
            f"Trainable parameters outside every pipeline layer: {outside[:8]}. Each parameter must belong to"
            " one layer of `configure_pipeline().layers` (its stage trains it); move them into a layer."
        )
    return result


__all__ = ["CONTRACT", "PipelineSpec", "PipelineStageModule", "named_layers_of", "pipeline_spec_of"]
