"""Shared helpers of the benchmarks: one timer, time budgets, compiled-kernel resources.

* :func:`median_ms`: on a GPU, ``triton.testing.do_bench`` (CUDA events, warm-up, cache
  flush); on a CPU, the median of a few ``perf_counter`` samples after one warm-up call.
* :class:`Budget`: seconds a benchmark phase may spend; loops ask :meth:`Budget.stop`
  before each unit of work and stop adding work once it is spent.
* :class:`KernelWatch` / :func:`kernel_resources`: which Triton kernels a call compiled
  and their ``n_regs`` / ``n_spills`` (known once the binary is loaded on the GPU), read from
  the ``JITFunction``'s per-device cache (same layout on triton 3.6 and 3.9). Best effort:
  anything unknown is ``None`` (printed ``-``); nothing here raises.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any


def median_ms(fn: Callable[[], Any], on_gpu: bool, quick: bool = False) -> float:
    """Median time of ``fn`` in milliseconds."""
    if on_gpu:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 200, return_mode="median"))
    fn()
    samples = []
    for _ in range(3 if quick else 5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class Budget:
    """A time budget in seconds (``None``: unlimited), counted from construction."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.cut = 0  # units of work skipped because the budget was spent

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def spent(self) -> bool:
        return self.left() <= 0

    def stop(self, units: int = 1) -> bool:
        """True (and ``units`` counted as cut) when the budget is spent: skip the work."""
        if self.spent():
            self.cut += units
            return True
        return False


# ---------------------------------------------------------------------- kernel resources
def _jit_function(obj: Any) -> Any | None:
    """The ``JITFunction`` behind ``obj`` (itself, or under an Autotuner/Heuristics ``.fn``)."""
    for _ in range(4):
        if obj is None:
            return None
        if hasattr(obj, "device_caches") and hasattr(obj, "fn"):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def jit_functions(modules: Iterable[ModuleType]) -> list[Any]:
    """Every ``@triton.jit`` function defined at the top level of ``modules``."""
    found: dict[int, Any] = {}
    for module in modules:
        for obj in list(vars(module).values()):
            try:
                fn = _jit_function(obj)
            except Exception:
                fn = None
            if fn is not None:
                found[id(fn)] = fn
    return list(found.values())


def compiled_kernels(modules: Iterable[ModuleType]) -> dict[int, Any]:
    """``id -> CompiledKernel`` for every kernel compiled so far from ``modules`` (all devices).

    ``JITFunction.device_caches`` maps a device to ``(kernel_cache, key_cache, target,
    backend, binder)`` on triton 3.6 and 3.9; ``kernel_cache`` maps a specialization key to
    the ``CompiledKernel`` (or, while an async compile runs, a future: skipped)."""
    out: dict[int, Any] = {}
    for fn in jit_functions(modules):
        try:
            caches = list(getattr(fn, "device_caches", {}).values())
        except Exception:
            continue
        for entry in caches:
            cache = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
            if not isinstance(cache, dict):
                continue
            for kernel in list(cache.values()):
                if hasattr(kernel, "metadata"):
                    out[id(kernel)] = kernel
    return out


def kernel_resources(kernel: Any, load: bool = True) -> dict[str, Any]:
    """Name, registers, spills, warps, stages and shared memory of one compiled kernel.

    ``n_regs`` / ``n_spills`` exist once the binary is loaded (first launch); with ``load``
    an unlaunched kernel is loaded here (GPU only; failures leave them ``None``)."""
    meta = getattr(kernel, "metadata", None)
    if load and getattr(kernel, "n_regs", None) is None and getattr(kernel, "module", 1) is None:
        with contextlib.suppress(Exception):  # no GPU, or not loadable: unknown
            kernel._init_handles()

    def field(obj: Any, name: str) -> Any:
        try:
            value = getattr(obj, name, None)
        except Exception:
            return None
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    return {
        "name": field(meta, "name"),
        "n_regs": field(kernel, "n_regs"),
        "n_spills": field(kernel, "n_spills"),
        "num_warps": field(meta, "num_warps"),
        "num_stages": field(meta, "num_stages"),
        "shared": field(meta, "shared"),
    }


def resources_text(resources: list[dict[str, Any]], key: str) -> str:
    """``'128'``, ``'96/128'`` (several variants) or ``'-'`` (unknown) for one field."""
    values = sorted({r[key] for r in resources if r.get(key) is not None})
    return "/".join(str(v) for v in values) if values else "-"


class KernelWatch:
    """``with KernelWatch(modules) as w: call()`` -> ``w.resources``: the kernels the call
    compiled (new cache entries), with their registers and spills. Never raises."""

    def __init__(self, modules: Iterable[ModuleType]) -> None:
        self.modules = list(modules)
        self.before: dict[int, Any] = {}
        self.resources: list[dict[str, Any]] = []

    def __enter__(self) -> KernelWatch:
        try:
            self.before = compiled_kernels(self.modules)
        except Exception:
            self.before = {}
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            after = compiled_kernels(self.modules)
            self.resources = [kernel_resources(k) for i, k in after.items() if i not in self.before]
        except Exception:
            self.resources = []

    def text(self) -> dict[str, str]:
        """``{'n_regs': ..., 'n_spills': ...}`` as printable strings."""
        return {k: resources_text(self.resources, k) for k in ("n_regs", "n_spills")}
