"""A package's public names imported on first use (PEP 562), so that importing the package, or a light
module inside it, does not import what its heavy modules need (torch)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, modules: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of package, whose names come from modules: {name: ".module"}.

    Usage, in a package's __init__.py:  __getattr__, __dir__ = lazy_exports(__name__, {"Llama": ".generation"})
    """

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name], package), name)
        setattr(importlib.import_module(package), name, value)  # later lookups find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(modules))

    return __getattr__, __dir__
