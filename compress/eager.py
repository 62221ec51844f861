"""Optimizer steps that stay eager under ``torch.compile`` without importing the compiler.

``torch.compiler.disable`` imports ``torch._dynamo`` (about 1 s on a CPU core), so decorating
a step with it at import time made every process that imports :mod:`cokit.compress` pay that
second: each spawned rank, each CLI call. :func:`eager` applies it at the first call instead.
Nothing can trace a step before ``torch._dynamo`` is imported, so until then the plain function
runs; from then on the disabled one is made once and used. When that first call is itself being
traced, Dynamo breaks the graph one extra time there (at making the disabled function) and the
step still runs eagerly.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn`` that ``torch.compile`` never traces: ``torch.compiler.disable(fn)``, made lazily."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing traces this call
                return fn(*args, **kwargs)
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]
