"""Float8 training through torchao: ``ParaStrategy(fp8="tensorwise" | "rowwise")``.

:func:`apply_float8` swaps the chosen ``nn.Linear`` modules for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``):
their matmuls run on float8 casts of input, weight and gradient (dynamic scales, per tensor or
per row), the weights stay in their own dtype. ``parallelize()`` converts before anything else
changes the model (the tensor-parallel plan is kept by module identity, so the new modules must
exist before it is resolved).

Skipped, and named in :class:`Float8Info`: the output head (``head``/``lm_head``/``output``
modules and the module tied to the input embedding: its logits set the loss scale, torchtitan
skips it too) and every linear whose input or output width is not a multiple of 16 (float8
matmul kernels need it).

torchao is an optional dependency (``pip install lightning-para[fp8]``), imported only here and
only when ``fp8`` is set. ``emulate=None`` emulates the float8 matmul (casts, then a matmul in
the original dtype) unless a CUDA device with compute capability >= 8.9 (Ada, Hopper) is
present; on this project's CPU, torch's own ``torch._scaled_mm`` runs as well.

Composition with the other dimensions (this module owns the float8 choice, each dimension its own
plan):

* **tp / SP** (``"tensorwise"`` only): :func:`float8_tensor_parallel_styles` hands the tensor-parallel
  plan torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` for the converted linears, and
  :class:`Float8ParallelStyles.gather_cast` casts a sublayer's sequence-sharded input to float8
  *before* its all-gather (what torchao's ``PrepareFloat8ModuleInput`` does), so SP gathers 1-byte
  activations and the gradients of the row-parallel outputs are cast in backward. The amax of a
  DTensor is global (an all-reduce), so every rank uses the scale one device would use.
  ``"rowwise"`` with ``tp > 1`` is rejected by ``ParallelConfig`` (torchao's styles assume tensorwise
  scales).
* **ZeRO-3** (FSDP2, ``"tensorwise"``): ``fsdp_float8_all_gather=True`` converts the weights to
  torchao's ``WeightWithDynamicFloat8CastTensor``, whose FSDP2 pre-all-gather hook casts the local
  shard to float8 with a scale from the global amax, so the weights are all-gathered in 1 byte per
  element instead of 2 (bf16) or 4 (fp32). :func:`precompute_float8_scales` (torchao's
  ``precompute_float8_dynamic_scale_for_fsdp``) computes every weight's scale in one all-reduce after
  the optimizer step instead of one all-reduce per weight in each all-gather.
* **dp x tp**: an activation DTensor lives on the tp sub-mesh, so its amax is reduced over the replica's tp
  group only and each dp replica casts with the scale of its own micro-batch (as dp alone). Checked per cast
  against torchao's one-device run (``test_fp8_dp2_tp2_sp_casts_each_replica_with_its_own_micro_batch_scales``).
  Loss parity there is 2.6e-4, not 1e-5, and that is not a wrong reduction: the row-parallel
  partial sums leave an activation a few fp32 ulps from one device's, and one element sitting on an e4m3
  rounding midpoint rounds the other way (one quantum, 1/16 relative). Any float8 parity at 1e-5 holds only
  while no element lands that close to a midpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_para.spec.options import FP8_RECIPES

# Module names treated as the output head (the loss-setting projection stays in high precision).
HEAD_NAMES = ("head", "lm_head", "output")


@dataclass
class Float8Info:
    """What :func:`apply_float8` converted and what it skipped (name -> reason)."""

    recipe: str
    emulate: bool
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    # ZeRO-3: the converted weights are all-gathered by FSDP2 in float8 (tensorwise only).
    fsdp_float8_all_gather: bool = False


def float8_available() -> bool:
    """Whether this device has float8 tensor cores (CUDA compute capability >= 8.9)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _skip_reason(name: str, module: nn.Linear) -> Optional[str]:
    parts = name.split(".")
    if any(p in HEAD_NAMES for p in parts):
        return "the output head stays in high precision"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features} -> {module.out_features}: float8 matmuls need widths that are multiples of 16"
    return None


def float8_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``"tensorwise"`` or ``"rowwise"``).

    ``fsdp_float8_all_gather`` (tensorwise only; torchao rejects it for rowwise scales): FSDP2
    all-gathers the converted weights in float8.
    """
    from torchao.float8 import Float8LinearConfig  # optional: pip install lightning-para[fp8]

    return replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather
    )


def apply_float8(
    module: nn.Module, *, recipe: str, emulate: Optional[bool] = None, fsdp_float8_all_gather: bool = False,
    keep: Optional[dict[str, str]] = None,
) -> Float8Info:
    """Convert ``module``'s linears (all but the head and widths not multiple of 16) to float8 training, in place.

    ``fsdp_float8_all_gather``: the module will be fully sharded (ZeRO-3); its float8 weights are then
    all-gathered in float8 (ignored for ``"rowwise"``, whose weight scales are per row).
    ``keep``: linears to leave in high precision, name -> reason (under tp, fused projections with explicit
    block sizes: torchao's float8 tensor-parallel styles are column-/row-wise only).
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"`fp8={recipe!r}` is unknown. Choose one of {', '.join(map(repr, FP8_RECIPES))} or None.")
    try:
        from torchao.float8 import convert_to_float8_training  # optional: pip install lightning-para[fp8]
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("`fp8` needs torchao: `pip install lightning-para[fp8]` (torchao>=0.10).") from err
    emulate = (not float8_available()) if emulate is None else emulate
    fsdp_float8_all_gather = fsdp_float8_all_gather and recipe == "tensorwise"
    info = Float8Info(recipe=recipe, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather)
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and type(child) is nn.Linear:
            reason = (keep or {}).get(name) or _skip_reason(name, child)
            if reason is None:
                info.converted.append(name)
            else:
                info.skipped[name] = reason
    chosen = set(info.converted)
    convert_to_float8_training(
        module, module_filter_fn=lambda m, fqn: fqn in chosen, config=float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather),
    )
    return info


def precompute_float8_scales(module: nn.Module) -> None:
    """After an optimizer step under ZeRO-3: every float8 weight's scale in one all-reduce (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); FSDP2's next all-gathers use them. A no-op for a
    module without float8-gathered weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # optional: pip install lightning-para[fp8]

    precompute_float8_dynamic_scale_for_fsdp(module)


@dataclass(frozen=True)
class Float8ParallelStyles:
    """torchao's float8 tensor-parallel styles, handed to the tensor-parallel plan (tensorwise scales).

    The plan stays the tensor-parallel module's: for each converted linear (:meth:`applies_to`) it
    picks :attr:`colwise` / :attr:`rowwise` instead of torch's styles, and a sublayer whose input is
    all-gathered along the sequence casts it with :meth:`gather_cast` first.
    """

    colwise: type
    rowwise: type
    # Whether the process group moves float8 tensors (NCCL does; gloo has no float8 type and raises
    # "Invalid scalar type"). Without, each gather runs in the high-precision dtype and the cast follows
    # it: the same float8 values (the cast is elementwise with the same global scale), twice the bytes.
    float8_collectives: bool = True

    @staticmethod
    def applies_to(module: nn.Module) -> bool:
        """Whether ``module`` is a linear converted to float8 training."""
        from torchao.float8.float8_linear import Float8Linear  # optional: pip install lightning-para[fp8]

        return isinstance(module, Float8Linear)

    def gather_cast(self, sublayer: nn.Module) -> Optional[Callable[[Any], Any]]:
        """The cast of ``sublayer``'s input to float8 before its sequence all-gather, or ``None`` when no
        child is a float8 linear.

        As torchao's ``PrepareFloat8ModuleInput``: a dynamic tensorwise cast with the first float8
        child's matmul config (the DTensor's amax is global, so the scale is the one-device scale);
        the float8 children then find their input already cast and use it as it is. ``None`` too
        without float8 collectives (gloo): the children cast after the high-precision gather.
        """
        from torchao.float8.config import e4m3_dtype  # optional: pip install lightning-para[fp8]
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        linears = [m for m in sublayer.modules() if self.applies_to(m)]
        if not linears or not self.float8_collectives:
            return None
        mm_config = linears[0].linear_mm_config
        if any(m.linear_mm_config != mm_config for m in linears):
            return None  # children disagree: each casts its own input after the gather

        def cast(x: Any) -> Any:
            return hp_tensor_to_float8_dynamic(x, e4m3_dtype, mm_config, gemm_input_role=GemmInputRole.INPUT)

        return cast


def _rowwise_casting_after_the_gather(base: type) -> type:
    """torchao's ``Float8RowwiseParallel`` for a process group without float8 collectives (gloo).

    torchao casts the output's gradient to float8 *before* the backward of the output's
    redistribution (under SP: the all-gather of the gradient along the sequence, in float8); here the
    float8 cast sits *after* it, on the gathered high-precision gradient. A replicated DTensor's amax
    is the global one either way, so the float8 gradient is the same.
    """
    from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic  # optional: lightning-para[fp8]

    class Float8RowwiseGatheringHighPrecision(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            outputs = NoopFwToFloat8BwDynamic.apply(
                outputs, mod.linear_mm_config, mod.config.cast_config_grad_output.target_dtype
            )
            if outputs.placements != output_layouts:
                outputs = outputs.redistribute(placements=output_layouts)
            return outputs.to_local() if use_local_output else outputs

    return Float8RowwiseGatheringHighPrecision


def float8_collectives_supported(group: Any) -> bool:
    """Whether ``group``'s backend moves float8 tensors (gloo has no float8 dtype; NCCL has)."""
    import torch.distributed as dist

    return dist.get_backend(group) != "gloo"


def float8_tensor_parallel_styles(
    recipe: Optional[str], *, float8_collectives: bool = True
) -> Optional[Float8ParallelStyles]:
    """torchao's float8 tensor-parallel styles for ``recipe`` (``"tensorwise"``), else ``None``.

    ``float8_collectives=False`` (gloo, see :func:`float8_collectives_supported`): tensor-parallel
    collectives move high-precision tensors and the float8 casts follow them (same float8 values).
    """
    if recipe != "tensorwise":
        return None
    from torchao.float8.float8_tensor_parallel import (  # optional: pip install lightning-para[fp8]
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    rowwise = Float8RowwiseParallel if float8_collectives else _rowwise_casting_after_the_gather(Float8RowwiseParallel)
    return Float8ParallelStyles(colwise=Float8ColwiseParallel, rowwise=rowwise, float8_collectives=float8_collectives)


__all__ = [
    "FP8_RECIPES", "Float8Info", "Float8ParallelStyles", "apply_float8", "float8_available", "float8_config",
    "float8_collectives_supported", "float8_tensor_parallel_styles", "precompute_float8_scales",
]
