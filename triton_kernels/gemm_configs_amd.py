"""AMD (HIP/ROCm) GEMM configuration: the autotuning space and the vendor's knobs and limits.

A leaf module (it imports nothing of cokit), like the per-vendor ``opt_flags_amd`` of
Triton's own ``triton_kernels``: :func:`cokit.triton_kernels.gemm_config.config_space`
turns :data:`SPACE` into :class:`~cokit.triton_kernels.gemm_config.GemmConfig` objects and
:meth:`GemmConfig.validate` reads :data:`NUM_WARPS` and :data:`KNOBS`.

Targets: gfx90a (MI250X) and gfx942 (MI300). One space per dtype (:data:`SPACES`), after
Triton's AMD matmul space: the stream pipeliner's ``num_stages=2``, with ``waves_per_eu``
(occupancy hint: it caps VGPRs at 512 / waves), MFMA 16x16 or 32x32 instructions
(``matrix_instr_nonkdim``) and ``kpack`` choices. Each space's first entry is that dtype's
default (the one used without tuning when it fits). Shared memory (LDS) is 64 KiB per block:
entries over it are pruned at selection time
(:func:`~cokit.triton_kernels.gemm_config.prune_configs`).

Compile-checked: every entry was built for gfx942 (tiled and persistent forms, each dtype of
its space) with triton 3.6.0 and 3.9, and the AMDGCN metadata reported 0 VGPR and SGPR spills
and no scratch for each, except the persistent form listed in :data:`SPILLS` (pruned on that
chip) (``tests/test_gemm_config_fit.py`` rebuilds the defaults and a sample
of each space). Changed by that check: the 16-bit default 256x256x64 uses 32x32 MFMA
instructions (with 16x16 it spilled 23 VGPRs on triton 3.9), 64x64x32 runs at
``waves_per_eu=4`` (8 capped it at 64 VGPRs: spills), and fp32 has its own space (the 16-bit
one spilled 3 to 57 VGPRs in fp32 for 256x256x32, 128x64x64, 64x64x64 and 64x64x32).
"""

from __future__ import annotations

__all__ = ["BACKEND", "KNOBS", "NUM_WARPS", "SPACE", "SPACES", "SPACE_FP32", "SPILLS", "TARGETS", "WARP_SIZE"]

#: the Triton backend name these configs are for.
BACKEND = "hip"
#: the named chips this space is tuned and compile-checked for.
TARGETS = ("gfx90a", "gfx942")
#: threads per wavefront (CDNA).
WARP_SIZE = 64
#: num_warps (wavefronts) a block may have: up to 1024 threads (16 wavefronts of 64); a power of 2.
NUM_WARPS: tuple[int, ...] = (1, 2, 4, 8, 16)
#: GemmConfig fields only AMD has: ``waves_per_eu`` (0 = compiler's choice, up to 8),
#: ``matrix_instr_nonkdim`` (MFMA size: 0 = compiler's choice, 16 or 32), ``kpack`` (1 or 2).
KNOBS: tuple[str, ...] = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


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
    _cfg(256, 256, 64, 4, 8, 2, waves_per_eu=0, matrix_instr_nonkdim=32, kpack=2),
    _cfg(256, 256, 32, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 256, 64, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(256, 128, 64, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(128, 128, 64, 4, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(128, 128, 32, 1, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=32, kpack=1),
    _cfg(128, 64, 64, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 128, 32, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 64, 1, 4, 2, waves_per_eu=4, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 32, 1, 4, 2, waves_per_eu=4, matrix_instr_nonkdim=16, kpack=1),
)

#: the configs autotuning tries for fp32, as GemmConfig fields; the first is the default. Every
#: entry fits 64 KiB of LDS in fp32 and at most 256 VGPRs (``waves_per_eu`` 2 to 4).
SPACE_FP32: tuple[dict[str, int], ...] = (
    _cfg(256, 128, 32, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 256, 32, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(256, 256, 16, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 128, 64, 4, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(128, 128, 32, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 128, 32, 1, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=32, kpack=1),
    _cfg(128, 128, 32, 4, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 64, 64, 8, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 128, 32, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 64, 32, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 64, 1, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 32, 1, 4, 2, waves_per_eu=4, matrix_instr_nonkdim=16, kpack=1),
)

#: the space of each dtype, by its short name.
SPACES: dict[str, tuple[dict[str, int], ...]] = {"bf16": SPACE, "fp16": SPACE, "fp32": SPACE_FP32}

#: entries that spill on one chip in one form, dropped there by
#: :func:`~cokit.triton_kernels.gemm_config.prune_configs`: (target, dtypes, persistent,
#: entry). 128x128x64 at 4 warps in fp32 uses 252 to 256 VGPRs tiled; the persistent loop's
#: extra state spills 24 to 26 VGPRs (triton 3.9 and 3.6.0).
SPILLS: tuple[tuple[str, tuple[str, ...], bool, dict[str, int]], ...] = (
    (
        "gfx942",
        ("fp32",),
        True,
        _cfg(128, 128, 64, 4, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    ),
)
