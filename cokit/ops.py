"""Functional ops on cokit's Triton kernels, for app code: ``linear`` (``F.linear`` on the
Triton GEMM, op ``cokit::linear``) and ``matmul`` (``cokit::matmul``)."""

from __future__ import annotations

from cokit.triton_kernels.gemm import matmul
from cokit.triton_kernels.linear import linear

__all__ = ["linear", "matmul"]
