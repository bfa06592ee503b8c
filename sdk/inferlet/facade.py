"""Lazy re-exports for the subpackages :mod:`inferlet.spec` and :mod:`inferlet.text`.

A subpackage lists its public names (``__all__``) and where each is defined; a name is imported on first use.
Lazy because the modules behind the names import the subpackages' own modules (the round loop reads
``inferlet.text.arguments``): importing every name eagerly when one of those modules loads would go round in a
circle. Each subpackage also imports the names under ``TYPE_CHECKING``, so type checkers and the generated
reference see them; a test keeps those imports equal to the lazy table.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name of ``homes`` (name → its defining module)
    comes from its module the first time it is read, and stays in the package's namespace after."""

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(homes) | set(vars(sys.modules[package])))

    return getattr_, dir_
