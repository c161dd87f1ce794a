"""What the dry run (:mod:`lightning_para.simulate`) answers transformers' data-dependent checks on meta tensors.

``transformers`` branches on data in two kinds of places on the training path, both asking whether the batch is
plain: ``find_packed_sequence_indices`` ("are these position ids one sequence per row?") and the SDPA mask's
``padding_mask.all()`` ("no padding?"). The dry run's batches are plain token windows (what ``TextDataModule``
loads), so the answer is yes there. Only a check made by ``transformers`` itself is answered; any other (the
library's, the user's) still raises, rather than take a branch on an invented value.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from lightning_para.simulate.kernels import register_meta_answer


def plain_batch_answer(func: Any, caller: str) -> Optional[Any]:
    """``True`` (``bool``) or ``1`` (``item``) for a check made by ``transformers``; ``None`` otherwise."""
    if not caller.startswith("transformers."):
        return None
    return True if func is Tensor.__bool__ else 1


register_meta_answer(plain_batch_answer)

__all__ = ["plain_batch_answer"]
