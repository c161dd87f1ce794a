"""Modules that fill the library's registries, imported when a registry is first read.

The built-in integrations (transformers, LitGPT) register their adapters and checkpoint records when they are
imported. The public facade (``lightning_para/__init__.py``) names them here without importing them, and every
registry calls :func:`load_plugins` before it answers: ``import lightning_para`` stays light, generic code never
names an integration, and a model meets the same adapters however the library was entered.
"""

from __future__ import annotations

import importlib

_PENDING: list[str] = []


def add_plugins(*modules: str) -> None:
    """Import ``modules`` (absolute names) before a registry is next read."""
    _PENDING.extend(m for m in modules if m not in _PENDING)


def load_plugins() -> None:
    """Import the plugin modules not imported yet (each registers itself on import)."""
    while _PENDING:
        importlib.import_module(_PENDING.pop(0))


__all__ = ["add_plugins", "load_plugins"]
