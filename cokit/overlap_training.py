"""Deprecated path of :mod:`cokit.overlap.training` (``apply_overlap`` and its tuning), kept for
one release. Each name warns once used."""

from __future__ import annotations

from typing import Any

from cokit import _moved

NAMES = dict.fromkeys(
    (
        "MAX_BATCH",
        "RESERVE_FRACTIONS",
        "OverlapTuning",
        "ShapeClass",
        "apply_overlap",
        "shaped_candidates",
    ),
    "cokit.overlap.training",
)
__all__ = sorted(NAMES)


def __getattr__(name: str) -> Any:
    return _moved.resolve(__name__, name, NAMES)


def __dir__() -> list[str]:
    return __all__
