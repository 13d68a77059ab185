"""Old spellings of public names, kept working for one release with a DeprecationWarning.

A front door whose names moved or were renamed lists them in a table, ``old name -> (module,
name)`` of the new home, and answers them from its module ``__getattr__`` (PEP 562) through
:func:`moved`: the old import keeps working, warns once per call site, and says the line to
write instead. A name that leaves the public face with no public home maps to ``(module, name,
why)``: the warning says why instead. A name is never dropped silently.
"""

from __future__ import annotations

import importlib
import types
import warnings
from collections.abc import Mapping
from typing import Any

REMOVED_IN = "0.3.0"
"""The release the old spellings go in (they work, with a warning, throughout 0.2)."""


def moved(package: str, name: str, table: Mapping[str, tuple[str, ...]]) -> Any:
    """The value ``package.name`` now has in its new home, with a DeprecationWarning that
    points at the caller's line; AttributeError, worded as Python's own, when ``name`` is
    not in ``table``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = moved("old", "sep", {"sep": ("os", "sep")})
        >>> import os; value == os.sep
        True
        >>> print(caught[0].message)
        old.sep moved: write `from os import sep` (old.sep goes in flexmask 0.3.0)
    """
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, new_name, *why = table[name]
    advice = why[0] if why else f"moved: write `from {module} import {new_name}`"
    warnings.warn(
        f"{package}.{name} {advice} ({package}.{name} goes in flexmask {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,  # moved <- the front door's __getattr__ <- the user's line
    )
    return getattr(importlib.import_module(module), new_name)


class MovedModule(types.ModuleType):
    """A module that moved: its old dotted path answers every name from the new module, with
    a DeprecationWarning (``from old.path import name`` keeps working)."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Moved to {new}: import from there ({old} goes in {REMOVED_IN}).")
        self._new = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's probes (__path__, ...): not a user's
            raise AttributeError(name)
        module = importlib.import_module(self._new)
        if not hasattr(module, name):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"the module {self.__name__} moved to {self._new}: write `from {self._new} import "
            f"{name}` ({self.__name__} goes in flexmask {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, name)
