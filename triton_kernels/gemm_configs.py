"""GEMM launch configurations: the knobs, their validation, per-backend search spaces,
a shared-memory estimate used to prune what cannot fit, and a JSON cache of tuned winners.

A :class:`GemmConfig` carries every resource knob of :mod:`cokit.triton_kernels.gemm`:
tile sizes, grouped ordering, warps, pipeline stages, the persistent form's program count
(``num_sms``: SMs/CUs left to the GEMM, the rest carved out for communication), the
per-block shared-memory footprint (``smem_bytes``: occupancy shaping, DESIGN.md 1.2) and
vendor knobs (``maxnreg`` on CUDA; ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack`` on
HIP).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .backend import ArchLimits

__all__ = [
    "CUDA_KNOBS",
    "DTYPES",
    "GemmConfig",
    "HIP_KNOBS",
    "TuningCache",
    "autotune",
    "config_space",
    "default_cache_dir",
    "dtype_name",
    "estimate_shared_bytes",
    "interpreter_config",
    "parse_config_spec",
    "parse_smem_bytes",
    "parse_dtype",
    "prune_configs",
    "shape_bucket",
]


#: dtypes the GEMM accepts, by their short names.
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_ALIASES = {
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
}

CUDA_KNOBS = ("maxnreg",)
HIP_KNOBS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

# num_warps a block may have: up to 1024 threads (32 warps of 32 on NVIDIA, 16 wavefronts of 64
# on AMD); Triton requires a power of 2.
ALLOWED_NUM_WARPS: dict[str, tuple[int, ...]] = {
    "cuda": (1, 2, 4, 8, 16, 32),
    "hip": (1, 2, 4, 8, 16),
    "interpreter": (1, 2, 4, 8, 16, 32),
}
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
    ) -> "GemmConfig":
        """Raise ``ValueError`` naming the bad field; return ``self`` when valid.

        ``backend`` is 'cuda', 'hip' or 'interpreter' (vendor knobs of either vendor allowed,
        ignored at run time). ``limits`` bounds ``smem_bytes`` and ``num_sms`` from above;
        ``needed_shared`` (from a compiled kernel; else estimated when ``dtype`` is given)
        bounds ``smem_bytes`` from below.
        """
        if backend not in ALLOWED_NUM_WARPS:
            raise ValueError(f"backend {backend!r} is unknown; allowed: cuda, hip, interpreter")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not _is_pow2(v) or not _MIN_BLOCK <= v <= _MAX_BLOCK:
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
            if not isinstance(self.num_sms, int) or self.num_sms < 1 or (hi is not None and self.num_sms > hi):
                allowed = f"1 to {hi} (the SMs/CUs of {limits.name})" if hi else "an integer >= 1"
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
            raise ValueError(f"waves_per_eu={self.waves_per_eu!r} is invalid; allowed: 0 (compiler's choice) to 8")
        if self.matrix_instr_nonkdim is not None and self.matrix_instr_nonkdim not in (0, 16, 32):
            raise ValueError(
                f"matrix_instr_nonkdim={self.matrix_instr_nonkdim!r} is invalid; allowed: 0 (compiler's choice), 16, 32"
            )
        if self.kpack is not None and self.kpack not in (1, 2):
            raise ValueError(f"kpack={self.kpack!r} is invalid; allowed: 1, 2")
        # per-block shared-memory footprint
        if self.smem_bytes is not None:
            if not isinstance(self.smem_bytes, int) or isinstance(self.smem_bytes, bool) or self.smem_bytes < 0:
                raise ValueError(f"smem_bytes={self.smem_bytes!r} is invalid; allowed: an integer number of bytes")
            if limits is not None and self.smem_bytes > limits.max_shared_per_block:
                raise ValueError(
                    f"smem_bytes={self.smem_bytes} is above the device limit of "
                    f"{limits.max_shared_per_block} B per block on {limits.name}"
                )
            need = needed_shared
            source = "the compiled kernel uses"
            if need is None and dtype is not None:
                need = estimate_shared_bytes(
                    self, dtype, limits if limits is not None else ("hip" if backend == "hip" else "cuda")
                )
                source = "this config is estimated to use"
            if need is not None and self.smem_bytes < need:
                raise ValueError(
                    f"smem_bytes={self.smem_bytes} is below the {need} B of shared memory {source}; "
                    f"allowed: {need} to {limits.max_shared_per_block if limits else 'the device limit'}"
                )
        return self

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

    def replace(self, **changes: Any) -> "GemmConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Fields whose value differs from None (JSON-ready)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GemmConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"unknown GemmConfig field(s) {', '.join(bad)}; allowed: {', '.join(sorted(names))}")
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
        raise ValueError(f"smem_bytes={text!r} is invalid; allowed: an integer, k suffix for KiB, or none") from None


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
    if isinstance(target, ArchLimits):
        backend, arch = target.backend, target.arch
    elif target in ("cuda", "hip"):
        backend, arch = target, (90 if target == "cuda" else "gfx942")
    else:
        from .backend import arch_limits

        lim = arch_limits(str(target))
        backend, arch = lim.backend, lim.arch
    elem = torch.empty((), dtype=dtype).element_size()
    bm, bn, bk, stages = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K, config.num_stages
    tile = bk * (bm + bn) * elem
    if backend == "hip":
        return bk * max(bm, bn) * elem if stages <= 1 else (stages - 1) * tile
    wgmma = (
        isinstance(arch, int) and arch >= 90
        and (dtype != torch.float32 or precision == "tf32")
        and config.num_warps % 4 == 0 and bm % 64 == 0
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

    A config is dropped when its estimated shared memory exceeds the per-block limit, when it
    has more threads than a block may, or (given a shape) when a block dimension is more
    than twice the padded problem size and a smaller config with otherwise equal knobs covers it.
    """
    out: list[GemmConfig] = []
    for cfg in configs:
        if estimate_shared_bytes(cfg, dtype, limits, precision) > limits.max_shared_per_block:
            continue
        if cfg.num_warps * limits.warp_size > limits.max_threads_per_block:
            continue
        out.append(cfg)
    if M is not None and N is not None and K is not None:
        fitted = [
            c for c in out
            if c.BLOCK_M <= max(_MIN_BLOCK, _next_pow2(M))
            and c.BLOCK_N <= max(_MIN_BLOCK, _next_pow2(N))
            and c.BLOCK_K <= max(_MIN_BLOCK, _next_pow2(K))
        ]
        out = fitted or out[:1]
    return out


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# ---------------------------------------------------------------------- search spaces
def _cfg(bm, bn, bk, g, w, s, **kw) -> GemmConfig:
    return GemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s, **kw)


# NVIDIA (sm_80/sm_90): Triton's matmul tutorial space plus larger-K and 8-warp tiles.
_CUDA_SPACE: tuple[GemmConfig, ...] = (
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

# AMD (gfx90a/gfx942): Triton's AMD matmul space (stream pipeliner: num_stages=2) with
# waves_per_eu, MFMA 16x16 / 32x32 and kpack choices.
_HIP_SPACE: tuple[GemmConfig, ...] = (
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


def config_space(backend: str, persistent: bool = False) -> list[GemmConfig]:
    """The configs autotuning tries on ``backend`` ('cuda' or 'hip'), unpruned."""
    if backend == "cuda":
        space = _CUDA_SPACE
    elif backend == "hip":
        space = _HIP_SPACE
    else:
        raise ValueError(f"backend {backend!r} has no config space; allowed: cuda, hip")
    return [dataclasses.replace(c, persistent=persistent) for c in space]


def interpreter_config(M: int, N: int, K: int, persistent: bool = False) -> GemmConfig:
    """The deterministic config used under the interpreter: few, large tiles.

    The interpreter costs about the same per tile operation whatever the tile size, so tiles
    cover up to 128 x 128 x 128 of the problem; the persistent form runs 2 programs.
    """
    def side(x: int) -> int:
        return min(128, max(_MIN_BLOCK, _next_pow2(x)))

    return GemmConfig(
        BLOCK_M=side(M), BLOCK_N=side(N), BLOCK_K=side(K), GROUP_M=4, num_warps=4, num_stages=1,
        persistent=persistent, num_sms=2 if persistent else None,
    )


# ---------------------------------------------------------------------- tuning cache
def default_cache_dir() -> Path:
    """``$COKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cokit``, else ``~/.cache/cokit``."""
    env = os.environ.get("COKIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cokit"


def shape_bucket(M: int, N: int, K: int) -> str:
    """Shapes that share a tuned config: each dimension rounded up to a power of 2."""
    return "x".join(str(_next_pow2(max(1, d))) for d in (M, N, K))


class TuningCache:
    """Tuned GEMM configs in ``<cache_dir>/gemm_tuning.json``.

    Keys are ``device|dtype|form|precision|bucket``. A missing file is an empty cache; an
    unreadable or corrupt one is ignored with a warning (and replaced on the next store).
    """

    FILENAME = "gemm_tuning.json"
    VERSION = 1

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self.dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.path = self.dir / self.FILENAME

    @staticmethod
    def key(device_name: str, dtype: torch.dtype, M: int, N: int, K: int,
            persistent: bool = False, precision: str = "ieee") -> str:
        """The cache key of one tuning problem."""
        form = "persistent" if persistent else "tiled"
        return f"{device_name}|{dtype_name(dtype)}|{form}|{precision}|{shape_bucket(M, N, K)}"

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            warnings.warn(f"cokit: ignoring unreadable GEMM tuning cache {self.path}: {exc}", stacklevel=3)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("expected an object with an 'entries' object")
        except ValueError as exc:
            warnings.warn(f"cokit: ignoring corrupt GEMM tuning cache {self.path}: {exc}", stacklevel=3)
            return {}
        return data["entries"]

    def load(self, key: str) -> GemmConfig | None:
        """The tuned config stored under ``key``, or None (bad entries are ignored with a warning)."""
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return GemmConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError) as exc:
            warnings.warn(f"cokit: ignoring bad tuning cache entry {key!r} in {self.path}: {exc}", stacklevel=2)
            return None

    def store(self, key: str, config: GemmConfig, **info: Any) -> None:
        """Save ``config`` under ``key`` (atomic replace; other entries are kept)."""
        entries = self._read()
        entries[key] = {"config": config.to_dict(), **info}
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gemm_tuning.", suffix=".json", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": self.VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def entries(self) -> dict[str, Any]:
        """All stored entries (empty when the file is missing or corrupt)."""
        return self._read()


def autotune(
    configs: Sequence[GemmConfig],
    run: Callable[[GemmConfig], Any],
    bench: Callable[[Callable[[], Any]], float],
    *,
    cache: TuningCache | None = None,
    key: str | None = None,
) -> tuple[GemmConfig, dict[str, float]]:
    """The fastest of ``configs``: ``bench(lambda: run(cfg))`` returns a time (lower wins).

    With ``cache`` and ``key``, a stored winner is returned without timing anything, and a new
    winner is stored. Configs whose run raises (e.g. out of resources) are skipped. Returns
    the winner and the timings (empty on a cache hit).
    """
    if not configs:
        raise ValueError("autotune needs at least one config")
    if cache is not None and key is not None:
        hit = cache.load(key)
        if hit is not None:
            return hit, {}
    timings: dict[str, float] = {}
    errors: list[str] = []
    best: tuple[float, GemmConfig] | None = None
    for cfg in configs:
        try:
            t = float(bench(lambda cfg=cfg: run(cfg)))
        except Exception as exc:  # a config that does not compile/launch on this device
            errors.append(f"{cfg.spec()}: {type(exc).__name__}: {exc}")
            continue
        if not math.isfinite(t):
            continue
        timings[cfg.spec()] = t
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError("autotune: no config ran; errors:\n" + "\n".join(errors))
    if cache is not None and key is not None:
        cache.store(key, best[1], time_ms=best[0], candidates=len(configs))
    return best[1], timings
