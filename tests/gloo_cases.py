"""Run several gloo scenarios in ONE spawned world: the process start-up is paid once.

    cases = [Case("plain", _train, (2,)), Case("nan on rank 1", _train, (2, 1))]
    results = run_cases(4, cases)      # {"plain": [rank0, rank1, ...], "nan on rank 1": [...]}

Each case is ``fn(rank, world_size, *args)`` on every rank, run in the given order with a
barrier between cases, so a case starts only when every rank has finished the one before and
each case builds its own models, optimizers and groups. Spawning a world costs seconds per
rank (every rank imports torch); most of these scenarios need a fraction of that. An exception
in a case fails the run with that case's name, the rank and its traceback. Workers must be
module-level functions (they are pickled to the ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import run_gloo


@dataclass(frozen=True)
class Case:
    """One scenario: ``fn(rank, world_size, *args)`` on every rank, its result kept as ``name``."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = field(default=())


def _run_all(rank: int, world: int, cases: Sequence[Case]) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case.name] = case.fn(rank, world, *case.args)
        except BaseException as exc:
            raise RuntimeError(
                f"case {case.name!r} failed on rank {rank}: {type(exc).__name__}: {exc}"
            ) from exc
        dist.barrier()
    return out


def run_cases(world_size: int, cases: Sequence[Case], *, timeout: float = 600.0) -> dict[str, list[Any]]:
    """Run ``cases`` in order in one gloo world of ``world_size`` ranks; each case's results by rank."""
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"run_cases: case names must be unique, got {names}")
    by_rank = run_gloo(world_size, _run_all, list(cases), timeout=timeout)
    return {name: [r[name] for r in by_rank] for name in names}
