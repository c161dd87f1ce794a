"""A sublayer that reshapes with global sizes under tp: one clear error in its first call.

Under tensor parallelism an attention module's projections give each rank ``1/tp`` of the heads
and of the features. Model code that reshapes with sizes it takes from elsewhere -- nanoGPT's
``B, T, C = x.size()`` then ``k.view(B, T, self.n_head, C // self.n_head)`` (``C`` is the model
width, not this rank's share), a head count read from a shared config -- fails deep inside the
model with ``shape '[8, 32, 2, 32]' is invalid for input of size 8192``. Every call of every
planned sublayer runs inside :func:`explain_first_call`, which turns such an error into a
``ValueError`` that names the module, what it computed, the per-rank sizes and the fixes. Such an
error comes from the sizes, so it is raised in the first step (the first call of the module).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

# The messages torch raises when a view/reshape/split/matmul meets a tensor of another size.
_SHAPE_ERRORS = re.compile(
    r"is invalid for input of size|split_with_sizes expects split_sizes|must match the size of tensor"
    r"|shapes cannot be multiplied|size mismatch|Expected size|split_size|does not match|invalid for input"
)


class GlobalSizeError(ValueError):
    """A tensor-parallel sublayer reshaped with global sizes (see the module docstring)."""


def explain_first_call(module: nn.Module, name: str, tp: int, divided: dict[str, tuple[int, int]]) -> None:
    """Wrap ``module.forward`` so that a shape error becomes a :class:`GlobalSizeError` (see module docstring).

    ``divided``: the attributes already divided by tp, ``{attr: (global, per rank)}``.
    """
    original: Callable[..., Any] = module.forward

    def explained_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError as error:
            if not _SHAPE_ERRORS.search(str(error)):
                raise
            raise GlobalSizeError(_message(module, name, tp, divided, error)) from error

    # Kept for good (a try costs nothing until something raises): swapping it back after the first call changed
    # the code object torch.compile guards on, so every compiled block compiled twice.
    module.forward = explained_forward


def _message(module: nn.Module, name: str, tp: int, divided: dict[str, tuple[int, int]], error: Exception) -> str:
    cls = type(module).__name__
    adapted = ", ".join(f"{a} {g} -> {r}" for a, (g, r) in divided.items()) or "none (no head attributes found)"
    return (
        f"Tensor parallel (tp={tp}): the attention/MLP module {name!r} ({cls}) reshaped with a global size in its"
        f" first forward: {error}. Under tp each rank's projections give it 1/{tp} of the heads and features;"
        f" attributes divided per rank: {adapted}. The module computed a size from something that stays global: the"
        " input's width (`B, T, C = x.size()`: C is the model width, not this rank's C/tp) or a config object"
        " shared with other modules. Fix one of: reshape with -1 (`q.view(B, T, self.n_head, -1)`,"
        " `y.view(B, T, -1)`) or with the module's own attributes (`self.n_embd`), which are divided per rank;"
        " declare `tensor_parallel_plan()` on the model (or ParaStrategy(tp_plan=...)) with 'replicate' for this"
        f" module; for LitGPT models `import lightning_para` adapts {cls} itself (lightning_para.integrations.litgpt),"
        " for Hugging Face models use the transformers integration."
    )


__all__ = ["GlobalSizeError", "explain_first_call"]
