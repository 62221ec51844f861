"""Run a function on every rank of a local process group (loopback), or in the current one.

Used by ``cokit sweep`` and the benchmarks: under ``torchrun`` (``RANK``/``WORLD_SIZE`` in
the environment) the group is initialized from the environment; otherwise ``world_size``
processes are spawned on this machine (gloo on CPU, NCCL/RCCL with one GPU per rank).
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch

__all__ = ["free_port", "in_torchrun", "spawn"]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_torchrun() -> bool:
    """True when launched by torchrun (the environment names this process's rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _entry(rank: int, world_size: int, port: int, backend: str, threads: int, fn: Callable, args: tuple, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, **kwargs)
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def spawn(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", timeout: float = 900.0) -> list[Any]:
    """Spawn ``world_size`` ranks on ``backend``, run ``fn(rank, world_size, *args)`` on each
    (a module-level function), return the results in rank order; a failing rank raises
    ``RuntimeError`` with its traceback. Each rank gets ``cpu_count // world_size`` threads."""
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; allowed: an integer >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is invalid; allowed: gloo, nccl")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs {world_size} GPUs here; found {torch.cuda.device_count()}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, threads, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
