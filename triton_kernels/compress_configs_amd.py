"""AMD (HIP/ROCm) launch configurations of the compression kernels (DCT, error feedback).

A leaf module (it imports nothing of cokit), like :mod:`~cokit.triton_kernels.gemm_configs_amd`:
:func:`cokit.triton_kernels.compress_config.config_space` turns :data:`SPACE` into
:class:`~cokit.triton_kernels.compress_config.KernelConfig` objects, pruned per block by a
register estimate (:data:`LIVE_FP32`).

CDNA (gfx90a, gfx942) runs fp32 ``"ieee"`` dots natively on MFMA (``v_mfma_f32_*_f32``), so the
dots keep full fp32 accuracy at tensor-core speed; a wavefront is 64 lanes.
"""

from __future__ import annotations

__all__ = [
    "BACKEND",
    "DEFAULT_PRECISION",
    "DOT_PRECISIONS",
    "LIVE_FP32",
    "NUM_WARPS",
    "SHARED_FP32_BLOCKS",
    "SPACE",
    "TARGETS",
    "WARP_SIZE",
    "space_for",
]

#: the Triton backend name these configs are for.
BACKEND = "hip"
#: the named chips these configs are compile-checked for.
TARGETS = ("gfx90a", "gfx942")
#: threads per wavefront (CDNA).
WARP_SIZE = 64
#: num_warps (wavefronts) a compression kernel may be launched with (up to 1024 threads).
NUM_WARPS: tuple[int, ...] = (1, 2, 4, 8, 16)
#: ``tl.dot`` input precisions AMD accepts in triton 3.6 and 3.9 ("tf32" only on some chips).
DOT_PRECISIONS: tuple[str, ...] = ("ieee", "bf16x3", "bf16x6")
#: the precision of every entry of :data:`SPACE` (native fp32 MFMA).
DEFAULT_PRECISION = "ieee"


#: the configs a block may be launched with, per kernel, as KernelConfig fields; the first
#: that fits the block's register estimate is the default. All compile without VGPR spills
#: on gfx942 (triton 3.6 and 3.9), and the DCT with no SGPR spills, its basis read with
#: 128-bit loads (the offsets are provably multiples of 256 elements: 8 of 32 basis loads
#: per thread wide in the unhinted 64x64 encode at 4 waves, all 14 global accesses wide in
#: the aligned one; 0 wide before). The fused encode still spills 10-57 SGPRs (to VGPR lanes,
#: not memory): every masked element load or store keeps a 64-bit exec mask in SGPRs, and
#: waves_per_eu does not change that (compile-checked). The decode starts at 8 waves, where
#: it has no SGPR spills (20 at 4 waves, 1-D).
_W4 = {"num_warps": 4, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
_W8 = {"num_warps": 8, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
SPACE: dict[str, tuple[dict[str, object], ...]] = {
    "dct_encode": (_W4, _W8),
    "dct_decode": (_W4, _W8),
    "ef_encode": (_W4, _W8),
    "ef_decode": (_W8, _W4),
}


def space_for(kernel: str, arch: int | str) -> tuple[dict[str, object], ...]:
    """The configs of ``kernel`` on one chip: the same :data:`SPACE` on every CDNA chip."""
    return SPACE[kernel]


#: fp32 values per block element a kernel holds at its peak (operands, accumulators, mask
#: and index blocks): the register estimate ``LIVE_FP32 * elements / threads + 32`` prunes
#: blocks far too large for the register file before a launch. It is a lower bound, not a
#: spill predictor: whether a shipped build spills is read from the compiler
#: (tests/test_compile_targets.py, ``cokit info --kernels``).
LIVE_FP32: dict[str, int] = {"dct_encode": 6, "dct_decode": 6, "ef_encode": 6, "ef_decode": 6}
#: fp32 blocks (``max(BLOCK_ROWS, BLOCK_W) x BLOCK_W``) a kernel's layout conversions stage in
#: shared memory at once, the most any compile-only build of triton 3.6 or 3.9 uses (gfx942:
#: 16 KiB for 64x64 blocks, 32 KiB for the fused encode on triton 3.9).
SHARED_FP32_BLOCKS: dict[str, int] = {"dct_encode": 1, "dct_decode": 1, "ef_encode": 2, "ef_decode": 1}
