"""One timer for every benchmark: median milliseconds of a callable.

On a GPU, ``triton.testing.do_bench`` (CUDA events, warm-up, cache flush); on a CPU, the
median of a few ``perf_counter`` samples after one warm-up call.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_ms(fn: Callable[[], Any], on_gpu: bool, quick: bool = False) -> float:
    """Median time of ``fn`` in milliseconds."""
    if on_gpu:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 200, return_mode="median"))
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
