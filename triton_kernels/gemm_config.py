"""The GEMM launch configuration: the knobs, their validation, parsing, a shared-memory
estimate used to prune what cannot fit, and the per-backend config spaces.

A :class:`GemmConfig` carries every resource knob of :mod:`cokit.triton_kernels.gemm`:
tile sizes, grouped ordering, warps, pipeline stages, the persistent form's program count
(``num_sms``: SMs/CUs left to the GEMM, the rest carved out for communication), the
per-block shared-memory footprint (``smem_bytes``: occupancy shaping, docs/design.md 1.2) and
vendor knobs (``maxnreg`` on CUDA; ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack`` on
HIP).

Layout after Triton's own ``triton_kernels`` (``opt_flags`` + one details module per
vendor): this module holds the config type and :func:`config_space`, which dispatches to the
vendor modules :mod:`~cokit.triton_kernels.gemm_configs_nvidia` and
:mod:`~cokit.triton_kernels.gemm_configs_amd` (each vendor's space, warps and knobs). Tuned
winners are cached by :mod:`~cokit.triton_kernels.tuning_cache`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from . import gemm_configs_amd as _amd
from . import gemm_configs_nvidia as _nvidia
from .backend import ArchLimits, arch_limits

__all__ = [
    "ALLOWED_NUM_WARPS",
    "CUDA_KNOBS",
    "DTYPES",
    "HIP_KNOBS",
    "GemmConfig",
    "config_space",
    "default_config",
    "dtype_name",
    "estimate_shared_bytes",
    "interpreter_config",
    "known_to_spill",
    "next_pow2",
    "parse_config_spec",
    "parse_dtype",
    "parse_smem_bytes",
    "prune_configs",
]


#: dtypes the GEMM accepts, by their short names.
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
}

CUDA_KNOBS = _nvidia.KNOBS
HIP_KNOBS = _amd.KNOBS

#: num_warps a block may have, per backend (the interpreter accepts NVIDIA's set).
ALLOWED_NUM_WARPS: dict[str, tuple[int, ...]] = {
    "cuda": _nvidia.NUM_WARPS,
    "hip": _amd.NUM_WARPS,
    "interpreter": _nvidia.NUM_WARPS,
}
_VENDORS = {_nvidia.BACKEND: _nvidia, _amd.BACKEND: _amd}
_MIN_BLOCK = 16  # tl.dot needs M, N, K >= 16 on NVIDIA (and MFMA tiles on AMD)
_MAX_BLOCK = 256


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from 'fp16' / 'bf16' / 'fp32' (or the torch spelling / object)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; allowed: {', '.join(DTYPES)}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """'fp16' / 'bf16' / 'fp32' for a supported torch dtype."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; allowed: {', '.join(DTYPES)}")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Every resource knob of one GEMM launch.

    ``persistent`` picks the persistent form (``num_sms`` programs loop over the tiles; ``None``
    = one per SM/CU of the device) instead of one program per tile. ``smem_bytes`` is the
    shared memory (LDS) each block reserves at launch (``None`` = what the kernel needs); a
    larger value launches the same compiled code with fewer blocks resident per SM.
    """

    BLOCK_M: int = 128
    BLOCK_N: int = 128
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    num_sms: int | None = None
    smem_bytes: int | None = None
    maxnreg: int | None = None
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None

    # ------------------------------------------------------------------ validation
    def validate(
        self,
        backend: str = "interpreter",
        limits: ArchLimits | None = None,
        *,
        dtype: torch.dtype | None = None,
        needed_shared: int | None = None,
        precision: str = "ieee",
    ) -> GemmConfig:
        """Raise ``ValueError`` naming the bad field; return ``self`` when valid.

        ``backend`` is 'cuda', 'hip' or 'interpreter' (vendor knobs of either vendor allowed,
        ignored at run time). ``limits`` bounds ``smem_bytes`` and ``num_sms`` from above, and
        the shared memory the kernel needs (``needed_shared``, from a compiled kernel; else
        :func:`estimate_shared_bytes` for ``dtype`` and ``precision`` when ``dtype`` is given)
        and its threads per block: a config over the chip's limits is refused before any
        compile, naming the limit. ``needed_shared`` also bounds ``smem_bytes`` from below.
        """
        if backend not in ALLOWED_NUM_WARPS:
            raise ValueError(f"backend {backend!r} is unknown; allowed: cuda, hip, interpreter")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if (
                not isinstance(v, int)
                or isinstance(v, bool)
                or not _is_pow2(v)
                or not _MIN_BLOCK <= v <= _MAX_BLOCK
            ):
                raise ValueError(
                    f"{name}={v!r} is invalid; allowed: a power of 2 from {_MIN_BLOCK} to {_MAX_BLOCK}"
                )
        if not isinstance(self.GROUP_M, int) or self.GROUP_M < 1:
            raise ValueError(f"GROUP_M={self.GROUP_M!r} is invalid; allowed: an integer >= 1")
        warps = ALLOWED_NUM_WARPS[backend]
        if self.num_warps not in warps:
            raise ValueError(
                f"num_warps={self.num_warps!r} is invalid on {backend}; allowed: {', '.join(map(str, warps))}"
            )
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages={self.num_stages!r} is invalid; allowed: an integer from 1 to 8")
        if not isinstance(self.persistent, bool):
            raise ValueError(f"persistent={self.persistent!r} is invalid; allowed: True or False")
        if self.num_sms is not None:
            if not self.persistent:
                raise ValueError(
                    f"num_sms={self.num_sms} applies to the persistent form only; set persistent=True"
                )
            hi = limits.num_sms if limits is not None else None
            if (
                not isinstance(self.num_sms, int)
                or self.num_sms < 1
                or (hi is not None and self.num_sms > hi)
            ):
                allowed = (
                    f"1 to {hi} (the SMs/CUs of {limits.name})" if limits is not None else "an integer >= 1"
                )
                raise ValueError(f"num_sms={self.num_sms!r} is invalid; allowed: {allowed}")
        # vendor knobs
        if backend == "cuda":
            for knob in HIP_KNOBS:
                if getattr(self, knob) is not None:
                    raise ValueError(f"{knob} is an AMD (hip) knob; it cannot be used on cuda")
        if backend == "hip":
            for knob in CUDA_KNOBS:
                if getattr(self, knob) is not None:
                    raise ValueError(f"{knob} is an NVIDIA (cuda) knob; it cannot be used on hip")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 16 <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg={self.maxnreg!r} is invalid; allowed: an integer from 16 to 255")
        if self.waves_per_eu is not None and (
            not isinstance(self.waves_per_eu, int) or not 0 <= self.waves_per_eu <= 8
        ):
            raise ValueError(
                f"waves_per_eu={self.waves_per_eu!r} is invalid; allowed: 0 (compiler's choice) to 8"
            )
        if self.matrix_instr_nonkdim is not None and self.matrix_instr_nonkdim not in (0, 16, 32):
            raise ValueError(
                f"matrix_instr_nonkdim={self.matrix_instr_nonkdim!r} is invalid; allowed: 0 (compiler's choice), 16, 32"
            )
        if self.kpack is not None and self.kpack not in (1, 2):
            raise ValueError(f"kpack={self.kpack!r} is invalid; allowed: 1, 2")
        # what the kernel needs must fit the chip
        need = needed_shared
        source = "the compiled kernel uses"
        if need is None and dtype is not None:
            need = estimate_shared_bytes(
                self,
                dtype,
                limits if limits is not None else ("hip" if backend == "hip" else "cuda"),
                precision,
            )
            source = f"this config is estimated to use for {dtype_name(dtype)}"
        if limits is not None:
            if need is not None and need > limits.max_shared_per_block:
                raise ValueError(
                    f"{self.spec()} needs {need} B of shared memory per block ({source}), above the "
                    f"{limits.max_shared_per_block} B limit of {limits.name}; use smaller BLOCK_M/BLOCK_N/"
                    "BLOCK_K or fewer num_stages"
                )
            threads = self.num_warps * limits.warp_size
            if threads > limits.max_threads_per_block:
                raise ValueError(
                    f"num_warps={self.num_warps} is {threads} threads per block, above the "
                    f"{limits.max_threads_per_block} of {limits.name}"
                )
            self._check_registers(limits, threads)
        # per-block shared-memory footprint
        if self.smem_bytes is not None:
            if (
                not isinstance(self.smem_bytes, int)
                or isinstance(self.smem_bytes, bool)
                or self.smem_bytes < 0
            ):
                raise ValueError(
                    f"smem_bytes={self.smem_bytes!r} is invalid; allowed: an integer number of bytes"
                )
            if limits is not None and self.smem_bytes > limits.max_shared_per_block:
                raise ValueError(
                    f"smem_bytes={self.smem_bytes} is above the device limit of "
                    f"{limits.max_shared_per_block} B per block on {limits.name}"
                )
            if need is not None and self.smem_bytes < need:
                raise ValueError(
                    f"smem_bytes={self.smem_bytes} is below the {need} B of shared memory {source}; "
                    f"allowed: {need} to {limits.max_shared_per_block if limits else 'the device limit'}"
                )
        return self

    def _check_registers(self, limits: ArchLimits, threads: int) -> None:
        """Refuse what cannot fit the register file: ``maxnreg`` for every thread of the block
        above the registers of an SM (NVIDIA), or the fp32 accumulator tile alone
        (``BLOCK_M * BLOCK_N / threads`` registers per thread) above what a thread of this
        block may have (the chip's per-thread limit, the SM's/CU's registers shared by the
        block's threads, ``maxnreg`` on NVIDIA, 512 / ``waves_per_eu`` on AMD): it could only
        spill."""
        if limits.backend == "cuda" and self.maxnreg is not None:
            need = threads * self.maxnreg
            if need > limits.registers_per_sm:
                raise ValueError(
                    f"num_warps={self.num_warps} x {limits.warp_size} threads x maxnreg={self.maxnreg} "
                    f"is {need} registers per block, above the {limits.registers_per_sm} registers of "
                    f"an SM of {limits.name}; use fewer num_warps or a smaller maxnreg"
                )
        cap = min(limits.max_registers_per_thread, limits.registers_per_sm // threads)
        if limits.backend == "cuda" and self.maxnreg is not None:
            cap = min(cap, self.maxnreg)
        if limits.backend == "hip" and self.waves_per_eu:
            cap = min(cap, limits.max_registers_per_thread // self.waves_per_eu)
        acc = self.BLOCK_M * self.BLOCK_N // threads
        if acc > cap:
            raise ValueError(
                f"{self.spec()} keeps its {self.BLOCK_M}x{self.BLOCK_N} fp32 accumulator in {acc} "
                f"registers per thread, above the {cap} registers per thread limit of a "
                f"{threads}-thread block on {limits.name}; use smaller BLOCK_M/BLOCK_N or more num_warps"
            )

    # ------------------------------------------------------------------ helpers
    def launch_options(self, backend: str) -> dict[str, Any]:
        """Triton launch options (compile options) for ``backend``."""
        opts: dict[str, Any] = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if backend == "cuda" and self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        if backend == "hip":
            for knob in HIP_KNOBS:
                if getattr(self, knob) is not None:
                    opts[knob] = getattr(self, knob)
        return opts

    def replace(self, **changes: Any) -> GemmConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Fields whose value differs from None (JSON-ready)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GemmConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(
                f"unknown GemmConfig field(s) {', '.join(bad)}; allowed: {', '.join(sorted(names))}"
            )
        return cls(**d)

    def spec(self) -> str:
        """The ``--config`` spelling of this config (see :func:`parse_config_spec`)."""
        return ",".join(f"{k}={v}" for k, v in self.to_dict().items())


_INT_FIELDS = {f.name for f in dataclasses.fields(GemmConfig)} - {"persistent"}


def parse_config_spec(spec: str, base: GemmConfig | None = None) -> GemmConfig:
    """Parse ``'BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_warps=8,smem_bytes=98304'``.

    Keys are :class:`GemmConfig` fields (case-insensitive for the BLOCK_*/GROUP_M names);
    values are integers, ``none`` for optional fields, and ``true``/``false`` for
    ``persistent``. ``smem_bytes`` accepts a ``k`` suffix (KiB). Unset fields keep the
    values of ``base`` (the defaults when None).
    """
    base = base or GemmConfig()
    names = {f.name.lower(): f.name for f in dataclasses.fields(GemmConfig)}
    changes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"config item {item!r} is not KEY=VALUE; e.g. BLOCK_M=128,num_warps=8")
        key, _, raw = (s.strip() for s in item.partition("="))
        name = names.get(key.lower())
        if name is None:
            raise ValueError(f"unknown config key {key!r}; allowed: {', '.join(names.values())}")
        val = raw.lower()
        if name == "persistent":
            if val not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"persistent={raw!r} is invalid; allowed: true, false")
            changes[name] = val in ("1", "true", "yes")
            continue
        if val in ("none", "") and getattr(GemmConfig, name, 0) is None:
            changes[name] = None
            continue
        if name == "smem_bytes":
            changes[name] = parse_smem_bytes(raw)
            continue
        try:
            changes[name] = int(val, 0)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is invalid; allowed: an integer") from None
    return dataclasses.replace(base, **changes)


def parse_smem_bytes(text: str) -> int | None:
    """A shared-memory size: bytes, or KiB with a ``k``/``kb``/``kib`` suffix (``96k`` =
    98304); ``none`` (or empty) for the kernel's natural size."""
    val = text.strip().lower()
    if val in ("none", ""):
        return None
    mult = 1
    if val.endswith(("k", "kib", "kb")):
        mult, val = 1024, val.rstrip("bi").rstrip("k")
    try:
        return int(val, 0) * mult
    except ValueError:
        raise ValueError(
            f"smem_bytes={text!r} is invalid; allowed: an integer, k suffix for KiB, or none"
        ) from None


# ---------------------------------------------------------------------- shared memory
def estimate_shared_bytes(
    config: GemmConfig,
    dtype: torch.dtype,
    target: ArchLimits | str = "cuda",
    precision: str = "ieee",
) -> int:
    """Shared memory (LDS) one block of this config uses, in bytes.

    ``target`` is an :class:`ArchLimits`, a target name ('sm_80', 'sm_90', 'gfx90a',
    'gfx942') or a backend ('cuda' = the larger of the NVIDIA rules, 'hip'). The model,
    fitted to compile-only builds of this kernel (tests/test_gemm_compile.py checks it), with
    ``tile = BLOCK_K * (BLOCK_M + BLOCK_N) * element size``:

    * NVIDIA, Hopper wgmma path (sm_90, 16-bit inputs or tf32, 4-warp multiples, BLOCK_M % 64
      == 0): ``num_stages`` tiles; other NVIDIA cases (mma.sync / FMA): ``max(num_stages-1, 1)``
      tiles; the epilogue's layout conversion reuses that memory and may need up to
      ``BLOCK_M * BLOCK_N * element size`` (the larger of the two counts);
    * AMD: ``num_stages - 1`` tiles (stream pipeliner); with ``num_stages=1`` only the larger
      operand, ``BLOCK_K * max(BLOCK_M, BLOCK_N) * element size``.
    """
    backend: str
    arch: int | str
    if isinstance(target, ArchLimits):
        backend, arch = target.backend, target.arch
    elif target in ("cuda", "hip"):
        backend, arch = target, (90 if target == "cuda" else "gfx942")
    else:
        lim = arch_limits(str(target))
        backend, arch = lim.backend, lim.arch
    elem = dtype.itemsize
    bm, bn, bk, stages = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K, config.num_stages
    tile = bk * (bm + bn) * elem
    if backend == "hip":
        return bk * max(bm, bn) * elem if stages <= 1 else (stages - 1) * tile
    wgmma = (
        isinstance(arch, int)
        and arch >= 90
        and (dtype != torch.float32 or precision == "tf32")
        and config.num_warps % 4 == 0
        and bm % 64 == 0
    )
    buffers = max(stages, 1) if wgmma else max(stages - 1, 1)
    return max(buffers * tile, bm * bn * elem)


def prune_configs(
    configs: Iterable[GemmConfig],
    dtype: torch.dtype,
    limits: ArchLimits,
    M: int | None = None,
    N: int | None = None,
    K: int | None = None,
    precision: str = "ieee",
) -> list[GemmConfig]:
    """Drop configs that cannot fit the device or are much larger than the problem.

    A config is dropped when its estimated shared memory exceeds the per-block limit, when
    it has more threads than a block may, or when compile checks found it spills on that chip
    in that form (:func:`known_to_spill`). Given a shape (``M``, ``N``, ``K``), only configs
    whose blocks are no larger than the problem rounded up to a power of 2 (at least 16) are
    kept; when none is, the first config that fits the device is.
    """
    out: list[GemmConfig] = []
    for cfg in configs:
        if estimate_shared_bytes(cfg, dtype, limits, precision) > limits.max_shared_per_block:
            continue
        if cfg.num_warps * limits.warp_size > limits.max_threads_per_block:
            continue
        if known_to_spill(cfg, dtype, limits):
            continue
        out.append(cfg)
    if M is not None and N is not None and K is not None:
        cap_m, cap_n, cap_k = (max(_MIN_BLOCK, next_pow2(d)) for d in (M, N, K))
        fitted = [c for c in out if cap_m >= c.BLOCK_M and cap_n >= c.BLOCK_N and cap_k >= c.BLOCK_K]
        out = fitted or out[:1]
    return out


def known_to_spill(config: GemmConfig, dtype: torch.dtype, limits: ArchLimits) -> bool:
    """Whether the vendor module lists ``config`` (its tiles, warps, stages and knobs, in its
    tiled or persistent form) as spilling for ``dtype`` on the chip of ``limits`` (the
    ``SPILLS`` table of the vendor module, from compile-only builds)."""
    vendor = _VENDORS.get(limits.backend)
    if vendor is None:
        return False
    name = dtype_name(dtype)
    for target, dtypes, persistent, fields in vendor.SPILLS:
        if target != limits.target_name or name not in dtypes or persistent != config.persistent:
            continue
        if all(getattr(config, k) == v for k, v in fields.items()):
            return True
    return False


def next_pow2(x: int) -> int:
    """The smallest power of 2 >= ``x`` (1 for ``x <= 1``)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# ---------------------------------------------------------------------- search spaces
def config_space(
    backend: str, persistent: bool = False, dtype: str | torch.dtype | None = None
) -> list[GemmConfig]:
    """The configs autotuning tries on ``backend`` ('cuda' or 'hip') for ``dtype``, unpruned,
    in the vendor module's order (the first is the vendor's default for that dtype).

    Each vendor has one space per dtype (``SPACES`` of the vendor module: fp16 and bf16 share
    one, fp32 has its own, of smaller register footprints); every entry is compile-checked
    spill-free on the vendor's targets (tests/test_gemm_config_fit.py). ``dtype=None`` is the
    16-bit space."""
    vendor = _VENDORS.get(backend)
    if vendor is None:
        raise ValueError(f"backend {backend!r} has no config space; allowed: cuda, hip")
    fields = vendor.SPACE if dtype is None else vendor.SPACES[dtype_name(parse_dtype(dtype))]
    return [GemmConfig(**f, persistent=persistent) for f in fields]


def default_config(
    backend: str,
    persistent: bool = False,
    *,
    dtype: torch.dtype | None = None,
    limits: ArchLimits | None = None,
    precision: str = "ieee",
) -> GemmConfig:
    """The vendor's default config: the first of its space for ``dtype`` (the 16-bit space when
    None), or, given ``limits`` too, the first of that space that fits the chip (some entries
    only fit sm_90's shared memory)."""
    space = config_space(backend, persistent, dtype)
    if dtype is None or limits is None:
        return space[0]
    fitting = prune_configs(space, dtype, limits, precision=precision)
    if not fitting:
        raise ValueError(f"no {backend} GEMM config fits {limits.name} for {dtype_name(dtype)}")
    return fitting[0]


def interpreter_config(M: int, N: int, K: int, persistent: bool = False) -> GemmConfig:
    """The deterministic config used under the interpreter: few, large tiles.

    The interpreter costs about the same per tile operation whatever the tile size, so tiles
    cover up to 128 x 128 x 128 of the problem; the persistent form runs 2 programs.
    """

    def side(x: int) -> int:
        return min(128, max(_MIN_BLOCK, next_pow2(x)))

    return GemmConfig(
        BLOCK_M=side(M),
        BLOCK_N=side(N),
        BLOCK_K=side(K),
        GROUP_M=4,
        num_warps=4,
        num_stages=1,
        persistent=persistent,
        num_sms=2 if persistent else None,
    )
