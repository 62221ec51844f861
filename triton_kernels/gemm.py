"""GEMM with a controllable resource footprint: ``C = A @ B (+ bias)``.

Liger-Kernel layout: the Triton kernels, the launcher (:func:`gemm`: shapes, strides, grid,
config choice), the pure-torch reference (:func:`gemm_reference`) and the ops: the
``cokit::matmul`` ``torch.library.triton_op`` (:func:`matmul`, autograd through the same
kernel; :func:`gemm_in_graph` launches the kernel through ``wrap_triton`` on a GPU, so
Inductor compiles it into its graph) and the opaque ``cokit::gemm_launch`` for what
Inductor cannot launch (CPU, occupancy-shaped configs).

Two forms from one tile routine:

* tiled      -- one program per ``BLOCK_M x BLOCK_N`` output tile, grouped ordering;
* persistent -- ``num_sms`` programs loop over the tiles, so SMs/CUs can be left free for a
  communication kernel (SM carve-out, docs/design.md §1.2).

fp16, bf16 and fp32 inputs (fp32 with ``precision='tf32'`` or ``'ieee'``), any M, N, K
(masked edges), any strides (transposed operands need no copy), fp32 accumulation; the
output has the input dtype. ``GemmConfig.smem_bytes`` launches the same compiled code with a
larger per-block shared-memory reservation (:func:`cokit.triton_kernels.shaped_launch.with_shared_memory`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from .backend import (
    ArchLimits,
    arch_limits,
    cached_device_limits,
    cached_device_name,
    device_index,
    kernel_path,
)
from .gemm_config import (
    GemmConfig,
    config_space,
    interpreter_config,
    parse_config_spec,
    parse_dtype,
    prune_configs,
)
from .tuning_cache import TuningCache, autotune, bench_gpu

__all__ = [
    "PRECISIONS",
    "compile_gemm",
    "gemm",
    "gemm_in_graph",
    "gemm_occupancy",
    "gemm_reference",
    "matmul",
    "select_config",
    "warmup_gemm",
]

#: fp32 dot precisions: 'ieee' (exact fp32 products) or 'tf32' (NVIDIA tensor cores).
PRECISIONS = ("ieee", "tf32")


# ---------------------------------------------------------------------- kernels
@triton.jit
def _gemm_tile(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_bias,
    tile_id,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Compute output tile ``tile_id`` of ``C = A @ B (+ bias)`` and store it.

    The routine both kernels share (inlined). ``tile_id`` (int32, ``0 <= tile_id <
    cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)``) is mapped to tile coordinates ``(pid_m, pid_n)``
    by grouped ordering (``GROUP_M``); the tile's K loop accumulates in fp32, then adds the
    bias and stores the masked tile in C's dtype. Every other argument is as documented on
    :func:`_gemm_kernel`.
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_in_group
    first_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile_id % num_in_group) % group_size_m)
    pid_n = (tile_id % num_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge are clamped (wrapped) instead of masked: loads stay in
    # bounds and unmasked along M/N; the store below is masked.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # interpreter: bf16 dot is wrong there, fp32 is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_bias,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Tiled GEMM, ``C = A @ B (+ bias)``: one program per output tile.

    Grid: ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)``. Program ``i`` computes output tile
    ``i`` in grouped ordering (see ``GROUP_M``): a ``BLOCK_M x BLOCK_N`` block of C, from
    ``cdiv(K, BLOCK_K)`` steps of ``tl.dot`` into an fp32 accumulator. Launch options:
    ``num_warps``, ``num_stages`` and the vendor knobs of :class:`GemmConfig`
    (``maxnreg``; ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``).

    Pointers (all one dtype: fp16, bf16 or fp32; any layout, strides in elements):

    * ``a_ptr`` -- A, ``M x K``; element ``(m, k)`` at ``a_ptr + m*stride_am + k*stride_ak``
      (row-major: ``stride_ak == 1``; a transposed view: ``stride_am == 1``).
    * ``b_ptr`` -- B, ``K x N``; element ``(k, n)`` at ``b_ptr + k*stride_bk + n*stride_bn``.
    * ``c_ptr`` -- C, ``M x N``, written (masked to the matrix) at
      ``c_ptr + m*stride_cm + n*stride_cn``; the fp32 accumulator is cast to C's element type.
    * ``bias_ptr`` -- bias, ``N`` elements at ``bias_ptr + n*stride_bias``, added to every row
      (in fp32) when ``HAS_BIAS``; otherwise any valid pointer, never read (the launcher
      passes ``a_ptr``, so that under ``torch.compile`` the written C is never also an
      argument read by the same launch).

    Scalars (int32; the launcher handles empty problems and never launches them):

    * ``M``, ``N``, ``K`` -- problem sizes, each >= 1; M and N need not be multiples of the
      blocks (edge rows/columns are clamped for loads and masked for stores), nor K (see
      ``EVEN_K``).
    * ``stride_am``, ``stride_ak`` -- A's strides along M and K (elements, >= 0).
    * ``stride_bk``, ``stride_bn`` -- B's strides along K and N.
    * ``stride_cm``, ``stride_cn`` -- C's strides along M and N; C must not overlap A or B.
    * ``stride_bias`` -- bias's element stride (ignored without ``HAS_BIAS``).
      Row offsets are computed in int64, so ``M * stride_am`` etc. may exceed 2**31.

    Constexprs (each distinct value compiles a separate kernel):

    * ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` -- tile sizes: powers of 2 from 16 to 256
      (``tl.arange`` needs powers of 2, ``tl.dot`` needs >= 16); one program holds a
      ``BLOCK_M x BLOCK_N`` fp32 accumulator and loads ``BLOCK_M x BLOCK_K`` and
      ``BLOCK_K x BLOCK_N`` operand tiles per step (shared memory: ``num_stages`` of them).
    * ``GROUP_M`` -- grouped ordering (>= 1): consecutive tile ids walk ``GROUP_M`` tile rows
      down a tile column before moving right, so programs running together share B columns
      and A rows in L2. 1 = row-major tile order.
    * ``HAS_BIAS`` -- add ``bias[n]`` to column ``n``.
    * ``EVEN_K`` -- ``K % BLOCK_K == 0``: the K loop loads without masks; when False the
      last K step is masked (zeros past K).
    * ``UPCAST`` -- convert the loaded tiles to fp32 before ``tl.dot``. Set only under the
      Triton interpreter for bf16 (its bf16 dot is wrong); False on GPUs.
    * ``INPUT_PRECISION`` -- ``tl.dot``'s ``input_precision``: 'ieee' (exact fp32 products)
      or 'tf32' (NVIDIA tensor cores, 10-bit mantissa inputs). Only changes fp32 operands;
      the launcher passes 'ieee' for 16-bit ones. 'tf32' is not available on AMD.
    """
    _gemm_tile(
        a_ptr,
        b_ptr,
        c_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_bias,
        tl.program_id(0),
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        GROUP_M,
        HAS_BIAS,
        EVEN_K,
        UPCAST,
        INPUT_PRECISION,
    )


@triton.jit
def _gemm_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_bias,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Persistent GEMM, ``C = A @ B (+ bias)``: a fixed number of programs loop over the tiles.

    Grid: ``(P,)`` with ``P = min(num_sms, number of tiles)`` (``GemmConfig.num_sms``; by
    default every SM/CU). Program ``p`` computes tiles ``p, p + P, p + 2P, ...`` (tile ids in
    grouped ordering), so only ``P`` SMs/CUs are occupied and the rest stay free for a
    communication kernel (SM carve-out). Launch options as for :func:`_gemm_kernel`.

    Arguments: the same as :func:`_gemm_kernel` (pointers, scalars, strides and constexprs),
    with the same meaning and constraints; see its docstring.
    """
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        _gemm_tile(
            a_ptr,
            b_ptr,
            c_ptr,
            bias_ptr,
            M,
            N,
            K,
            stride_am,
            stride_ak,
            stride_bk,
            stride_bn,
            stride_cm,
            stride_cn,
            stride_bias,
            tile_id,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
            HAS_BIAS,
            EVEN_K,
            UPCAST,
            INPUT_PRECISION,
        )


# ---------------------------------------------------------------------- reference
def gemm_reference(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, precision: str = "ieee"
) -> torch.Tensor:
    """Pure-torch GEMM with the kernel's semantics: fp32 accumulation, output in a's dtype."""
    del precision  # the reference computes in full fp32
    out = a.float() @ b.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(a.dtype)


# ---------------------------------------------------------------------- launcher
def _check_inputs(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, precision: str) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (got shape {tuple(t.shape)})")
    parse_dtype(a.dtype)
    if b.dtype != a.dtype:
        raise ValueError(f"a and b must have the same dtype (got {a.dtype} and {b.dtype})")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device (got {a.device} and {b.device})")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (b.shape[1],):
            raise ValueError(f"bias must have shape ({b.shape[1]},) (got {tuple(bias.shape)})")
        if bias.dtype != a.dtype or bias.device != a.device:
            raise ValueError(
                f"bias must have a's dtype and device ({a.dtype}, {a.device}); got {bias.dtype}, {bias.device}"
            )
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")


def _limits_for(path: str, device: torch.device) -> ArchLimits | None:
    if path not in ("cuda", "hip"):
        return None
    return cached_device_limits(device)


def _size_hint(size: int | torch.SymInt) -> int:
    """A size as an int; a symbolic one by its hint, adding no guard (torch 2.13 calls the
    function ``optimization_hint``, earlier versions ``hint_int``)."""
    if not isinstance(size, torch.SymInt):
        return size
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int  # type: ignore[attr-defined]
    return int(hint(size, fallback=4096))


def select_config(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    persistent: bool = False,
    precision: str = "ieee",
    cache_dir: str | os.PathLike | None = None,
    tune: bool = True,
    bias: torch.Tensor | None = None,
) -> GemmConfig:
    """The config :func:`gemm` uses when none is given.

    Interpreter: a fixed config of large tiles (deterministic). GPU: the winner cached for
    (device, dtype, form, precision, shape bucket); on a miss, the backend's config space
    pruned by shared memory is timed (``tune=True``, result stored) or its first config used
    (``tune=False``: nothing is timed). Symbolic sizes (``torch.compile(dynamic=True)``)
    choose by their hints, without a guard: the choice changes speed, never the result.
    """
    M, K = (_size_hint(d) for d in a.shape)
    N = _size_hint(b.shape[1])
    path = kernel_path(a.device)
    if path not in ("cuda", "hip"):
        return interpreter_config(M, N, K, persistent)
    limits = _limits_for(path, a.device)
    assert limits is not None  # a GPU path has limits
    configs = prune_configs(config_space(path, persistent, a.dtype), a.dtype, limits, M, N, K, precision)
    if not configs:
        raise RuntimeError(f"no GEMM config fits {limits.name} for {a.dtype}")
    cache = TuningCache(cache_dir)
    key = TuningCache.key(cached_device_name(device_index(a.device)), a.dtype, M, N, K, persistent, precision)
    if not tune:
        return cache.load(key) or configs[0]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if cache.load(key) is None:
        _precompile(a, b, bias, out, configs, precision, path, limits)
    best, _ = autotune(
        configs,
        lambda cfg: _launch(a, b, bias, out, cfg, precision, path, limits),
        bench_gpu,
        cache=cache,
        key=key,
    )
    return best


def _prepare(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    cfg: GemmConfig,
    precision: str,
    path: str,
    limits: ArchLimits | None,
) -> tuple[Any, tuple[int], dict[str, Any], dict[str, Any]]:
    """(kernel, grid, kernel arguments by name, launch options) of one launch."""
    M, K = a.shape
    N = b.shape[1]
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    args: dict[str, Any] = dict(
        a_ptr=a,
        b_ptr=b,
        c_ptr=c,
        bias_ptr=bias if bias is not None else a,
        M=M,
        N=N,
        K=K,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        stride_bias=bias.stride(0) if bias is not None else 0,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M,
        HAS_BIAS=bias is not None,
        EVEN_K=bool(K % cfg.BLOCK_K == 0),  # a constexpr: a guard when K is symbolic
        UPCAST=path == "interpreter" and a.dtype == torch.bfloat16,
        # precision only matters for fp32 operands; one spelling for 16-bit avoids recompiles
        INPUT_PRECISION=precision if a.dtype == torch.float32 else "ieee",
    )
    if cfg.persistent:
        sms = cfg.num_sms or (limits.num_sms if limits is not None else 2)
        programs = torch.sym_min(sms, tiles)  # no guard when tiles is symbolic
        kernel = _gemm_persistent_kernel
    else:
        programs = tiles
        kernel = _gemm_kernel
    opts = cfg.launch_options(path) if path in ("cuda", "hip") else {}
    return kernel, (programs,), args, opts


def _precompile(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    configs: list[GemmConfig],
    precision: str,
    path: str,
    limits: ArchLimits | None,
) -> None:
    """Compile tuning candidates in parallel threads (Triton's AsyncCompileMode) so timing
    them later hits the JIT cache. Best effort: a failure here only costs time later."""
    async_mode = getattr(triton, "AsyncCompileMode", None)
    if async_mode is None or len(configs) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        workers = min(len(configs), os.cpu_count() or 1, 16)
        with ThreadPoolExecutor(max_workers=workers) as pool, async_mode(pool, ignore_errors=True):
            for cfg in configs:
                kernel, grid, args, opts = _prepare(a, b, bias, c, cfg, precision, path, limits)
                kernel.warmup(**args, **opts, grid=grid)
    except Exception:  # tuning compiles again on demand
        pass


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    cfg: GemmConfig,
    precision: str,
    path: str,
    limits: ArchLimits | None,
) -> None:
    kernel, grid, args, opts = _prepare(a, b, bias, c, cfg, precision, path, limits)
    if cfg.smem_bytes is None or path == "interpreter":
        kernel[grid](**args, **opts)
        return
    from .shaped_launch import launch_shaped

    launch_shaped(kernel, grid, args, opts, cfg.smem_bytes, limits, device_index(a.device))


def warmup_gemm(
    config: GemmConfig,
    dtype: torch.dtype | str,
    M: int = 4096,
    N: int = 4096,
    K: int = 4096,
    *,
    precision: str = "ieee",
    device: torch.device | str | None = None,
) -> Any:
    """Compile (without running) the GEMM for ``config`` on the live GPU; returns Triton's
    ``CompiledKernel`` (``smem_bytes`` not applied; see ``shaped_launch.with_shared_memory``)."""
    dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    path = kernel_path(device)
    if path not in ("cuda", "hip"):
        raise RuntimeError(f"warmup_gemm needs a GPU (tensors on {device} run on the {path} path)")
    limits = cached_device_limits(device)
    config.validate(path, limits)
    a = torch.empty((M, K), dtype=dtype, device=device)
    b = torch.empty((K, N), dtype=dtype, device=device)
    c = torch.empty((M, N), dtype=dtype, device=device)
    kernel, grid, args, opts = _prepare(a, b, None, c, config, precision, path, limits)
    return kernel.warmup(**args, **opts, grid=grid)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    precision: str = "ieee",
    persistent: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    tune: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D fp16/bf16/fp32 tensors of any shape and strides.

    ``config`` fixes every knob (validated against the device); without it the tuned config
    is used (:func:`select_config`; ``persistent`` picks the form, ``cache_dir`` the tuning
    cache, default ``$COKIT_CACHE_DIR``). ``precision`` ('ieee' or 'tf32') applies to fp32
    inputs; 'tf32' needs NVIDIA. CPU tensors run the interpreter (``TRITON_INTERPRET=1``) or
    the torch reference.
    """
    path = _check_call(a, b, bias, config, precision, persistent)
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(
            f"out must be a {M}x{N} {a.dtype} tensor on {a.device}; got {tuple(out.shape)} {out.dtype} {out.device}"
        )
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.copy_(bias.expand(M, N) if bias is not None else torch.zeros((), dtype=a.dtype))
        return out
    if path == "torch":
        if config is not None:
            config.validate("interpreter", dtype=a.dtype)
        out.copy_(gemm_reference(a, b, bias, precision))
        return out
    limits, config = _resolve_config(a, b, bias, config, precision, persistent, path, cache_dir, tune)
    _launch(a, b, bias, out, config, precision, path, limits)
    return out


def _check_call(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None,
    precision: str,
    persistent: bool | None,
) -> str:
    """Check one GEMM call's arguments (before any work); returns its :func:`kernel_path`."""
    _check_inputs(a, b, bias, precision)
    path = kernel_path(a.device)
    if path == "hip" and precision == "tf32" and a.dtype == torch.float32:
        raise ValueError("precision='tf32' is not available on AMD GPUs in Triton; allowed there: 'ieee'")
    if config is not None and persistent is not None and persistent != config.persistent:
        raise ValueError(
            f"persistent={persistent} contradicts config.persistent={config.persistent}; pass one of them"
        )
    return path


def _resolve_config(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None,
    precision: str,
    persistent: bool | None,
    path: str,
    cache_dir: str | os.PathLike | None,
    tune: bool,
) -> tuple[ArchLimits | None, GemmConfig]:
    """The device limits and the config of a launch: ``config`` validated, or the tuned one."""
    limits = _limits_for(path, a.device)
    if config is None:
        config = select_config(
            a, b, persistent=bool(persistent), precision=precision, cache_dir=cache_dir, tune=tune, bias=bias
        )
    else:
        # On a GPU the exact need is checked against the compiled kernel in with_shared_memory.
        config.validate(path, limits, dtype=a.dtype, precision=precision)
    return limits, config


# ---------------------------------------------------------------------- compile-only
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_gemm(
    config: GemmConfig,
    dtype: torch.dtype | str,
    target: str,
    *,
    precision: str = "ieee",
    has_bias: bool = False,
    even_k: bool = True,
    aligned: bool = True,
    extra_options: dict[str, Any] | None = None,
):
    """Compile the GEMM for a named target ('sm_80', 'sm_90', 'gfx90a', 'gfx942') without a GPU.

    Returns :class:`cokit.triton_kernels.compile_only.CompiledKernel` (shared bytes, registers,
    spills, and the Triton kernel object in ``.compiled``). ``config.smem_bytes`` is not applied
    here: pass the result to :func:`cokit.triton_kernels.shaped_launch.with_shared_memory`. The build is
    specialized as the JIT does on a GPU: 16-byte aligned pointers, unit inner strides and,
    with ``aligned``, M/N/K and row strides divisible by 16. ``extra_options`` are passed to
    the compiler as is (e.g. ``min_shared_mem`` on CUDA). Needs a process without
    ``TRITON_INTERPRET``.
    """
    from .compile_only import compile_for_target

    dtype = parse_dtype(dtype)
    limits = arch_limits(target)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
    if limits.backend == "hip" and precision == "tf32" and dtype == torch.float32:
        raise ValueError("precision='tf32' is not available on AMD GPUs in Triton; allowed there: 'ieee'")
    config.validate(limits.backend, limits, dtype=dtype, precision=precision)
    ptr = "*" + _TRITON_DTYPE[dtype]
    kernel = _gemm_persistent_kernel if config.persistent else _gemm_kernel
    signature: dict[str, str] = {
        "a_ptr": ptr,
        "b_ptr": ptr,
        "c_ptr": ptr,
        "bias_ptr": ptr,
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_am": "i32",
        "stride_ak": "constexpr",
        "stride_bk": "i32",
        "stride_bn": "constexpr",
        "stride_cm": "i32",
        "stride_cn": "constexpr",
        "stride_bias": "constexpr",
    }
    constexprs: dict[str, Any] = dict(
        stride_ak=1,
        stride_bn=1,
        stride_cn=1,
        stride_bias=1,
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        GROUP_M=config.GROUP_M,
        HAS_BIAS=has_bias,
        EVEN_K=even_k,
        UPCAST=False,
        INPUT_PRECISION=precision if dtype == torch.float32 else "ieee",
    )
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = _specialization_attrs(kernel, signature, limits.backend, aligned)
    options = {**config.launch_options(limits.backend), **(extra_options or {})}
    return compile_for_target(kernel, signature, constexprs, target, attrs=attrs, **options)


def gemm_occupancy(
    config: GemmConfig,
    target: str | None = None,
    dtype: torch.dtype | str = "bf16",
    *,
    precision: str = "ieee",
) -> tuple[Any, Any, int]:
    """Compile the GEMM for ``config`` and compute its occupancy, ``smem_bytes`` applied.

    ``target`` names a chip ('sm_80', 'sm_90', 'gfx90a', 'gfx942'; compile-only, needs a
    process without ``TRITON_INTERPRET``); ``None`` means the live GPU. Returns the
    :class:`~cokit.triton_kernels.occupancy.Occupancy`, the compiled kernel (a
    :class:`~cokit.triton_kernels.compile_only.CompiledKernel` for a named target, a Triton
    ``CompiledKernel`` on the live GPU; launch footprint ``smem_bytes``) and the shared memory
    the kernel itself uses.
    """
    from .backend import device_limits
    from .occupancy import kernel_occupancy
    from .shaped_launch import triton_compiled, with_shared_memory

    if target is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no GPU here: name a target (sm_80, sm_90, gfx90a, gfx942)")
        limits = device_limits()
        built = warmup_gemm(config.replace(smem_bytes=None), dtype, precision=precision)
    else:
        limits = arch_limits(target)
        built = compile_gemm(config.replace(smem_bytes=None), dtype, target, precision=precision)
    used = int(triton_compiled(built).metadata.shared)
    if config.smem_bytes is not None:
        built = with_shared_memory(built, config.smem_bytes, limits)
    return kernel_occupancy(built, limits), built, used


def _specialization_attrs(
    kernel: Any, signature: dict[str, str], backend: str, aligned: bool
) -> dict[tuple[int, ...], list]:
    """What the JIT would specialize on a GPU: aligned pointers in buffers under 2 GB
    (:func:`~cokit.triton_kernels.compile_only.pointer_attrs`) and, when ``aligned``, M, N, K
    and row strides divisible by 16."""
    from .compile_only import pointer_attrs

    attrs = pointer_attrs(kernel, signature, backend)
    for name in ("M", "N", "K", "stride_am", "stride_bk", "stride_cm") if aligned else ():
        attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    return attrs


# ---------------------------------------------------------------------- ops
def _config_from_spec(spec: str) -> GemmConfig | None:
    return parse_config_spec(spec) if spec else None


@torch.library.custom_op("cokit::gemm_launch", mutates_args=())
def _gemm_launch_op(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    config: str,
    precision: str,
    persistent: bool,
) -> torch.Tensor:
    """``cokit::gemm_launch``: :func:`gemm` as an opaque op (``torch.compile`` calls it as is).

    The GEMM ops' launch where Inductor cannot launch the kernel itself: CPU tensors (the
    interpreter or the torch reference), empty problems, occupancy-shaped configs
    (``smem_bytes``: a compiled kernel launched with a resized shared-memory reservation) and
    configs with launch knobs other than ``num_warps``/``num_stages`` (``maxnreg``, AMD's
    ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``). ``config`` is a
    :meth:`GemmConfig.spec` string or ``''`` (the tuned config; ``persistent`` picks the form).
    """
    cfg = _config_from_spec(config)
    return gemm(a, b, bias, config=cfg, precision=precision, persistent=None if cfg else persistent)


@_gemm_launch_op.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    config: str,
    precision: str,
    persistent: bool,
) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "cokit GEMM: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "cokit GEMM: a.shape[1] must equal b.shape[0]")
    return a.new_empty((a.shape[0], b.shape[1]))


#: launch options a user-defined Triton kernel keeps under Inductor (as its triton.Config's)
_INDUCTOR_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages"})


def gemm_in_graph(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    config: str,
    precision: str,
    persistent: bool,
) -> torch.Tensor:
    """``a @ b (+ bias)`` as the body of the ``torch.library.triton_op`` GEMM ops
    (``cokit::matmul``, ``cokit::linear``), so that ``torch.compile`` sees the kernel.

    On a GPU the tiled or persistent kernel is launched through ``wrap_triton``: Inductor
    puts it into its graph as a user-defined Triton kernel (its own wrapper code, no opaque
    call). The config is ``config`` (a :meth:`GemmConfig.spec` string) or, for ``''``, the
    tuned one; while ``torch.compile`` traces (fake tensors) nothing can be timed, so the
    tuning cache's winner for the traced shape is used, else the space's first config; run
    the op once outside ``torch.compile`` for a shape to tune it. Everything else runs the
    opaque ``cokit::gemm_launch`` (see there), with the same result.
    """
    cfg = _config_from_spec(config)
    form = None if cfg is not None else persistent
    path = kernel_path(a.device)
    if path not in ("cuda", "hip"):
        return _gemm_launch_op(a, b, bias, config, precision, persistent)
    _check_call(a, b, bias, cfg, precision, form)
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return _gemm_launch_op(a, b, bias, config, precision, persistent)
    from torch._subclasses.fake_tensor import is_fake

    limits, cfg = _resolve_config(a, b, bias, cfg, precision, form, path, None, not is_fake(a))
    if cfg.smem_bytes is not None or not set(cfg.launch_options(path)) <= _INDUCTOR_LAUNCH_OPTIONS:
        return _gemm_launch_op(a, b, bias, cfg.spec(), precision, cfg.persistent)
    out = a.new_empty((M, N))
    kernel, grid, args, opts = _prepare(a, b, bias, out, cfg, precision, path, limits)
    torch.library.wrap_triton(kernel)[grid](**args, **opts)
    return out


@torch.library.triton_op("cokit::matmul", mutates_args=())
def _matmul_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, precision: str, persistent: bool
) -> torch.Tensor:
    """``cokit::matmul``: ``a @ b (+ bias)`` with the tuned config (:func:`gemm_in_graph`)."""
    return gemm_in_graph(a, b, bias, "", precision, persistent)


def _matmul_setup(ctx, inputs, output) -> None:
    a, b, bias, precision, persistent = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None
    ctx.precision = precision
    ctx.persistent = persistent


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_a = _matmul_op(grad, b.t(), None, ctx.precision, ctx.persistent)  # dA = dC B^T
    if ctx.needs_input_grad[1]:
        grad_b = _matmul_op(a.t(), grad, None, ctx.precision, ctx.persistent)  # dB = A^T dC
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.float().sum(0).to(grad.dtype)
    return grad_a, grad_b, grad_bias, None, None


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    precision: str = "ieee",
    persistent: bool = False,
) -> torch.Tensor:
    """``cokit::matmul``: differentiable, ``torch.compile``-able ``a @ b (+ bias)``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
    return _matmul_op(a, b, bias, precision, bool(persistent))
