"""Reliability: exact mid-epoch resume, a watchdog for dead or stuck ranks, silent-corruption checks.

* :mod:`.resumable_data`: :class:`ResumableDataLoader`, a global, resumable data position;
* :mod:`.watchdog`: heartbeats over the process group's store; every survivor exits when a rank is lost;
* :mod:`.integrity`: checksums of replicated state compared across replicas; non-finite losses and gradients.

Atomic checkpoints live with the checkpoint format, in :mod:`lightning_para.checkpoint.atomic`.
"""

from lightning_para.spec.lazy import lazy_face

__getattr__, __dir__, __all__ = lazy_face(__name__, {
    ".integrity": ("IntegrityChecker", "IntegrityError", "replicated_state"),
    ".resumable_data": ("ResumableDataLoader", "ResumableSampler"),
    ".watchdog": ("WATCHDOG_EXIT_CODE", "Watchdog"),
})
