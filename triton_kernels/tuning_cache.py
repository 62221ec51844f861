"""The tuning cache (GEMM and compression kernels) and the autotuner that fills it.

:class:`TuningCache` keeps tuned winners in ``<cache_dir>/gemm_tuning.json`` (default
``$COKIT_CACHE_DIR``, see :func:`default_cache_dir`). GEMM keys are device, dtype, form,
precision and :func:`shape_bucket`; other kinds of entries have keys ``<kind>:<rest>`` and
their own entry validator (:data:`ENTRY_KINDS`: ``compress:`` entries are the compression
kernels' :class:`~cokit.triton_kernels.compress_config.KernelConfig`). :func:`autotune` times
candidate configs (or returns a cached winner) and stores the fastest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ._atomic_file import atomic_write_text
from .gemm_config import GemmConfig, dtype_name, next_pow2

try:  # POSIX; elsewhere concurrent stores are not serialized (documented on store)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ENTRY_KINDS",
    "TunedConfig",
    "TuningCache",
    "autotune",
    "bench_gpu",
    "default_cache_dir",
    "entry_kind",
    "shape_bucket",
    "validate_entry",
    "validate_gemm_entry",
]


class TunedConfig(Protocol):
    """What the cache stores: a config with a JSON form and a short label."""

    def to_dict(self) -> dict[str, Any]: ...

    def spec(self) -> str: ...


C = TypeVar("C", bound=TunedConfig)

#: entry kinds besides the GEMM's, by key prefix (``<kind>:...``): the module of this package
#: and its ``validate_entry(key, entry) -> config`` (imported when an entry of that kind is
#: read, so this module imports none of them).
ENTRY_KINDS: dict[str, tuple[str, str]] = {"compress": ("compress_config", "validate_entry")}

#: tuned winners whose store failed (unwritable cache folder), by cache file: this process
#: still reuses them instead of tuning again.
_UNSAVED: dict[Path, dict[str, dict[str, Any]]] = {}

_FIELDS = {f.name: f for f in dataclasses.fields(GemmConfig)}
#: fields every stored config has (to_dict drops only the None-valued optional ones)
_REQUIRED = tuple(name for name, f in _FIELDS.items() if f.default is not None)


def default_cache_dir() -> Path:
    """``$COKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cokit``, else ``~/.cache/cokit``."""
    env = os.environ.get("COKIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cokit"


def shape_bucket(M: int, N: int, K: int) -> str:
    """Shapes that share a tuned config: each dimension rounded up to a power of 2."""
    return "x".join(str(next_pow2(max(1, d))) for d in (M, N, K))


def bench_gpu(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` on the GPU (``triton.testing.do_bench``): the timer the
    autotuners use by default."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20)


def entry_kind(key: str) -> str:
    """The kind of a key: its ``<kind>:`` prefix when that is in :data:`ENTRY_KINDS`, else "gemm"."""
    prefix = key.split(":", 1)[0] if ":" in key else ""
    return prefix if prefix in ENTRY_KINDS else "gemm"


def _check_time(entry: Any) -> None:
    t = entry.get("time_ms") if isinstance(entry, dict) else None
    if t is not None and (
        not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0
    ):
        raise ValueError(f"time_ms={t!r} is not a finite number >= 0")


def validate_entry(key: str, entry: Any) -> Any:
    """The config of one stored entry of any kind (:func:`entry_kind`), or ``ValueError``
    saying what is wrong with it; a stored ``time_ms`` must be a finite number >= 0."""
    kind = entry_kind(key)
    if kind == "gemm":
        return validate_gemm_entry(key, entry)
    module, name = ENTRY_KINDS[kind]
    cfg = getattr(importlib.import_module(f"{__package__}.{module}"), name)(key, entry)
    _check_time(entry)
    return cfg


def validate_gemm_entry(key: str, entry: Any) -> GemmConfig:
    """The config of one stored GEMM entry, or ``ValueError`` saying what is wrong with it.

    The entry must be an object with a ``config`` object holding every required GemmConfig
    field with the right type (ints are not bools, ``persistent`` is a bool); the config must
    pass :meth:`GemmConfig.validate` (either vendor's knobs allowed) and agree with the
    key's form (tiled / persistent); a stored ``time_ms`` must be a finite number >= 0.
    """
    if not isinstance(entry, dict):
        raise ValueError(f"expected an object, got {type(entry).__name__}")
    raw = entry.get("config")
    if not isinstance(raw, dict):
        raise ValueError("missing 'config' object" if raw is None else "'config' is not an object")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown GemmConfig field(s) {', '.join(unknown)}")
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}")
    for name, value in raw.items():
        want_bool = name == "persistent"
        ok = (
            isinstance(value, bool) if want_bool else (isinstance(value, int) and not isinstance(value, bool))
        )
        if not ok and not (value is None and _FIELDS[name].default is None):
            raise ValueError(
                f"{name}={value!r} has the wrong type; expected {'a bool' if want_bool else 'an int'}"
            )
    cfg = GemmConfig.from_dict(raw).validate("interpreter")  # the union of both vendors' rules
    form = key.split("|")[2] if key.count("|") >= 4 else None
    if form is not None and form != ("persistent" if cfg.persistent else "tiled"):
        raise ValueError(f"persistent={cfg.persistent} disagrees with the key's form {form!r}")
    _check_time(entry)
    return cfg


class TuningCache:
    """Tuned configs in ``<cache_dir>/gemm_tuning.json``.

    GEMM keys are ``device|dtype|form|precision|bucket``; other kinds are ``<kind>:...``
    (:func:`entry_kind`), each entry checked by its kind's validator. A missing file is an empty cache; an
    unreadable, non-UTF-8 or corrupt one is ignored with a warning (and replaced on the next
    store); an invalid entry is ignored with a warning naming its key. Stores from several
    processes are merged under a lock file (``gemm_tuning.json.lock``); a store that cannot
    write (unwritable folder) warns and keeps the result in this process's memory.
    """

    FILENAME = "gemm_tuning.json"
    LOCK_FILENAME = FILENAME + ".lock"
    VERSION = 1

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self.dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.path = self.dir / self.FILENAME
        self.lock_path = self.dir / self.LOCK_FILENAME

    @staticmethod
    def key(
        device_name: str,
        dtype: torch.dtype,
        M: int,
        N: int,
        K: int,
        persistent: bool = False,
        precision: str = "ieee",
    ) -> str:
        """The cache key of one tuning problem."""
        form = "persistent" if persistent else "tiled"
        return f"{device_name}|{dtype_name(dtype)}|{form}|{precision}|{shape_bucket(M, N, K)}"

    def _read(self) -> dict[str, Any]:
        """The stored entries as they are (empty, with a warning, when unusable)."""
        try:
            text = self.path.read_bytes().decode("utf-8")
        except (FileNotFoundError, NotADirectoryError):  # no cache there (yet)
            return {}
        except OSError as exc:
            warnings.warn(f"cokit: ignoring unreadable GEMM tuning cache {self.path}: {exc}", stacklevel=3)
            return {}
        except UnicodeDecodeError as exc:
            warnings.warn(
                f"cokit: ignoring GEMM tuning cache {self.path}: not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); it is replaced on the next store",
                stacklevel=3,
            )
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("expected an object with an 'entries' object")
        except ValueError as exc:
            warnings.warn(f"cokit: ignoring corrupt GEMM tuning cache {self.path}: {exc}", stacklevel=3)
            return {}
        return data["entries"]

    def load(self, key: str) -> Any:
        """The tuned config stored under ``key`` (a GemmConfig for GEMM keys), or None (an
        invalid entry is ignored with a warning naming the key; see :func:`validate_entry`)."""
        entry = self._read().get(key)
        if entry is None:
            entry = _UNSAVED.get(self.path, {}).get(key)
            if entry is None:
                return None
        try:
            return validate_entry(key, entry)
        except (TypeError, ValueError) as exc:
            warnings.warn(
                f"cokit: ignoring bad tuning cache entry {key!r} in {self.path}: {exc}",
                stacklevel=2,
            )
            return None

    def store(self, key: str, config: TunedConfig, **info: Any) -> bool:
        """Save ``config`` under ``key``, keeping every other entry, including those other
        processes store at the same time (read-merge-write under an exclusive ``flock`` of
        the lock file; atomic, fsync-ed replace). Returns True when saved; when the folder
        cannot be written it warns, keeps the entry in memory for this process (``load``
        still finds it) and returns False. An entry :meth:`load` would reject raises
        ``ValueError`` before anything is written."""
        entry = {"config": config.to_dict(), **info}
        validate_entry(key, entry)
        try:
            with self._locked():
                entries = self._read()
                entries[key] = entry
                doc = {"version": self.VERSION, "entries": entries}
                atomic_write_text(self.path, json.dumps(doc, indent=1, sort_keys=True))
        except OSError as exc:
            _UNSAVED.setdefault(self.path, {})[key] = entry
            what = "GEMM" if entry_kind(key) == "gemm" else entry_kind(key)
            warnings.warn(
                f"cokit: could not save the tuned {what} config for {key!r} to {self.path} "
                f"({exc.strerror or exc}); it is kept in memory for this process only. "
                "Set COKIT_CACHE_DIR to a writable folder to keep tuning results",
                stacklevel=2,
            )
            return False
        _UNSAVED.get(self.path, {}).pop(key, None)
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive lock on ``<file>.lock`` (creating the folder and the lock file)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def entries(self) -> dict[str, Any]:
        """All stored entries as stored (empty when the file is missing or corrupt; entries
        are not validated: :meth:`load` does that)."""
        return self._read()


def autotune(
    configs: Sequence[C],
    run: Callable[[C], Any],
    bench: Callable[[Callable[[], Any]], float],
    *,
    cache: TuningCache | None = None,
    key: str | None = None,
    check_cache: bool = True,
) -> tuple[C, dict[str, float]]:
    """The fastest of ``configs``: ``bench(lambda: run(cfg))`` returns a time (lower wins).

    With ``cache`` and ``key``, a stored winner is returned without timing anything (unless
    ``check_cache`` is False: the caller already looked), and a new winner is stored. Configs
    whose run raises (e.g. out of resources) are skipped. Returns the winner and the timings
    (empty on a cache hit). Any config type with ``to_dict()`` and ``spec()`` works.
    """
    if not configs:
        raise ValueError("autotune needs at least one config")
    if cache is not None and key is not None and check_cache:
        hit = cache.load(key)
        if hit is not None:
            return hit, {}
    timings: dict[str, float] = {}
    errors: list[str] = []
    best: tuple[float, C] | None = None
    for cfg in configs:
        try:
            t = float(bench(functools.partial(run, cfg)))
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
