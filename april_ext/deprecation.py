"""Old names kept while users move to new ones: a module's ``__getattr__`` that answers an old name with the
object it is now and a DeprecationWarning that says where that is."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module``: an old name of ``names`` (old name -> the dotted path of what it is now)
    warns and gives that object; any other name is an AttributeError, as for a module without one."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, attr = names[name].rpartition(".")
        warnings.warn(f"{module}.{name} is deprecated: use {names[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), attr)

    return __getattr__


__all__ = ["renamed"]
