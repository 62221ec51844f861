"""AMD (HIP/ROCm) GEMM configuration: the autotuning space and the vendor's knobs and limits.

A leaf module (it imports nothing of cokit), like the per-vendor ``opt_flags_amd`` of
Triton's own ``triton_kernels``: :func:`cokit.triton_kernels.gemm_config.config_space`
turns :data:`SPACE` into :class:`~cokit.triton_kernels.gemm_config.GemmConfig` objects and
:meth:`GemmConfig.validate` reads :data:`NUM_WARPS` and :data:`KNOBS`.

Targets: gfx90a (MI250X) and gfx942 (MI300). The space is Triton's AMD matmul space: the
stream pipeliner's ``num_stages=2``, with ``waves_per_eu`` (occupancy hint), MFMA 16x16 or
32x32 instructions (``matrix_instr_nonkdim``) and ``kpack`` choices. Its first entry is the
default (the one used without tuning when it fits). Shared memory (LDS) is 64 KiB per block,
so fp32 entries with large tiles are pruned at selection time
(:func:`~cokit.triton_kernels.gemm_config.prune_configs`).
"""

from __future__ import annotations

__all__ = ["BACKEND", "KNOBS", "NUM_WARPS", "SPACE", "TARGETS", "WARP_SIZE"]

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


#: the configs autotuning tries, as GemmConfig fields; the first is the default.
SPACE: tuple[dict[str, int], ...] = (
    _cfg(256, 256, 64, 4, 8, 2, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=2),
    _cfg(256, 256, 32, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    _cfg(128, 256, 64, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(256, 128, 64, 4, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(128, 128, 64, 4, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2),
    _cfg(128, 128, 32, 1, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=32, kpack=1),
    _cfg(128, 64, 64, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 128, 32, 8, 4, 2, waves_per_eu=3, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 64, 1, 4, 2, waves_per_eu=4, matrix_instr_nonkdim=16, kpack=1),
    _cfg(64, 64, 32, 1, 4, 2, waves_per_eu=8, matrix_instr_nonkdim=16, kpack=1),
)
