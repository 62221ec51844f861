"""The GEMM tuning cache and the autotuner that fills it.

:class:`TuningCache` keeps tuned winners in ``<cache_dir>/gemm_tuning.json`` (default
``$COKIT_CACHE_DIR``, see :func:`default_cache_dir`), keyed by device, dtype, form,
precision and :func:`shape_bucket`; :func:`autotune` times candidate configs (or returns a
cached winner) and stores the fastest.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .gemm_config import GemmConfig, dtype_name, next_pow2

__all__ = ["TuningCache", "autotune", "default_cache_dir", "shape_bucket"]


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
            warnings.warn(
                f"cokit: ignoring bad tuning cache entry {key!r} in {self.path}: {exc}", stacklevel=2
            )
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
            with contextlib.suppress(OSError):
                os.unlink(tmp)
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
