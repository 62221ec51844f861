"""Old import paths that still work for one release: a module that moved keeps a thin shim
whose names resolve, on first use, to their new home with a ``DeprecationWarning`` naming it.

A shim defines ``NAMES`` (name -> the module it lives in now) and a module ``__getattr__``
that calls :func:`resolve`; nothing is imported until a name is used, so importing the shim
itself loads no kernel and warns nothing.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

#: when the shims go away (the DeprecationWarning says so)
REMOVAL = "the next release"


def resolve(old: str, name: str, names: Mapping[str, str]) -> Any:
    """``name`` of shim module ``old`` from its new home (``names[name]``), warning the caller
    (the code that used the old path) with a ``DeprecationWarning``; ``AttributeError`` for a
    name the shim never had."""
    home = names.get(name)
    if home is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(
        f"{old}.{name} moved to {home}.{name}; import it from {home} ({old} is removed in {REMOVAL})",
        DeprecationWarning,
        stacklevel=3,  # resolve <- the shim's __getattr__ <- the caller
    )
    return getattr(importlib.import_module(home), name)
