"""NVIDIA (CUDA) GEMM configuration: the autotuning space and the vendor's knobs and limits.

A leaf module (it imports nothing of cokit), like the per-vendor ``opt_flags_nvidia`` of
Triton's own ``triton_kernels``: :func:`cokit.triton_kernels.gemm_config.config_space`
turns :data:`SPACE` into :class:`~cokit.triton_kernels.gemm_config.GemmConfig` objects and
:meth:`GemmConfig.validate` reads :data:`NUM_WARPS` and :data:`KNOBS`.

Targets: sm_80 (A100) and sm_90 (H100/H200). The space is Triton's matmul tutorial space plus
larger-K and 8-warp tiles; its first entry is the default (the one used without tuning when
it fits). Entries whose shared memory does not fit a chip are pruned at selection time
(:func:`~cokit.triton_kernels.gemm_config.prune_configs`), so the space may hold configs
that only fit sm_90's 227 KiB per block.
"""

from __future__ import annotations

__all__ = ["BACKEND", "KNOBS", "NUM_WARPS", "SPACE", "TARGETS", "WARP_SIZE"]

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


#: the configs autotuning tries, as GemmConfig fields; the first is the default.
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
    _cfg(32, 64, 32, 8, 2, 5),
    _cfg(128, 128, 128, 8, 8, 3),
)
