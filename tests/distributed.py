"""Run a function on a real gloo process group (loopback) from a test.

    results = run_gloo(2, _worker, arg1, arg2)   # [rank0_result, rank1_result]

``fn(rank, world_size, *args)`` runs in a spawned process after the group is up; its return
value (anything picklable; tensors are fine) comes back in rank order. An exception on any
rank fails the test with that rank's traceback. Workers must be module-level functions.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            buffer = io.BytesIO()  # plain bytes: tensors must not travel as shared memory
            torch.save(fn(rank, world_size, *args), buffer)
            queue.put((rank, True, buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, False, traceback.format_exc()))


def run_gloo(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Spawn ``world_size`` ranks on gloo, run ``fn`` on each, return the results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
