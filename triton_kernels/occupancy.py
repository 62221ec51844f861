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
driver) and for a named target from a laptop (:func:`gemm_occupancy` compiles for
'sm_80' / 'sm_90' / 'gfx90a' / 'gfx942' without a GPU).

:func:`with_shared_memory` is the occupancy-shaping knob: a copy of a compiled Triton kernel
whose launch reserves more shared memory per block (same binary; the launcher passes
``metadata.shared`` as the dynamic shared-memory size and raises the opt-in limit from it).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
from typing import Any

import torch

from .backend import ArchLimits, arch_limits, device_limits

__all__ = [
    "SHARED_ALLOC_UNIT",
    "Occupancy",
    "driver_occupancy",
    "gemm_occupancy",
    "kernel_occupancy",
    "occupancy",
    "smem_for_blocks",
    "launch_shaped",
    "with_shared_memory",
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
        d.update(occupancy=self.occupancy, limiting=self.limiting, resident_blocks=self.resident_blocks,
                 limited_by=list(self.limited_by))
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
def _triton_compiled(kernel: Any) -> Any:
    """The Triton CompiledKernel inside ``kernel`` (compile_only.CompiledKernel or itself)."""
    inner = getattr(kernel, "compiled", None)
    return inner if inner is not None and hasattr(inner, "metadata") else kernel


def with_shared_memory(kernel: Any, smem_bytes: int, limits: ArchLimits | None = None) -> Any:
    """A copy of a compiled kernel that reserves ``smem_bytes`` of shared memory per block.

    ``kernel`` is a Triton ``CompiledKernel`` (from ``fn.warmup``/``fn[grid](...)`` or
    ``triton.compile``) or a :class:`~cokit.triton_kernels.compile_only.CompiledKernel`; the result
    has the same type. The binary is shared; only ``metadata.shared`` (what the launcher passes
    as the dynamic shared-memory size, and the opt-in limit it sets at load) changes, so the
    copy launches the same code with fewer blocks per SM. Raises when ``smem_bytes`` is below
    what the kernel uses or above ``limits.max_shared_per_block``.
    """
    from triton.compiler.compiler import make_backend

    compiled = _triton_compiled(kernel)
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
    shaped = copy.copy(compiled)
    shaped.metadata = compiled.metadata._replace(shared=smem_bytes)
    shaped.packed_metadata = make_backend(shaped.metadata.target).pack_metadata(shaped.metadata)
    # the copy loads its own module on first launch (with the raised opt-in limit)
    shaped.module = None
    shaped.function = None
    shaped._run = None
    shaped._module_pid = None
    if wrapped:
        return dataclasses.replace(kernel, shared_bytes=smem_bytes, compiled=shaped)
    return shaped


# (kernel hash, device index, smem_bytes) -> the shaped copy, loaded once per device
_SHAPED: dict[tuple[str, int, int], Any] = {}


def launch_shaped(kernel: Any, grid: tuple[int, ...], args: dict[str, Any], opts: dict[str, Any],
                  smem_bytes: int, limits: ArchLimits | None, device_index: int) -> None:
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
    compiled = _triton_compiled(kernel)
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


def gemm_occupancy(
    config: Any,
    target: str | None = None,
    dtype: torch.dtype | str = "bf16",
    *,
    precision: str = "ieee",
) -> tuple[Occupancy, Any, int]:
    """Compile the GEMM for ``config`` and compute its occupancy, ``smem_bytes`` applied.

    ``target`` names a chip ('sm_80', 'sm_90', 'gfx90a', 'gfx942'; compile-only, needs a
    process without ``TRITON_INTERPRET``); ``None`` means the live GPU. Returns the occupancy,
    the compiled kernel (a :class:`~cokit.triton_kernels.compile_only.CompiledKernel` for a named
    target, a Triton ``CompiledKernel`` on the live GPU; launch footprint ``smem_bytes``) and
    the shared memory the kernel itself uses.
    """
    from .gemm import compile_gemm, warmup_gemm

    if target is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no GPU here: name a target (sm_80, sm_90, gfx90a, gfx942)")
        limits = device_limits()
        built = warmup_gemm(config.replace(smem_bytes=None), dtype, precision=precision)
    else:
        limits = arch_limits(target)
        built = compile_gemm(config.replace(smem_bytes=None), dtype, target, precision=precision)
    used = int(_triton_compiled(built).metadata.shared)
    if config.smem_bytes is not None:
        built = with_shared_memory(built, config.smem_bytes, limits)
    return kernel_occupancy(built, limits), built, used


def describe(occ: Occupancy, limits: ArchLimits, used_shared: int | None = None, spills: int | None = None) -> str:
    """A human-readable table of an :class:`Occupancy` (used by ``cokit occupancy``)."""
    unit = "CU" if limits.backend == "hip" else "SM"
    warp = "wave" if limits.backend == "hip" else "warp"
    lines = [f"target          {limits.target_name}  ({limits.name}, {limits.num_sms} {unit}s)"]
    shared = f"{occ.shared_bytes} B per block reserved"
    if used_shared is not None and used_shared != occ.shared_bytes:
        shared += f" ({used_shared} B used by the kernel)"
    lines.append(f"shared memory   {shared}; limit {limits.max_shared_per_block} B/block, "
                 f"{limits.max_shared_per_sm} B/{unit}")
    regs = "unknown" if occ.registers is None else f"{occ.registers} per thread"
    if spills:
        regs += f" ({spills} spilled)"
    lines.append(f"registers       {regs}")
    by = ", ".join(f"{k} {v}" for k, v in occ.blocks_by.items())
    lines.append(f"blocks / {unit}     {occ.blocks_per_sm}   (allowed by {by})")
    lines.append(f"{warp}s / {unit}      {occ.warps_per_sm} of {occ.max_warps_per_sm}  ({occ.num_warps} per block)")
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

