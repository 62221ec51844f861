"""NVIDIA (CUDA) launch configurations of the compression kernels (DCT, error feedback).

A leaf module (it imports nothing of cokit), like :mod:`~cokit.triton_kernels.gemm_configs_nvidia`:
:func:`cokit.triton_kernels.compress_config.config_space` turns :data:`SPACE` into
:class:`~cokit.triton_kernels.compress_config.KernelConfig` objects, pruned per block by a
register estimate fitted to ``ptxas -v`` of compile-only builds (:data:`LIVE_FP32`).

The dots run at ``"tf32x3"`` from sm_90 on: three TF32 tensor-core products (hi*hi + hi*lo +
lo*hi) give fp32-class accuracy (tests/test_dct_precision.py: 2.1e-7 relative error on 64x64
DCT encodes, as plain fp32). Before sm_90 (:func:`space_for`) they run at ``"bf16x6"``, split
by hand into six bf16 products (:func:`cokit.triton_kernels.dct.dot_fp32`), at 4, 8 or 16
warps: sm_80 compiles that without spills, tf32x3 with hundreds of bytes. ``"ieee"`` (fp32 FMA
dots) has no tensor-core path and spills kilobytes per thread at 64x64 blocks (6.8 KB stack for the 2-D
DCT encode on sm_90), so it is not in the space.
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
BACKEND = "cuda"
#: the named chips these configs are compile-checked for.
TARGETS = ("sm_80", "sm_90")
#: threads per warp.
WARP_SIZE = 32
#: num_warps a compression kernel may be launched with (a block of up to 1024 threads).
NUM_WARPS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: ``tl.dot`` input precisions NVIDIA accepts in triton 3.6 and 3.9.
DOT_PRECISIONS: tuple[str, ...] = ("tf32", "tf32x3", "ieee", "bf16x3", "bf16x6")
#: the precision of every entry of :data:`SPACE` (fp32-class accuracy on tensor cores).
DEFAULT_PRECISION = "tf32x3"


#: the configs a 2-D block may be launched with, per kernel, as KernelConfig fields (1-D
#: blocks: :data:`_ONE_D` where it differs); the first that fits the block's register
#: estimate is the default. Every one compiles with no stack or spill bytes for the shipped
#: 64x64 blocks on sm_90 (triton 3.6 and 3.9, tests/test_compile_targets.py). The DCT's
#: default (4 warps, 122-142 registers) leaves 3-4 blocks per SM. The fused decode's 2-D
#: build at 4 warps holds 237-252 registers: 2 blocks per SM. The fused encode's 2-D build
#: spills at 4 warps (32 B, triton 3.9) and at 16 (about 100 B), so it runs at 8 (182-208
#: registers, 1 block per SM).
_W4 = {"num_warps": 4, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
_W8 = {"num_warps": 8, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
_W16 = {"num_warps": 16, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
SPACE: dict[str, tuple[dict[str, object], ...]] = {
    "dct_encode": (_W4, _W8, _W16),
    "dct_decode": (_W4, _W8, _W16),
    "ef_encode": (_W8,),
    "ef_decode": (_W4, _W8, _W16),
}
#: 1-D blocks (rows of 1-D tiles) of the fused kernels: the encode compiles spill-free at 4
#: warps (186-254 registers, 2 blocks per SM), the decode does not (144-280 B at 4 warps).
_ONE_D: dict[str, tuple[dict[str, object], ...]] = {"ef_encode": (_W4, _W8), "ef_decode": (_W8, _W16)}
#: before sm_90 (mma.sync holds the operands in registers, wgmma reads them from shared
#: memory) tf32x3 spills up to 800 B per thread on the 64x64 DCT; the hand-split bf16x6
#: (fp32-class too) does not. At 8 warps it holds 174-200 registers (1 block per SM, 8 of
#: 64 warp slots); at 4 warps the DCT encode/decode (231-252 registers), the fused encode
#: (190-255: it reads its buffer block again instead of holding it through the transforms)
#: and the fused 2-D decode (211-253) compile spill-free on triton 3.6 and 3.9, so 2 blocks
#: share an SM and one block's loads overlap the other's dots: 4 warps come first. The
#: fused 1-D decode stays at 8 or 16 warps: it spills 440 B at 4 (triton 3.6).
_B6_W4 = {"num_warps": 4, "num_stages": 1, "dot_precision": "bf16x6"}
_B6_W8 = {"num_warps": 8, "num_stages": 1, "dot_precision": "bf16x6"}
_B6_W16 = {"num_warps": 16, "num_stages": 1, "dot_precision": "bf16x6"}
_PRE_HOPPER: dict[str, tuple[dict[str, object], ...]] = {
    "dct_encode": (_B6_W4, _B6_W8, _B6_W16),
    "dct_decode": (_B6_W4, _B6_W8, _B6_W16),
    "ef_encode": (_B6_W4, _B6_W8, _B6_W16),
    "ef_decode": (_B6_W4, _B6_W8, _B6_W16),
}
_PRE_HOPPER_ONE_D: dict[str, tuple[dict[str, object], ...]] = {"ef_decode": (_B6_W8, _B6_W16)}


def space_for(kernel: str, arch: int | str | None, two_d: bool = True) -> tuple[dict[str, object], ...]:
    """The configs of ``kernel`` on one chip (``arch`` None: the newest) for 2-D or 1-D blocks:
    :data:`SPACE` from sm_90 on, ``"bf16x6"`` before (4, 8 or 16 warps; the fused 1-D decode
    8 or 16)."""
    space, one_d = (SPACE, _ONE_D) if arch is None or int(arch) >= 90 else (_PRE_HOPPER, _PRE_HOPPER_ONE_D)
    return space[kernel] if two_d else one_d.get(kernel, space[kernel])


#: fp32 values per block element a kernel holds at its peak (operands, accumulators, mask
#: and index blocks): the register estimate ``LIVE_FP32 * elements / threads + 32`` prunes
#: blocks far too large for the register file before a launch. It is a lower bound, not a
#: spill predictor: whether a shipped build spills is read from the compiler
#: (tests/test_compile_targets.py, ``cokit info --kernels``).
LIVE_FP32: dict[str, int] = {"dct_encode": 6, "dct_decode": 6, "ef_encode": 6, "ef_decode": 6}
#: fp32 blocks (``max(BLOCK_ROWS, BLOCK_W) x BLOCK_W``) a kernel's layout conversions stage in
#: shared memory at once, the most any compile-only build of triton 3.6 or 3.9 uses (sm_90:
#: 32 KiB for the 64x64 DCT, 64 KiB for the error-feedback kernels).
SHARED_FP32_BLOCKS: dict[str, int] = {"dct_encode": 2, "dct_decode": 2, "ef_encode": 4, "ef_decode": 4}
