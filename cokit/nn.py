"""Deprecated path of the overlap layers, kept for one release: :class:`Linear` is in
:mod:`cokit.overlap.layers`, :func:`apply_overlap` and :class:`OverlapTuning` in
:mod:`cokit.overlap.training`, the tensor-parallel layers in :mod:`cokit.overlap.tensor_parallel`
(all of them also in :mod:`cokit.overlap`). Each name warns once used."""

from __future__ import annotations

from typing import Any

from cokit import _moved

NAMES = {
    "Linear": "cokit.overlap.layers",
    "OverlapTuning": "cokit.overlap.training",
    "apply_overlap": "cokit.overlap.training",
    "ColumnParallelLinear": "cokit.overlap.tensor_parallel",
    "RowParallelLinear": "cokit.overlap.tensor_parallel",
}
__all__ = sorted(NAMES)


def __getattr__(name: str) -> Any:
    return _moved.resolve(__name__, name, NAMES)


def __dir__() -> list[str]:
    return __all__
