"""Old names kept while users move to new ones: a module's ``__getattr__`` that answers an old name with the
object of its new name and a DeprecationWarning that says which name to use."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, str], lookup: Callable[[str], Any]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module``: an old name of ``names`` (old -> new) warns and gives ``lookup(new)``;
    any other name is an AttributeError, as for a module without one."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: it is now {module}.{names[name]}", DeprecationWarning,
                      stacklevel=2)
        return lookup(names[name])

    return __getattr__


__all__ = ["renamed"]
