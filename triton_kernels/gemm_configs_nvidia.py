"""NVIDIA (CUDA) GEMM configuration: the autotuning space and the vendor's knobs and limits.

A leaf module (it imports nothing of cokit), like the per-vendor ``opt_flags_nvidia`` of
Triton's own ``triton_kernels``: :func:`cokit.triton_kernels.gemm_config.config_space`
turns :data:`SPACE` into :class:`~cokit.triton_kernels.gemm_config.GemmConfig` objects and
:meth:`GemmConfig.validate` reads :data:`NUM_WARPS` and :data:`KNOBS`.

Targets: sm_80 (A100) and sm_90 (H100/H200). One space per dtype (:data:`SPACES`): the
16-bit space (:data:`SPACE`, fp16 and bf16) is Triton's matmul tutorial space plus larger-K
and 8-warp tiles; the fp32 space (:data:`SPACE_FP32`) has smaller register footprints, since
fp32 ``"ieee"`` dots have no tensor-core path on NVIDIA (FMA: the operand slices sit in
registers next to the accumulator). Each space's first entry is that dtype's default (the one
used without tuning when it fits). Entries whose shared memory does not fit a chip are pruned
at selection time (:func:`~cokit.triton_kernels.gemm_config.prune_configs`), so a space may
hold configs that only fit sm_90's 227 KiB per block.

Compile-checked: every entry was built for sm_80 and sm_90 (tiled and persistent forms, each
dtype of its space, ``ieee`` precision) with triton 3.6.0 and 3.9 where its shared memory
fits, and ``ptxas -v`` reported 0 B of stack and spills for each, except the persistent forms
listed in :data:`SPILLS` (pruned on that chip)
(``tests/test_gemm_config_fit.py`` rebuilds the defaults and a sample of each space).
Kept out of the fp32 space by that check (16-bit entries that spill in fp32): 128x256x64 and
256x128x64 at 8 warps, 128x128x{32,64} and 64x256x32 at 4 warps (255 registers, up to 5,888 B
of stack on sm_90), 64x64x64 (sm_80, triton 3.9), 64x64x32 at 4 warps (sm_90, triton 3.9),
128x256x32 and 256x128x32 at 8 warps. In the 16-bit space 32x64x32 at 2 warps, 5 stages
spilled 4 B on sm_90 (triton 3.9): it is 4 warps, 4 stages now.
"""

from __future__ import annotations

__all__ = ["BACKEND", "KNOBS", "NUM_WARPS", "SPACE", "SPACES", "SPACE_FP32", "SPILLS", "TARGETS", "WARP_SIZE"]

#: the Triton backend name these configs are for.
BACKEND = "cuda"
#: the named chips this space is tuned and compile-checked for.
TARGETS = ("sm_80", "sm_90")
#: threads per warp.
WARP_SIZE = 32
#: num_warps a block may have: up to 1024 threads (32 warps of 32); a power of 2.
NUM_WARPS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: GemmConfig fields only NVIDIA has: ``maxnreg`` (registers per thread cap, 16..255).
KNOBS: tuple[str, ...] = ("maxnreg",)


def _cfg(bm: int, bn: int, bk: int, group_m: int, warps: int, stages: int, **knobs: int) -> dict[str, int]:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
        **knobs,
    }


#: the configs autotuning tries for fp16 and bf16, as GemmConfig fields; the first is the default.
SPACE: tuple[dict[str, int], ...] = (
    _cfg(128, 256, 64, 8, 8, 3),
    _cfg(256, 128, 64, 8, 8, 3),
    _cfg(128, 128, 64, 8, 8, 4),
    _cfg(128, 128, 64, 8, 4, 4),
    _cfg(128, 128, 32, 8, 4, 4),
    _cfg(64, 256, 32, 8, 4, 4),
    _cfg(128, 64, 32, 8, 4, 4),
    _cfg(64, 128, 32, 8, 4, 4),
    _cfg(128, 32, 32, 8, 4, 4),
    _cfg(64, 64, 64, 8, 4, 3),
    _cfg(64, 32, 32, 8, 2, 5),
    _cfg(32, 64, 32, 8, 4, 4),
    _cfg(128, 128, 128, 8, 8, 3),
)

#: the configs autotuning tries for fp32, as GemmConfig fields; the first is the default. At
#: most 64 fp32 accumulators per thread and BLOCK_K <= 32 (wider K spilled on sm_80), except
#: 128x128x64 at 4 stages, which only fits sm_90 (196,608 B) and is spill-free there.
SPACE_FP32: tuple[dict[str, int], ...] = (
    _cfg(128, 128, 32, 8, 8, 3),
    _cfg(128, 128, 32, 8, 8, 4),
    _cfg(128, 128, 64, 8, 8, 4),
    _cfg(128, 128, 16, 8, 8, 4),
    _cfg(64, 256, 32, 8, 8, 3),
    _cfg(128, 64, 32, 8, 8, 4),
    _cfg(128, 64, 32, 8, 4, 4),
    _cfg(64, 128, 32, 8, 4, 4),
    _cfg(128, 32, 32, 8, 4, 4),
    _cfg(64, 32, 32, 8, 2, 5),
    _cfg(32, 64, 32, 8, 2, 5),
)

#: the space of each dtype, by its short name.
SPACES: dict[str, tuple[dict[str, int], ...]] = {"bf16": SPACE, "fp16": SPACE, "fp32": SPACE_FP32}

#: entries that spill on one chip in one form, dropped there by
#: :func:`~cokit.triton_kernels.gemm_config.prune_configs`: (target, dtypes, persistent,
#: entry). The persistent form keeps its tile loop's state live next to the accumulator, and on
#: sm_80 (mma.sync) the largest 16-bit tiles go over 255 registers: 16 to 88 B of spills on
#: triton 3.6.0 and 3.9 (128x128x32 and 64x256x32 at 4 warps on 3.9 only); sm_90 (wgmma)
#: builds them spill-free.
SPILLS: tuple[tuple[str, tuple[str, ...], bool, dict[str, int]], ...] = tuple(
    ("sm_80", ("bf16", "fp16"), True, _cfg(*tile))
    for tile in (
        (128, 256, 64, 8, 8, 3),
        (256, 128, 64, 8, 8, 3),
        (128, 128, 64, 8, 4, 4),
        (128, 128, 32, 8, 4, 4),
        (64, 256, 32, 8, 4, 4),
    )
)
