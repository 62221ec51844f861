"""Occupancy shaping: launch a compiled Triton kernel reserving more shared memory per block.

No public Triton knob requests extra shared memory. The launcher passes a compiled kernel's
``metadata.shared`` as the launch's dynamic shared-memory size (inside ``packed_metadata``)
and raises the function's opt-in limit from the same field when it loads the binary, so a
copy of a compiled kernel whose metadata carries a larger ``shared`` launches the same code
with a bigger per-block footprint: fewer blocks fit on an SM/CU (docs/design.md §1.2).

* :func:`with_shared_memory` makes that copy (from a live kernel or a compile-only build);
* :func:`launch_shaped` compiles a ``@triton.jit`` kernel for the live GPU, shapes it once
  per (kernel, device, size) and launches it; the GEMM and the SM copy use it for their
  ``smem_bytes`` arguments.

How many blocks a given size leaves per SM is :mod:`cokit.triton_kernels.occupancy`'s business
(``smem_for_blocks``); this module only builds and launches the shaped kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._compat import repack_metadata, unloaded_copy
from .backend import ArchLimits

__all__ = ["launch_shaped", "triton_compiled", "with_shared_memory"]


def triton_compiled(kernel: Any) -> Any:
    """The Triton ``CompiledKernel`` inside ``kernel`` (a
    :class:`~cokit.triton_kernels.compile_only.CompiledKernel`), or ``kernel`` itself."""
    inner = getattr(kernel, "compiled", None)
    return inner if inner is not None and hasattr(inner, "metadata") else kernel


def with_shared_memory(kernel: Any, smem_bytes: int, limits: ArchLimits | None = None) -> Any:
    """A copy of a compiled kernel that reserves ``smem_bytes`` of shared memory per block.

    ``kernel`` is a Triton ``CompiledKernel`` (from ``fn.warmup``/``fn[grid](...)`` or
    ``triton.compile``) or a :class:`~cokit.triton_kernels.compile_only.CompiledKernel`; the result
    has the same type. The binary is shared; only ``metadata.shared`` (what the launcher passes
    as the dynamic shared-memory size, and the opt-in limit it sets at load) changes, so the
    copy launches the same code with fewer blocks per SM. Raises when ``smem_bytes`` is below
    what the kernel uses or above ``limits.max_shared_per_block`` (``limits`` defaults to the
    compile-only build's target).
    """
    compiled = triton_compiled(kernel)
    wrapped = compiled is not kernel  # a compile_only.CompiledKernel around it
    used = int(compiled.metadata.shared)
    if not isinstance(smem_bytes, int) or isinstance(smem_bytes, bool):
        raise ValueError(f"smem_bytes={smem_bytes!r} is invalid; allowed: an integer number of bytes")
    if limits is None:
        limits = getattr(kernel, "limits", None)
    if smem_bytes < used:
        hi = f" to {limits.max_shared_per_block}" if limits is not None else " or more"
        raise ValueError(
            f"smem_bytes={smem_bytes} is below the {used} B of shared memory kernel "
            f"{compiled.metadata.name} uses; allowed: {used}{hi}"
        )
    if limits is not None and smem_bytes > limits.max_shared_per_block:
        raise ValueError(
            f"smem_bytes={smem_bytes} is above the device limit of {limits.max_shared_per_block} B "
            f"per block on {limits.name}; allowed: {used} to {limits.max_shared_per_block}"
        )
    shaped = unloaded_copy(compiled)  # loads its own module (with the raised opt-in limit)
    shaped.metadata = compiled.metadata._replace(shared=smem_bytes)
    shaped.packed_metadata = repack_metadata(shaped)
    if wrapped:
        return dataclasses.replace(kernel, shared_bytes=smem_bytes, compiled=shaped)
    return shaped


# (kernel hash, device index, smem_bytes) -> the shaped copy, loaded once per device
_SHAPED: dict[tuple[str, int, int], Any] = {}


def launch_shaped(
    kernel: Any,
    grid: tuple[int, ...],
    args: dict[str, Any],
    opts: dict[str, Any],
    smem_bytes: int,
    limits: ArchLimits | None,
    device_index: int,
) -> None:
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` reserving ``smem_bytes`` of shared
    memory per block (GPU only).

    ``args`` holds every kernel argument by name, constexprs included; ``opts`` the launch
    options (num_warps, ...). The kernel is compiled by ``kernel.warmup``, shaped once per
    (kernel, device, smem_bytes) by :func:`with_shared_memory`, and launched as a compiled
    kernel, which takes every argument positionally and a 3-D grid (padded here with 1s).
    """
    compiled = kernel.warmup(**args, **opts, grid=grid)
    key = (compiled.hash, device_index, smem_bytes)
    shaped = _SHAPED.get(key)
    if shaped is None:
        shaped = _SHAPED[key] = with_shared_memory(compiled, smem_bytes, limits)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    shaped[grid3](*(args[name] for name in kernel.arg_names))
