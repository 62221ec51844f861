"""NVIDIA (CUDA) launch configurations of the compression kernels (DCT, error feedback).

A leaf module (it imports nothing of cokit), like :mod:`~cokit.triton_kernels.gemm_configs_nvidia`:
:func:`cokit.triton_kernels.compress_config.config_space` turns :data:`SPACE` into
:class:`~cokit.triton_kernels.compress_config.KernelConfig` objects, pruned per block by a
register estimate fitted to ``ptxas -v`` of compile-only builds (:data:`LIVE_FP32`).

The dots run at ``"tf32x3"`` from sm_90 on: three TF32 tensor-core products (hi*hi + hi*lo +
lo*hi) give fp32-class accuracy (tests/test_dct_precision.py: 2.1e-7 relative error on 64x64
DCT encodes, as plain fp32). Before sm_90 (:func:`space_for`) they run at ``"bf16x6"`` and 8
warps, which sm_80 compiles with far fewer spills than tf32x3. ``"ieee"`` (fp32 FMA dots) has no
tensor-core path and spills kilobytes per thread at 64x64 blocks (6.8 KB stack for the 2-D
DCT encode on sm_90), so it is not in the space.
"""

from __future__ import annotations

__all__ = [
    "BACKEND",
    "DEFAULT_PRECISION",
    "DOT_PRECISIONS",
    "LIVE_FP32",
    "NUM_WARPS",
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


#: the configs a block may be launched with, per kernel, as KernelConfig fields; the first
#: that fits the block's register estimate is the default. Only builds that ``ptxas -v``
#: reports spill-free on sm_90 for the shipped 64x64 blocks are here, except the fused encode's
#: 2-D build (tests/test_compile_targets.py lists what still spills): at 4 warps the
#: error-feedback kernels spill more, so they start at 8.
_W4 = {"num_warps": 4, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
_W8 = {"num_warps": 8, "num_stages": 1, "dot_precision": DEFAULT_PRECISION}
SPACE: dict[str, tuple[dict[str, object], ...]] = {
    "dct_encode": (_W4, _W8),
    "dct_decode": (_W4, _W8),
    "ef_encode": (_W8,),
    "ef_decode": (_W8,),
}
#: before sm_90 (mma.sync keeps every warp's operand slices in registers) tf32x3 spills up to
#: 800 B per thread on the 64x64 DCT; bf16x6 (fp32-class too) at 8 warps does not.
_PRE_HOPPER = ({"num_warps": 8, "num_stages": 1, "dot_precision": "bf16x6"},)


def space_for(kernel: str, arch: int | str) -> tuple[dict[str, object], ...]:
    """The configs of ``kernel`` on one chip: :data:`SPACE` from sm_90 on (wgmma reads its
    operands from shared memory), 8 warps at ``"bf16x6"`` before."""
    return SPACE[kernel] if int(arch) >= 90 else _PRE_HOPPER


#: fp32 values per block element a kernel holds at its peak (operands, accumulators, mask
#: and index blocks): the register estimate ``LIVE_FP32 * elements / threads + 32`` prunes
#: blocks far too large for the register file before a launch. It is a lower bound, not a
#: spill predictor: whether a shipped build spills is read from the compiler
#: (tests/test_compile_targets.py, ``cokit info --kernels``).
LIVE_FP32: dict[str, int] = {"dct_encode": 6, "dct_decode": 6, "ef_encode": 6, "ef_decode": 6}
