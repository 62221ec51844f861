"""Deprecated path of the functional ops, kept for one release: ``linear`` (``F.linear`` on the
Triton GEMM, op ``cokit::linear``) is in :mod:`cokit.triton_kernels.linear`, ``matmul`` (op
``cokit::matmul``) in :mod:`cokit.triton_kernels.gemm`. Each name warns once used."""

from __future__ import annotations

from typing import Any

from cokit import _moved

NAMES = {"linear": "cokit.triton_kernels.linear", "matmul": "cokit.triton_kernels.gemm"}
__all__ = sorted(NAMES)


def __getattr__(name: str) -> Any:
    return _moved.resolve(__name__, name, NAMES)


def __dir__() -> list[str]:
    return __all__
