"""Optimizers that need whole matrices, exact under every layout: :class:`Muon` (Muon for hidden matrices, AdamW
for the rest; :mod:`.muon`), each matrix orthogonalized whole on one owner rank (:mod:`.routing`)."""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".muon": ("ADAMW_NAMES", "Muon", "split_param_groups", "uses_muon"),
    ".routing": ("MatrixRoute",),
})
