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
#: that fits the block's register estimate is the default. All compile without VGPR or SGPR
#: spills on gfx942 (triton 3.6 and 3.9, tests/test_compile_targets.py), the DCT and the
#: fused encode with 128-bit basis loads (the offsets are provably multiples of 256
#: elements). SGPRs were the fused kernels' limit: a wavefront keeps every boolean block
#: (a mask, a comparison) in 64-bit SGPR pairs, 32 SGPRs per block at 16 elements per
#: thread, so the encode's top-k makes its mask last, from integers
#: (:func:`~cokit.triton_kernels.topk.topk_select`; it spilled 10-64 SGPRs) and the 1-D
#: decode reads its payload without row masks (it spilled 20 at 4 waves). waves_per_eu
#: changes none of that. The decode starts at 8 waves (6-8 waves per SIMD at 1-D).
_W4 = {"num_warps": 4, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
_W8 = {"num_warps": 8, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
SPACE: dict[str, tuple[dict[str, object], ...]] = {
    "dct_encode": (_W4, _W8),
    "dct_decode": (_W4, _W8),
    "ef_encode": (_W4, _W8),
    "ef_decode": (_W8, _W4),
}


def space_for(kernel: str, arch: int | str | None, two_d: bool = True) -> tuple[dict[str, object], ...]:
    """The configs of ``kernel`` on one chip: the same :data:`SPACE` on every CDNA chip, for
    2-D and 1-D blocks."""
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
