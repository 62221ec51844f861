"""A memory-bound copy on a chosen number of SMs/CUs: the emulated communication side.

On one GPU there is no collective to overlap with; a persistent copy kernel of ``n_sms``
programs looping over a large buffer stands in for a communication kernel (NCCL/RCCL
kernels are memory-bound loops on a few SMs). It lets occupancy effects (shared-memory
shaping, SM carve-out, stream priority) be studied on one GPU. It is an **emulation**:
:mod:`overlap` labels it so wherever it appears.

Layout as in every kernel file: the ``@triton.jit`` kernel, the launcher (:func:`sm_copy`),
and the pure-torch reference (:func:`sm_copy_reference`). No ``torch.library`` op: it is a
benchmark tool, not a training op.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._checks import check_int
from .backend import cached_device_limits, device_index, kernel_path
from .shaped_launch import launch_shaped

__all__ = ["COPY_DTYPES", "compile_specs", "sm_copy", "sm_copy_reference"]

#: dtypes the copy accepts (Triton pointer types of 1 to 8 bytes).
COPY_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)


@triton.jit
def _sm_copy_kernel(src, dst, n, passes, BLOCK: tl.constexpr):
    """Persistent copy of ``n`` elements from ``src`` to ``dst``, ``passes`` times.

    Grid: ``(n_programs,)``, at most one program per SM/CU in use; program ``p`` copies the
    ``BLOCK``-element blocks ``p, p + n_programs, p + 2 * n_programs, ...`` (64-bit offsets),
    then does it again, ``passes`` times in all.

    Args:
        src: flat contiguous buffer of ``n`` elements, any dtype of ``COPY_DTYPES``.
        dst: flat contiguous buffer of ``n`` elements, ``src``'s dtype (not overlapping it).
        n: int64, elements to copy (may exceed 2**31).
        passes: int32 >= 1, times the whole buffer is copied (a longer emulated transfer).
        BLOCK (constexpr): power of 2 >= 16, elements per program per step.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit offsets: buffers over 2**31 elements
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    lanes = tl.arange(0, BLOCK)
    for _ in range(passes):
        for base in range(start, n, step):
            offs = base + lanes
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def compile_specs(target: str) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Compile-only build (collected by :mod:`cokit.triton_kernels.compile_only`): the fp32
    copy with 4096-element steps and 8 warps, as :func:`sm_copy` launches it by default."""
    return [
        (
            "sm_copy",
            _sm_copy_kernel,
            {"src": "*fp32", "dst": "*fp32", "n": "i64", "passes": "i32", "BLOCK": "constexpr"},
            {"BLOCK": 4096},
            {"num_warps": 8},
        )
    ]


def sm_copy_reference(src: torch.Tensor, passes: int = 1) -> torch.Tensor:
    """Pure-torch reference: a copy of ``src`` (``passes`` repeats change nothing but time)."""
    del passes
    return src.clone()


def sm_copy(
    src: torch.Tensor,
    dst: torch.Tensor | None = None,
    *,
    n_sms: int | None = None,
    passes: int = 1,
    block: int | None = None,
    num_warps: int = 8,
    smem_bytes: int | None = None,
) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (new when None) with ``n_sms`` persistent programs.

    ``n_sms`` defaults to every SM/CU of the GPU (2 under the interpreter). ``passes``
    repeats the copy (a longer emulated transfer). ``block`` elements per program step
    (power of 2; default 4096 on a GPU, up to 65536 under the interpreter); ``num_warps``
    per program (default 8: 16 elements per thread per step). ``smem_bytes``
    (GPU only) launches the same code reserving that much shared memory per block, e.g.
    ``occupancy.smem_for_blocks(limits, 1)`` so that each program holds a whole SM and the
    copy occupies exactly ``n_sms`` SMs. CPU tensors without the interpreter use torch.
    """
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype not in COPY_DTYPES:
        raise TypeError(
            f"src has dtype {src.dtype}; allowed: {', '.join(str(d).removeprefix('torch.') for d in COPY_DTYPES)}"
        )
    if not src.is_contiguous():
        raise ValueError("src must be contiguous (the copy walks it as a flat buffer)")
    if dst is None:
        dst = torch.empty_like(src)
    elif (
        dst.shape != src.shape
        or dst.dtype != src.dtype
        or dst.device != src.device
        or not dst.is_contiguous()
    ):
        raise ValueError(
            f"dst must be a contiguous {tuple(src.shape)} {src.dtype} tensor on {src.device}; "
            f"got {tuple(dst.shape)} {dst.dtype} on {dst.device}"
        )
    for name, v in (("passes", passes), ("num_warps", num_warps)):
        check_int(name, v)
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} is invalid; allowed: a power of 2")
    if n_sms is not None:
        check_int("n_sms", n_sms)
    if block is not None and (
        isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1)
    ):
        raise ValueError(f"block={block!r} is invalid; allowed: a power of 2 >= 16")
    n = src.numel()
    path = kernel_path(src.device)
    if smem_bytes is not None and path not in ("cuda", "hip"):
        raise ValueError(
            "smem_bytes applies on a GPU only (the interpreter and torch paths have no shared memory)"
        )
    if n == 0:
        return dst
    if path == "torch":
        for _ in range(passes):
            dst.copy_(src)
        return dst
    gpu = path in ("cuda", "hip")
    limits = cached_device_limits(src.device) if gpu else None
    if n_sms is None:
        n_sms = limits.num_sms if limits is not None else 2
    if limits is not None and n_sms > limits.num_sms:
        raise ValueError(f"n_sms={n_sms} is above the {limits.num_sms} SMs/CUs of {limits.name}")
    if block is None:
        block = 4096 if gpu else min(1 << 16, max(16, triton.next_power_of_2(-(-n // n_sms))))
    grid = (min(n_sms, triton.cdiv(n, block)),)
    opts = {"num_warps": num_warps} if gpu else {}
    if smem_bytes is None:
        _sm_copy_kernel[grid](src, dst, n, passes, BLOCK=block, **opts)
        return dst
    args = {"src": src, "dst": dst, "n": n, "passes": passes, "BLOCK": block}
    launch_shaped(_sm_copy_kernel, grid, args, opts, smem_bytes, limits, device_index(src.device))
    return dst
