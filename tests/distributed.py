"""Run a function on a real gloo process group (loopback) from a test.

    results = run_gloo(2, _worker, arg1, arg2)   # [rank0_result, rank1_result]

``fn(rank, world_size, *args)`` runs in a spawned process after the group is up; its return
value (anything picklable; tensors are fine) comes back in rank order. An exception on any
rank fails the test with that rank's traceback. Workers must be module-level functions.
Children start with ``TRITON_INTERPRET=1`` like the tests; a worker may switch to the torch
path by setting it to ``0`` (kernel paths are chosen per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cokit.launch import spawn


def run_gloo(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Spawn ``world_size`` ranks on gloo, run ``fn`` on each, return the results by rank."""
    try:
        return spawn(world_size, fn, *args, backend="gloo", timeout=timeout, env={"TRITON_INTERPRET": "1"})
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError(str(exc)) from None
