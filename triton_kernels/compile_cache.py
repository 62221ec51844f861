"""A disk cache of what occupancy needs from a compiled GEMM: registers, shared memory, spills.

Reading a config's resource use means compiling it (about a second per config on an idle
machine, far more on a loaded one, plus the ``ptxas -v`` run that reads the registers and spills), and
``cokit occupancy`` and the sweeps ask about the same configs again and again.
:func:`gemm_kernel_facts` keeps each build's :class:`KernelFacts` in
``<cache_dir>/compile/<sha256 of the key>.json`` (default ``$COKIT_CACHE_DIR``, else the user's
cache folder: :func:`~cokit.triton_kernels.tuning_cache.default_cache_dir`), one small JSON
file per build, written atomically (concurrent writers of one entry write the same bytes).

The key holds the Triton version, the backend, arch and target (the device's name on a live
GPU), a hash of the kernel sources (``gemm.py`` and the modules that build it), and the
build's config, dtype and precision. ``smem_bytes`` is not in the key: it changes the launch
footprint, not the binary, and :func:`gemm_occupancy_cached` applies it afterwards, with the
checks of :func:`~cokit.triton_kernels.shaped_launch.with_shared_memory`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._atomic_file import atomic_write_text
from ._compat import TRITON_VERSION_STRING
from .backend import ArchLimits, arch_limits, cached_device_limits
from .gemm_config import GemmConfig, dtype_name, parse_dtype
from .occupancy import Occupancy, occupancy
from .tuning_cache import default_cache_dir

__all__ = [
    "SCHEMA",
    "CompileCache",
    "KernelFacts",
    "gemm_cache_key",
    "gemm_kernel_facts",
    "gemm_occupancy_cached",
    "kernel_source_hash",
]

SCHEMA = "cokit.compile_cache/1"
#: the modules whose source decides what the GEMM compiles to (hashed into every key)
SOURCES = ("gemm.py", "gemm_config.py", "compile_only.py", "_compat.py")


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """What one compiled kernel uses, as occupancy needs it."""

    name: str
    target: str
    num_warps: int
    shared_bytes: int  # shared memory / LDS the kernel itself uses (smem_bytes not applied)
    registers: int | None  # per thread; None when the tool to read it is missing
    spills: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KernelFacts:
        """Inverse of :meth:`to_dict`; ``ValueError`` when a field is missing or mistyped."""
        if not isinstance(d, dict):
            raise ValueError(f"facts must be an object, got {type(d).__name__}")
        want: dict[str, tuple[type, bool]] = {
            "name": (str, False),
            "target": (str, False),
            "num_warps": (int, False),
            "shared_bytes": (int, False),
            "registers": (int, True),
            "spills": (int, True),
        }
        if set(d) != set(want):
            raise ValueError(f"facts fields {sorted(d)} differ from {sorted(want)}")
        for key, (kind, nullable) in want.items():
            v: Any = d[key]
            if v is None and nullable:
                continue
            bad_int = kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0)
            if bad_int or not isinstance(v, kind):
                raise ValueError(f"facts field {key}={v!r} is invalid")
        return cls(**d)


@functools.cache
def kernel_source_hash() -> str:
    """sha256 over the sources in :data:`SOURCES` (a change to any of them is a new build)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()


class CompileCache:
    """Kernel facts on disk, one JSON file per key (``<cache_dir>/compile/<hash>.json``).

    A missing, unreadable or corrupt entry is a miss (a corrupt one is rebuilt and replaced,
    with a warning); a folder that cannot be written warns once per process and the facts
    are kept in memory, so a read-only cache never stops the work. ``enabled=False`` reads
    and writes nothing (every build compiles).
    """

    SUBDIR = "compile"

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, enabled: bool = True) -> None:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.dir = root / self.SUBDIR
        self.enabled = enabled
        self._memory: dict[str, KernelFacts] = {}
        self._warned = False

    @staticmethod
    def digest(key: dict[str, Any]) -> str:
        """The file name stem of ``key``: sha256 of its canonical JSON."""
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def path(self, key: dict[str, Any]) -> Path:
        """Where the entry of ``key`` lives."""
        return self.dir / f"{self.digest(key)}.json"

    def load(self, key: dict[str, Any]) -> KernelFacts | None:
        """The stored facts of ``key``, or None."""
        if not self.enabled:
            return None
        digest = self.digest(key)
        if digest in self._memory:
            return self._memory[digest]
        path = self.dir / f"{digest}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            warnings.warn(f"cokit: ignoring unreadable compile cache entry {path}: {exc}", stacklevel=2)
            return None
        try:
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
                raise ValueError(f"expected an object with schema {SCHEMA!r}")
            if doc.get("key") != key:
                raise ValueError("its key differs from the requested one")
            return KernelFacts.from_dict(doc.get("facts"))
        except ValueError as exc:
            warnings.warn(
                f"cokit: ignoring bad compile cache entry {path} ({exc}); it is rebuilt", stacklevel=2
            )
            return None

    def store(self, key: dict[str, Any], facts: KernelFacts, **info: Any) -> bool:
        """Write the entry atomically; False (and facts kept in memory) when it cannot be."""
        if not self.enabled:
            return False
        doc = {"schema": SCHEMA, "key": key, "facts": facts.to_dict(), **info}
        try:
            atomic_write_text(self.path(key), json.dumps(doc, indent=1, sort_keys=True))
        except OSError as exc:
            self._memory[self.digest(key)] = facts
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"cokit: could not write the compile cache in {self.dir} ({exc.strerror or exc}); "
                    "compiled kernel facts are kept for this process only. Set COKIT_CACHE_DIR to a "
                    "writable folder to keep them",
                    stacklevel=2,
                )
            return False
        return True

    def get_or_build(self, key: dict[str, Any], build: Callable[[], KernelFacts]) -> tuple[KernelFacts, bool]:
        """``(facts, True)`` from the cache, else ``(build(), False)`` after storing them."""
        facts = self.load(key)
        if facts is not None:
            return facts, True
        t0 = time.perf_counter()
        facts = build()
        self.store(key, facts, compile_s=round(time.perf_counter() - t0, 3))
        return facts, False


def _limits_of(target: str | None) -> ArchLimits:
    if target is not None:
        return arch_limits(target)
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU here: name a target (sm_80, sm_90, gfx90a, gfx942)")
    return cached_device_limits()


def gemm_cache_key(
    config: GemmConfig, target: str | None, dtype: torch.dtype | str, *, precision: str = "ieee"
) -> dict[str, Any]:
    """The cache key of one GEMM build (``target=None``: the live GPU, keyed by its name)."""
    limits = _limits_of(target)
    build = config.replace(smem_bytes=None).to_dict()
    return {
        "kernel": "gemm",
        "triton": TRITON_VERSION_STRING,
        "backend": limits.backend,
        "arch": str(limits.arch),
        "target": target if target is not None else f"live:{limits.name}",
        "source": kernel_source_hash(),
        "config": build,
        "dtype": dtype_name(parse_dtype(dtype)),
        "precision": precision,
    }


def _build_facts(config: GemmConfig, target: str | None, dtype: torch.dtype, precision: str) -> KernelFacts:
    """Compile the GEMM (``smem_bytes`` not applied) and read its facts."""
    from .gemm import compile_gemm, warmup_gemm

    plain = config.replace(smem_bytes=None)
    if target is not None:
        ck = compile_gemm(plain, dtype, target, precision=precision)
        return KernelFacts(ck.name, target, ck.num_warps, ck.shared_bytes, ck.registers, ck.spills)
    compiled = warmup_gemm(plain, dtype, precision=precision)
    compiled._init_handles()  # loads the binary: registers and spills become known
    meta = compiled.metadata
    regs = getattr(compiled, "n_regs", None)
    spills = getattr(compiled, "n_spills", None)
    return KernelFacts(
        str(meta.name),
        _limits_of(None).target_name,
        int(meta.num_warps),
        int(meta.shared),
        int(regs) if regs is not None else None,
        int(spills) if spills is not None else None,
    )


def gemm_kernel_facts(
    config: GemmConfig,
    target: str | None = None,
    dtype: torch.dtype | str = "bf16",
    *,
    precision: str = "ieee",
    cache: CompileCache | None = None,
) -> tuple[KernelFacts, bool]:
    """The facts of the GEMM built for ``config`` on ``target`` (None: the live GPU), from
    the cache when there, else compiled and stored. Returns ``(facts, from_cache)``.
    Compiling for a named target needs a process without ``TRITON_INTERPRET``."""
    dt = parse_dtype(dtype)
    key = gemm_cache_key(config, target, dt, precision=precision)
    cache = cache if cache is not None else CompileCache()
    return cache.get_or_build(key, lambda: _build_facts(config, target, dt, precision))


def shaped_occupancy(facts: KernelFacts, smem_bytes: int | None, limits: ArchLimits) -> Occupancy:
    """Occupancy of the kernel of ``facts`` launched reserving ``smem_bytes`` per block
    (None: what it uses). Raises ``ValueError`` for a request below its use or above the
    device's per-block limit (the rules of ``with_shared_memory``)."""
    shared = facts.shared_bytes
    if smem_bytes is not None:
        if smem_bytes < facts.shared_bytes:
            raise ValueError(
                f"smem_bytes={smem_bytes} is below the {facts.shared_bytes} B of shared memory kernel "
                f"{facts.name} uses; allowed: {facts.shared_bytes} to {limits.max_shared_per_block}"
            )
        if smem_bytes > limits.max_shared_per_block:
            raise ValueError(
                f"smem_bytes={smem_bytes} is above the device limit of {limits.max_shared_per_block} B "
                f"per block on {limits.name}; allowed: {facts.shared_bytes} to {limits.max_shared_per_block}"
            )
        shared = smem_bytes
    return occupancy(facts.num_warps, shared, facts.registers, limits)


def gemm_occupancy_cached(
    config: GemmConfig,
    target: str | None = None,
    dtype: torch.dtype | str = "bf16",
    *,
    precision: str = "ieee",
    cache: CompileCache | None = None,
) -> tuple[Occupancy, KernelFacts, bool]:
    """:func:`cokit.triton_kernels.gemm.gemm_occupancy` through the compile cache: the
    occupancy (``smem_bytes`` applied), the build's facts, and whether they came from the
    cache."""
    facts, hit = gemm_kernel_facts(config, target, dtype, precision=precision, cache=cache)
    return shaped_occupancy(facts, config.smem_bytes, _limits_of(target)), facts, hit
