"""Helpers shared by the reports: byte counts for people, and pyplot for figure writers."""

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


def pyplot():
    """``matplotlib.pyplot``, imported when a report first draws. The backend is left alone
    (a notebook keeps its inline plots); headless entry points choose one themselves
    (:func:`cokit.cli.main` defaults ``MPLBACKEND`` to Agg)."""
    import matplotlib.pyplot as plt

    return plt
