"""Reliability: exact mid-epoch resume, a watchdog for dead or stuck ranks, silent-corruption checks.

* :mod:`.resumable_data`: :class:`ResumableDataLoader`, a global, resumable data position;
* :mod:`.watchdog`: heartbeats over the process group's store; every survivor exits when a rank is lost;
* :mod:`.integrity`: checksums of replicated state compared across replicas; non-finite losses and gradients.

Atomic checkpoints live with the checkpoint format, in :mod:`lightning_para.checkpoint.atomic`.
"""

from lightning_para.reliability.integrity import IntegrityChecker, IntegrityError, replicated_state
from lightning_para.reliability.resumable_data import ResumableDataLoader, ResumableSampler
from lightning_para.reliability.watchdog import WATCHDOG_EXIT_CODE, Watchdog

__all__ = [
    "IntegrityChecker",
    "IntegrityError",
    "ResumableDataLoader",
    "ResumableSampler",
    "WATCHDOG_EXIT_CODE",
    "Watchdog",
    "replicated_state",
]
