"""Lazy public names (PEP 562): a package lists `name -> module` and imports the module on first use, so
that importing the package stays light (no torch until a torch-backed name is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, names: dict[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package` for `names` (public name -> defining module).

    Args:
        package: the package's name, for the AttributeError message.
        names: each lazily exported name and the module that defines it.
        namespace: the package's `globals()`: a resolved name is cached there.

    Raises:
        AttributeError: (from `__getattr__`) a name the package does not export.
    """

    def __getattr__(name: str) -> Any:
        module_name = names.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace.get("__all__", names))

    return __getattr__, __dir__
