"""Occupancy: how many blocks of a kernel are resident per SM (CU on AMD), and why.

From a kernel's warps per block, per-block shared memory (LDS) and registers per thread, and
a device's :class:`~cokit.triton_kernels.backend.ArchLimits`, :func:`occupancy` computes resident
blocks per SM, warps per SM, the occupancy fraction and the limiting resource, using the
rules of CUDA's occupancy calculator (``cuda_occupancy.h``) and of AMD CDNA:

* warps:  ``max_warps_per_sm // num_warps``;
* shared: ``max_shared_per_sm // round_up(shared + reserved_per_block, unit)``
  (unit 128 B on NVIDIA; LDS is allocated in 512 B granules on gfx9);
* registers: allocated per warp in ``register_alloc_unit`` granules, from one of 4 register
  files (NVIDIA SM sub-partitions, AMD SIMDs):
  ``warps = 4 * ((registers_per_sm / 4) // round_up(regs * warp_size, unit))``,
  ``blocks = warps // num_warps`` (at most 8 waves per SIMD on AMD);
* blocks: ``max_blocks_per_sm``.

It works for a live GPU (:func:`kernel_occupancy` of a launched kernel, limits from the
driver, checked against the driver's own count by :func:`driver_occupancy`) and for a named
target from a laptop (a :class:`~cokit.triton_kernels.compile_only.CompiledKernel` built for
'sm_80' / 'sm_90' / 'gfx90a' / 'gfx942' without a GPU; the GEMM's is
:func:`cokit.triton_kernels.gemm.gemm_occupancy`).

:func:`smem_for_blocks` inverts the shared-memory rule: the per-block request that leaves a
chosen number of blocks per SM, for the occupancy-shaping knob of
:mod:`cokit.triton_kernels.shaped_launch`. This module is arithmetic on kernels and limits; it
imports no kernel family.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch

from .backend import ArchLimits, device_limits
from .shaped_launch import triton_compiled

__all__ = [
    "SHARED_ALLOC_UNIT",
    "Occupancy",
    "describe",
    "driver_occupancy",
    "kernel_occupancy",
    "occupancy",
    "shaping_table",
    "smem_for_blocks",
]

#: shared memory / LDS allocation granule per block, bytes.
SHARED_ALLOC_UNIT = {"cuda": 128, "hip": 512}
#: register files per SM: 4 sub-partitions (NVIDIA sm_70+), 4 SIMDs per CU (AMD CDNA).
REGISTER_FILES = 4

RESOURCES = ("shared memory", "registers", "warps", "blocks")


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """Residency of one kernel on one device (per SM on NVIDIA, per CU on AMD)."""

    target: str
    num_warps: int
    shared_bytes: int  # per-block reservation at launch (dynamic shared memory / LDS)
    registers: int | None  # per thread; None = unknown (not counted)
    blocks_by: dict[str, int]  # blocks per SM each resource allows
    blocks_per_sm: int
    warps_per_sm: int
    max_warps_per_sm: int
    num_sms: int
    limited_by: tuple[str, ...]  # resources that set blocks_per_sm (ties: several)

    @property
    def occupancy(self) -> float:
        """Resident warps / the SM's warp slots."""
        return self.warps_per_sm / self.max_warps_per_sm

    @property
    def limiting(self) -> str:
        """The (first) resource that limits residency."""
        return self.limited_by[0]

    @property
    def resident_blocks(self) -> int:
        """Blocks resident on the whole device at once (one wave of the grid)."""
        return self.blocks_per_sm * self.num_sms

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the derived occupancy, limiting resource and resident blocks."""
        d = dataclasses.asdict(self)
        d.update(
            occupancy=self.occupancy,
            limiting=self.limiting,
            resident_blocks=self.resident_blocks,
            limited_by=list(self.limited_by),
        )
        return d


def occupancy(num_warps: int, shared_bytes: int, registers: int | None, limits: ArchLimits) -> Occupancy:
    """Blocks per SM/CU for a kernel with ``num_warps`` warps, ``shared_bytes`` of shared
    memory per block and ``registers`` per thread on a device with ``limits``.

    A kernel that cannot launch at all (too much shared memory, too many threads or registers)
    gets 0 blocks, limited by that resource.
    """
    if not isinstance(num_warps, int) or num_warps < 1:
        raise ValueError(f"num_warps={num_warps!r} is invalid; allowed: an integer >= 1")
    if not isinstance(shared_bytes, int) or shared_bytes < 0:
        raise ValueError(f"shared_bytes={shared_bytes!r} is invalid; allowed: an integer >= 0")
    if registers is not None and (not isinstance(registers, int) or registers < 0):
        raise ValueError(f"registers={registers!r} is invalid; allowed: an integer >= 0 or None")
    by: dict[str, int] = {}
    # shared memory
    if shared_bytes > limits.max_shared_per_block:
        by["shared memory"] = 0
    elif shared_bytes == 0 and limits.reserved_shared_per_block == 0:
        by["shared memory"] = limits.max_blocks_per_sm
    else:
        unit = SHARED_ALLOC_UNIT[limits.backend]
        per_block = _round_up(shared_bytes + limits.reserved_shared_per_block, unit)
        by["shared memory"] = limits.max_shared_per_sm // per_block
    # registers (not counted when unknown)
    if not registers:
        pass
    elif registers > limits.max_registers_per_thread:
        by["registers"] = 0
    else:
        per_warp = _round_up(registers * limits.warp_size, limits.register_alloc_unit)
        per_file = limits.registers_per_sm // REGISTER_FILES
        warps_per_file = min(per_file // per_warp, limits.max_warps_per_sm // REGISTER_FILES)
        by["registers"] = (warps_per_file * REGISTER_FILES) // num_warps
    # warps (threads) and blocks
    if num_warps * limits.warp_size > limits.max_threads_per_block:
        by["warps"] = 0
    else:
        by["warps"] = limits.max_warps_per_sm // num_warps
    by["blocks"] = limits.max_blocks_per_sm
    blocks = min(by.values())
    return Occupancy(
        target=limits.target_name,
        num_warps=num_warps,
        shared_bytes=shared_bytes,
        registers=registers,
        blocks_by=by,
        blocks_per_sm=blocks,
        warps_per_sm=blocks * num_warps,
        max_warps_per_sm=limits.max_warps_per_sm,
        num_sms=limits.num_sms,
        limited_by=tuple(r for r in RESOURCES if by.get(r) == blocks),
    )


def smem_for_blocks(limits: ArchLimits, blocks: int) -> int:
    """A per-block ``smem_bytes`` request that leaves at most ``blocks`` blocks per SM/CU.

    It is the smallest request whose footprint (request + per-block reserve) is a whole number
    of allocation units and exceeds ``max_shared_per_sm / (blocks + 1)``, capped at the
    per-block limit. Raises when ``blocks`` is out of range.
    """
    if not isinstance(blocks, int) or not 1 <= blocks <= limits.max_blocks_per_sm:
        raise ValueError(f"blocks={blocks!r} is invalid; allowed: 1 to {limits.max_blocks_per_sm}")
    unit = SHARED_ALLOC_UNIT[limits.backend]
    footprint = _round_up(limits.max_shared_per_sm // (blocks + 1) + 1, unit)
    return min(footprint - limits.reserved_shared_per_block, limits.max_shared_per_block)


# ---------------------------------------------------------------------- kernels
def kernel_occupancy(kernel: Any, limits: ArchLimits | None = None) -> Occupancy:
    """Occupancy of a compiled kernel.

    ``kernel`` is a :class:`~cokit.triton_kernels.compile_only.CompiledKernel` (its target's limits)
    or a Triton ``CompiledKernel`` on the live GPU (registers from the loaded binary, limits
    from the driver unless given).
    """
    if hasattr(kernel, "limits") and hasattr(kernel, "shared_bytes"):  # compile-only build
        return occupancy(kernel.num_warps, kernel.shared_bytes, kernel.registers, limits or kernel.limits)
    meta = kernel.metadata
    if limits is None:
        limits = device_limits()
    kernel._init_handles()
    regs = getattr(kernel, "n_regs", None)
    return occupancy(int(meta.num_warps), int(meta.shared), int(regs) if regs is not None else None, limits)


def driver_occupancy(kernel: Any) -> int:
    """Blocks per SM the CUDA/HIP driver reports for a loaded kernel (GPU only).

    Uses ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` /
    ``hipModuleOccupancyMaxActiveBlocksPerMultiprocessor`` with the kernel's launch
    footprint, to check :func:`kernel_occupancy` on real hardware.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("driver_occupancy needs a GPU")
    compiled = triton_compiled(kernel)
    compiled._init_handles()
    meta = compiled.metadata
    threads = int(meta.num_warps) * int(meta.warp_size)
    n = ctypes.c_int(0)
    if torch.version.hip:
        lib = ctypes.CDLL("libamdhip64.so")
        fn = lib.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor
    else:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    err = fn(ctypes.byref(n), ctypes.c_void_p(compiled.function), threads, int(meta.shared))
    if err != 0:
        raise RuntimeError(f"driver occupancy query failed with error {err}")
    return n.value


def describe(
    occ: Occupancy, limits: ArchLimits, used_shared: int | None = None, spills: int | None = None
) -> str:
    """A human-readable table of an :class:`Occupancy` (used by ``cokit occupancy``)."""
    unit = "CU" if limits.backend == "hip" else "SM"
    warp = "wave" if limits.backend == "hip" else "warp"
    lines = [f"target          {limits.target_name}  ({limits.name}, {limits.num_sms} {unit}s)"]
    shared = f"{occ.shared_bytes} B per block reserved"
    if used_shared is not None and used_shared != occ.shared_bytes:
        shared += f" ({used_shared} B used by the kernel)"
    lines.append(
        f"shared memory   {shared}; limit {limits.max_shared_per_block} B/block, "
        f"{limits.max_shared_per_sm} B/{unit}"
    )
    regs = "unknown" if occ.registers is None else f"{occ.registers} per thread"
    if spills:
        regs += f" ({spills} spilled)"
    lines.append(f"registers       {regs}")
    by = ", ".join(f"{k} {v}" for k, v in occ.blocks_by.items())
    lines.append(f"blocks / {unit}     {occ.blocks_per_sm}   (allowed by {by})")
    lines.append(
        f"{warp}s / {unit}      {occ.warps_per_sm} of {occ.max_warps_per_sm}  ({occ.num_warps} per block)"
    )
    lines.append(f"occupancy       {occ.occupancy:.1%}")
    lines.append(f"limited by      {', '.join(occ.limited_by)}")
    lines.append(f"resident blocks {occ.resident_blocks} on {limits.num_sms} {unit}s")
    return "\n".join(lines)


def shaping_table(occ: Occupancy, limits: ArchLimits, used_shared: int) -> list[tuple[int, int]]:
    """(blocks per SM, smem_bytes to request) for each residency below the current one that
    occupancy shaping can reach (the request is at least what the kernel uses)."""
    rows = []
    for blocks in range(occ.blocks_per_sm - 1, 0, -1):
        smem = smem_for_blocks(limits, blocks)
        if smem >= used_shared and smem <= limits.max_shared_per_block:
            rows.append((blocks, smem))
    return rows
