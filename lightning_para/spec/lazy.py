"""Package faces that load nothing: a package's public names, each imported from its module on first use (PEP 562).

``import lightning_para.plan`` (or the command line's ``--help``) then runs no module the caller does not use, and
never Lightning or the runtime. A face writes ``__getattr__, __dir__, __all__ = lazy_face(__name__, {...})``: the
table maps each module (relative to the package) to the names it defines, and
``tests/unit/test_architecture.py`` reads the same table to follow a ``from package import name`` to its module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


class _Face(types.ModuleType):
    """A package whose public name may equal one of its modules' (``lightning_para.parallelize`` the function, in
    ``parallelize.py``): the import system's naming of that module on the package does not hide the name."""

    def __setattr__(self, name: str, value: Any) -> None:
        exported = name in self.__dict__.get("__lazy__", ())
        if exported and isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            return
        super().__setattr__(name, value)


def lazy_face(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` of a package whose names live in the modules ``exports`` maps to them."""
    where = {name: module for module, names in exports.items() for name in names}
    face = sys.modules[package]
    face.__lazy__ = where
    face.__class__ = _Face

    def __getattr__(name: str) -> object:
        if name not in where:  # a subpackage or module, as an eager face's imports made it an attribute
            if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(face, name, value)  # the next lookup is an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(face), *where})

    return __getattr__, __dir__, sorted(where)


__all__ = ["lazy_face"]
