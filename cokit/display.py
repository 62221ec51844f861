"""Helpers shared by the reports: byte counts for people, and pyplot for figure writers.

matplotlib is an optional extra (``pip install 'cokit[plot]'``): commands that draw check
:func:`have_matplotlib` and skip their figures with :data:`NO_MATPLOTLIB` as a note, or
refuse to start (``cokit sweep`` without ``--no-plots``).
"""

from __future__ import annotations

import math


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.50 KiB'``; ``None`` or a non-finite value -> ``'-'``."""
    if n is None or not math.isfinite(n):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``12.3 s``, ``4.5 min`` or ``2.25 h``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


#: how to get the figures
PLOT_EXTRA = "pip install 'cokit[plot]'"
#: why a figure was not drawn, and how to get it
NO_MATPLOTLIB = f"matplotlib is not installed ({PLOT_EXTRA})"


def matplotlib_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says that matplotlib is not installed (and not some other failure)."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "matplotlib"


def have_matplotlib() -> bool:
    """Whether matplotlib imports here (a broken install still raises)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as exc:
        if matplotlib_missing(exc):
            return False
        raise
    return True


def pyplot():
    """``matplotlib.pyplot``, imported when a report first draws. The backend is left alone
    (a notebook keeps its inline plots); headless entry points choose one themselves
    (:func:`cokit.cli.main` defaults ``MPLBACKEND`` to Agg)."""
    import matplotlib.pyplot as plt

    return plt
