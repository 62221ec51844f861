"""Launch configurations of the compression kernels: the knobs, their validation, resource
estimates, the per-backend spaces and the tuned choice on a GPU.

A :class:`KernelConfig` is what one launch of a DCT or error-feedback kernel may vary:
``num_warps``, ``num_stages`` and the ``tl.dot`` input precision (the kernels' constexpr
``DOT_PRECISION``). The per-vendor spaces live in the leaf modules
:mod:`~cokit.triton_kernels.compress_configs_nvidia` (``"tf32x3"``: fp32-class accuracy on
tensor cores) and :mod:`~cokit.triton_kernels.compress_configs_amd` (``"ieee"``: native fp32
MFMA). :func:`select_config` picks a config per launch class: the interpreter's fixed one,
else the winner autotuned once per (device, kernel, mode, block) and kept in the GEMM's JSON
tuning cache (:mod:`~cokit.triton_kernels.tuning_cache`), else the space's default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from . import compress_configs_amd as _amd
from . import compress_configs_nvidia as _nvidia
from . import tiling
from .backend import (
    ArchLimits,
    arch_limits,
    cached_device_limits,
    cached_device_name,
    device_index,
    kernel_path,
)

__all__ = [
    "KERNELS",
    "KernelConfig",
    "cache_key",
    "check_fits",
    "config_space",
    "estimate_registers",
    "estimate_shared_bytes",
    "interpreter_config",
    "select_config",
    "selected_configs",
    "validate_entry",
]

#: the compression kernels that take a :class:`KernelConfig`.
KERNELS = ("dct_encode", "dct_decode", "ef_encode", "ef_decode")

_VENDORS: dict[str, ModuleType] = {_nvidia.BACKEND: _nvidia, _amd.BACKEND: _amd}
#: every precision some backend accepts (what a stored or hand-written config may name).
_ALL_PRECISIONS = tuple(dict.fromkeys(_nvidia.DOT_PRECISIONS + _amd.DOT_PRECISIONS))
_ALL_WARPS = tuple(sorted(set(_nvidia.NUM_WARPS) | set(_amd.NUM_WARPS)))
_MAX_STAGES = 8
#: registers a kernel needs besides its blocks (addresses, loop state, geometry scalars).
_BASE_REGISTERS = 32


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown compression kernel {kernel!r}; allowed: {', '.join(KERNELS)}")


def _vendor(backend: str) -> ModuleType:
    try:
        return _VENDORS[backend]
    except KeyError:
        raise ValueError(f"backend {backend!r} has no compression configs; allowed: cuda, hip") from None


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    try:
        rows, width = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block must be (BLOCK_ROWS, BLOCK_W), got {block!r}") from None
    for name, v in (("BLOCK_ROWS", rows), ("BLOCK_W", width)):
        if v < tiling.MIN_BLOCK or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= {tiling.MIN_BLOCK} (tl.dot)")
    return rows, width


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of one compression kernel.

    ``dot_precision`` is the ``tl.dot`` input precision every dot of the kernel uses (its
    ``DOT_PRECISION`` constexpr). Construction checks types and the union of both vendors'
    rules; :func:`check_fits` checks one device.
    """

    num_warps: int
    num_stages: int
    dot_precision: str

    def __post_init__(self) -> None:
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name}={v!r} has the wrong type; expected an int")
        if self.num_warps not in _ALL_WARPS:
            raise ValueError(
                f"num_warps={self.num_warps} is invalid; allowed: {', '.join(map(str, _ALL_WARPS))}"
            )
        if not 1 <= self.num_stages <= _MAX_STAGES:
            raise ValueError(f"num_stages={self.num_stages} is invalid; allowed: 1..{_MAX_STAGES}")
        if self.dot_precision not in _ALL_PRECISIONS:
            raise ValueError(
                f"dot_precision={self.dot_precision!r} is invalid; allowed: {', '.join(_ALL_PRECISIONS)}"
            )

    def launch_options(self) -> dict[str, int]:
        """The Triton launch options of this config (``num_warps``, ``num_stages``)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelConfig:
        """The config of ``d`` (exactly the three fields), or ``ValueError`` saying what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a KernelConfig must be an object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown KernelConfig field(s) {', '.join(map(str, unknown))}")
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"config lacks {', '.join(missing)}")
        return cls(**d)

    def spec(self) -> str:
        """Short label, e.g. ``"w4s1-tf32x3"``."""
        return f"w{self.num_warps}s{self.num_stages}-{self.dot_precision}"


# ---------------------------------------------------------------------- resource estimates
def estimate_registers(kernel: str, config: KernelConfig, block: tuple[int, int], warp_size: int) -> int:
    """32-bit registers per thread one launch of ``kernel`` needs for a ``block``: the fp32
    values per element it holds at its peak (vendor ``LIVE_FP32``, fitted to compile-only
    builds) times the block's elements per thread, plus a fixed base."""
    _check_kernel(kernel)
    rows, width = _check_block(block)
    live = _nvidia.LIVE_FP32[kernel] if warp_size == _nvidia.WARP_SIZE else _amd.LIVE_FP32[kernel]
    per_thread = math.ceil(rows * width / (config.num_warps * warp_size))
    return live * per_thread + _BASE_REGISTERS


def estimate_shared_bytes(kernel: str, block: tuple[int, int], backend: str) -> int:
    """Shared memory (LDS) one block of ``kernel`` uses on ``backend``, in bytes: the layout
    conversions around the dots stage up to the vendor's ``SHARED_FP32_BLOCKS[kernel]`` fp32
    blocks of ``max(BLOCK_ROWS, BLOCK_W) x BLOCK_W`` at once (an upper bound of every
    compile-only build, tests/test_compile_targets.py)."""
    _check_kernel(kernel)
    rows, width = _check_block(block)
    return 4 * _vendor(backend).SHARED_FP32_BLOCKS[kernel] * max(rows, width) * width


def check_fits(kernel: str, config: KernelConfig, block: tuple[int, int], limits: ArchLimits) -> None:
    """Raise ``ValueError`` naming the limit ``config`` breaks for ``block`` on ``limits``
    (threads, warps, dot precision, shared memory, registers); checked before any launch."""
    _check_kernel(kernel)
    rows, width = _check_block(block)
    vendor = _vendor(limits.backend)
    where = f"{kernel} {config.spec()} for a {rows}x{width} block on {limits.name}"
    if config.num_warps not in vendor.NUM_WARPS:
        raise ValueError(
            f"{where}: num_warps={config.num_warps} is not allowed on {limits.backend}; "
            f"allowed: {', '.join(map(str, vendor.NUM_WARPS))}"
        )
    threads = config.num_warps * limits.warp_size
    if threads > limits.max_threads_per_block:
        raise ValueError(
            f"{where}: {threads} threads per block exceed the limit of {limits.max_threads_per_block}; "
            "use fewer warps"
        )
    if config.dot_precision not in vendor.DOT_PRECISIONS:
        raise ValueError(
            f"{where}: dot_precision={config.dot_precision!r} does not compile on {limits.backend}; "
            f"allowed: {', '.join(vendor.DOT_PRECISIONS)}"
        )
    shared = estimate_shared_bytes(kernel, (rows, width), limits.backend)
    if shared > limits.max_shared_per_block:
        raise ValueError(
            f"{where}: needs about {shared} B of shared memory per block; the limit is "
            f"{limits.max_shared_per_block} B (use a smaller chunk)"
        )
    regs = estimate_registers(kernel, config, (rows, width), limits.warp_size)
    if regs > limits.max_registers_per_thread:
        raise ValueError(
            f"{where}: needs about {regs} registers per thread (it would spill); the limit is "
            f"{limits.max_registers_per_thread}; use more warps"
        )


# ---------------------------------------------------------------------- spaces
def _vendor_limits(backend: str) -> list[ArchLimits]:
    return [arch_limits(t) for t in _vendor(backend).TARGETS]


def _fits_all(kernel: str, cfg: KernelConfig, block: tuple[int, int], limits: list[ArchLimits]) -> bool:
    try:
        for lim in limits:
            check_fits(kernel, cfg, block, lim)
    except ValueError:
        return False
    return True


def config_space(
    kernel: str, backend: str, block: tuple[int, int], arch: int | str | None = None, two_d: bool = True
) -> list[KernelConfig]:
    """Every config that may be launched on ``backend`` ('cuda' / 'hip') for a
    ``(BLOCK_ROWS, BLOCK_W)`` block, in the vendor's order (the first is the default). With
    ``arch`` (80, 90, 'gfx942', ...) it is that chip's space (the vendor's ``space_for``:
    ``"bf16x6"`` before sm_90, where tf32x3 spills), else the vendor's newest chip's;
    ``two_d`` False gives the space of a block of 1-D tiles (the fused kernels' registers
    differ by mode at the same block shape).

    Configs that do not fit every named target of the vendor (:func:`check_fits`: shared
    memory, registers) are pruned. When the vendor's space has none that fits (a large
    block), the space is the smallest larger ``num_warps`` that fits, at the vendor's
    precision; ``ValueError`` when even that does not exist.
    """
    _check_kernel(kernel)
    vendor = _vendor(backend)
    block = _check_block(block)
    limits = _vendor_limits(backend)
    fields_list = vendor.space_for(kernel, arch, two_d)
    space = [KernelConfig(**fields) for fields in fields_list]
    out = [cfg for cfg in space if _fits_all(kernel, cfg, block, limits)]
    if out:
        return out
    most = max(cfg.num_warps for cfg in space)
    for warps in vendor.NUM_WARPS:
        if warps > most:
            cfg = dataclasses.replace(space[0], num_warps=warps)
            if _fits_all(kernel, cfg, block, limits):
                return [cfg]
    raise ValueError(
        f"no {backend} launch config of {kernel} fits a {block[0]}x{block[1]} block "
        f"(shared memory or registers); use a smaller chunk"
    )


@functools.cache
def interpreter_config(kernel: str) -> KernelConfig:
    """The one fixed config under ``TRITON_INTERPRET`` / on CPU: plain fp32 dots (the
    interpreter computes every precision as an fp32 matmul anyway)."""
    _check_kernel(kernel)
    return KernelConfig(num_warps=4, num_stages=1, dot_precision="ieee")


# ---------------------------------------------------------------------- tuning cache entries
def cache_key(kernel: str, device_name: str, block: tuple[int, int], two_d: bool = True) -> str:
    """The tuning-cache key of one (kernel, device, mode, block): ``compress:<kernel>|<device>|
    <2d|1d>|<BLOCK_ROWS>x<BLOCK_W>``."""
    _check_kernel(kernel)
    rows, width = _check_block(block)
    return f"compress:{kernel}|{device_name}|{'2d' if two_d else '1d'}|{rows}x{width}"


def validate_entry(key: str, entry: Any) -> KernelConfig:
    """The config of one stored compression entry, or ``ValueError`` saying what is wrong
    (an object with a ``config`` object of exactly the KernelConfig fields, valid values; the
    key's kernel must be known). ``time_ms`` is checked by the tuning cache."""
    body = key.split(":", 1)[1] if ":" in key else key
    kernel = body.split("|", 1)[0]
    _check_kernel(kernel)
    if not isinstance(entry, dict):
        raise ValueError(f"expected an object, got {type(entry).__name__}")
    raw = entry.get("config")
    if not isinstance(raw, dict):
        raise ValueError("missing 'config' object" if raw is None else "'config' is not an object")
    return KernelConfig.from_dict(raw)


# ---------------------------------------------------------------------- selection
#: choices made in this process, by (cache file, key): (config, whether it was tuned or
#: read from the cache). Launches do not re-read the file; an untuned default is revisited
#: when a later call brings a ``tune`` function.
_SELECTED: dict[tuple[str, str], tuple[KernelConfig, bool]] = {}


def select_config(
    kernel: str,
    block: tuple[int, int],
    device: torch.device,
    tune: Callable[[KernelConfig], Any] | None = None,
    *,
    two_d: bool = True,
    cache_dir: str | os.PathLike | None = None,
    bench: Callable[[Callable[[], Any]], float] | None = None,
    limits: ArchLimits | None = None,
    device_name: str | None = None,
) -> KernelConfig:
    """The config one launch class of ``kernel`` uses on ``device``.

    Interpreter / CPU: :func:`interpreter_config`. GPU: the winner stored in the tuning
    cache for (device, kernel, mode, block) when it is still in the space and fits the
    device (else it is ignored with a warning); on a miss, with ``tune`` (a function that
    launches the real kernel with a config, on scratch data) each config of the space that
    fits is timed and the fastest stored; without ``tune`` the space's default. ``bench``,
    ``limits`` and ``device_name`` replace the GPU timer and the device's limits and name
    (tests run the tuning logic on CPU with them).
    """
    from .tuning_cache import TuningCache, autotune, bench_gpu

    _check_kernel(kernel)
    block = _check_block(block)
    if limits is None:
        if kernel_path(device) not in ("cuda", "hip"):
            return interpreter_config(kernel)
        limits = cached_device_limits(device)
    if device_name is None:
        device_name = cached_device_name(device_index(device))
    cache = TuningCache(cache_dir)
    key = cache_key(kernel, device_name, block, two_d)
    memo = (str(cache.path), key)
    known = _SELECTED.get(memo)
    if known is not None and (known[1] or tune is None):
        return known[0]
    configs = []
    for cfg in config_space(kernel, limits.backend, block, limits.arch, two_d):
        try:
            check_fits(kernel, cfg, block, limits)
        except ValueError:
            continue
        configs.append(cfg)
    if not configs:
        raise RuntimeError(
            f"no launch config of {kernel} fits a {block[0]}x{block[1]} block on {limits.name}"
        )
    hit = cache.load(key)
    if hit is not None and hit not in configs:
        warnings.warn(
            f"cokit: ignoring tuned config {hit.spec()} for {key!r} in {cache.path}: it is not in "
            f"this version's space for {limits.name} ({', '.join(c.spec() for c in configs)})",
            stacklevel=2,
        )
        hit = None
    if hit is not None:
        chosen, settled = hit, True
    elif tune is None:
        chosen, settled = configs[0], False
    else:
        chosen, _ = autotune(configs, tune, bench or bench_gpu, cache=cache, key=key, check_cache=False)
        settled = True
    _SELECTED[memo] = (chosen, settled)
    return chosen


def selected_configs(kernel: str) -> dict[str, str]:
    """What this process chose for ``kernel`` so far: ``{"<2d|1d>|<BLOCK_ROWS>x<BLOCK_W>":
    "<spec>" (+ " (default)" when it was not tuned or read from the cache)}``, for reports
    such as the GPU check's."""
    _check_kernel(kernel)
    out = {}
    for (_, key), (cfg, settled) in _SELECTED.items():
        parts = key.split(":", 1)[1].split("|")
        if parts[0] == kernel:
            out["|".join(parts[2:])] = cfg.spec() + ("" if settled else " (default)")
    return out
