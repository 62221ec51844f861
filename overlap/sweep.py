"""Sweep overlap settings: GEMM configs x message sizes x collectives (x chunks, priorities).

:func:`sweep_points` builds the grid and :func:`run_sweep` measures every point with
:func:`cokit.overlap.measure.measure` (every rank of a group runs the same points in the same
order), one row (a dict) per point. Launching ranks, CSV/JSON records and plots are the
application's (:mod:`cokit.sweeps`, ``cokit sweep``).

A point's GEMM is square, ``size x size x size``; its message is the ``size x size`` product
(all-reduce, reduce-scatter, or the gathered operand for all-gather; ``emulated`` is the
one-GPU copy of :class:`cokit.overlap.emulate.EmulatedComm` of that many bytes). On CPU the
occupancy knobs of the config (num_warps, smem_bytes, num_sms) do not change anything (the
GEMM runs on torch or the interpreter): they are recorded, and rows say so.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from cokit.triton_kernels.gemm_config import GemmConfig, parse_dtype

__all__ = [
    "SWEEP_COLLECTIVES",
    "SweepPoint",
    "check_point",
    "run_sweep",
    "sweep_points",
]

SWEEP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "emulated")
CPU_NOTE = (
    "CPU run: GemmConfig occupancy knobs (num_warps, num_stages, smem_bytes, num_sms) and stream "
    "priority are recorded but have no effect on the torch/gloo path; only size, chunks and the "
    "collective change what runs"
)


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One measured setting."""

    collective: str
    size: int
    chunks: int
    config: GemmConfig
    priority: str | int = "high"
    comm_sms: int | None = None  # emulated copy kernel only: SMs it runs on

    def fields(self) -> dict[str, Any]:
        """Flat description (CSV-ready)."""
        c = self.config
        return {
            "collective": self.collective,
            "size": self.size,
            "chunks": self.chunks,
            "num_warps": c.num_warps,
            "num_stages": c.num_stages,
            "BLOCK_M": c.BLOCK_M,
            "BLOCK_N": c.BLOCK_N,
            "BLOCK_K": c.BLOCK_K,
            "persistent": c.persistent,
            "num_sms": c.num_sms,
            "smem_bytes": c.smem_bytes,
            "priority": self.priority,
            "comm_sms": self.comm_sms,
            "config_spec": c.spec(),
        }


def sweep_points(
    configs: Sequence[GemmConfig],
    sizes: Sequence[int],
    collectives: Sequence[str],
    chunks: Sequence[int] = (2,),
    priorities: Sequence[str | int] = ("high",),
    comm_sms: Sequence[int | None] = (None,),
) -> list[SweepPoint]:
    """The product of the axes, validated (clear errors for bad values)."""
    for name, seq in (
        ("configs", configs),
        ("sizes", sizes),
        ("collectives", collectives),
        ("chunks", chunks),
        ("priorities", priorities),
        ("comm_sms", comm_sms),
    ):
        if len(seq) == 0:
            raise ValueError(f"{name} is empty; give at least one value")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"size {s!r} is invalid; allowed: an integer >= 1")
    for c in chunks:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"chunks {c!r} is invalid; allowed: an integer >= 1")
    for col in collectives:
        if col not in SWEEP_COLLECTIVES:
            raise ValueError(f"collective {col!r} is invalid; allowed: {', '.join(SWEEP_COLLECTIVES)}")
    for cfg in configs:
        if not isinstance(cfg, GemmConfig):
            raise TypeError(f"configs must be GemmConfig objects, got {type(cfg).__name__}")
    out = []
    for col, size, ch, cfg, prio, sms in itertools.product(
        collectives, sizes, chunks, configs, priorities, comm_sms
    ):
        emulated = col == "emulated"  # the emulated copy runs unchunked, on comm_sms SMs
        out.append(SweepPoint(col, size, 1 if emulated else ch, cfg, prio, sms if emulated else None))
    # chunks only varies collective points, comm_sms only emulated ones: drop the duplicates
    seen, unique = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


def check_point(point: SweepPoint, world_size: int) -> None:
    """Raise ``ValueError`` when ``point`` cannot run on ``world_size`` ranks (before anything runs)."""
    S, C, W = point.size, point.chunks, world_size
    if point.collective != "emulated" and W < 2:
        raise ValueError(
            f"collective {point.collective!r} needs a process group of >= 2 ranks (world size {W}); "
            "use 'emulated' on one device"
        )
    if point.collective == "reduce_scatter" and S % (W * C):
        raise ValueError(f"reduce_scatter: size {S} must be divisible by world_size x chunks = {W} x {C}")
    if point.collective == "all_gather":
        if S % W:
            raise ValueError(f"all_gather: size {S} must be divisible by world_size {W}")
        if S // W < C:
            raise ValueError(f"all_gather: {S // W} rows per rank cannot be split into {C} chunks")
    if point.collective == "all_reduce" and S < C:
        raise ValueError(f"all_reduce: size {S} cannot be split into {C} chunks")


def _workload(point: SweepPoint, device: torch.device, dtype: torch.dtype, group: Any, world: int, seed: int):
    from cokit.triton_kernels.gemm import gemm

    from .emulate import EmulatedComm
    from .schedules import AllGatherGemm, GemmCollective, Overlap

    S = point.size
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    cfg = point.config
    if point.collective in ("all_reduce", "reduce_scatter"):
        return GemmCollective(
            rand(S, S),
            rand(S, S),
            collective=point.collective,
            chunks=point.chunks,
            config=cfg,
            priority=point.priority,
            group=group,
        )
    if point.collective == "all_gather":
        return AllGatherGemm(
            rand(S // world, S),
            rand(S, S),
            operand="a",
            chunks=point.chunks,
            config=cfg,
            priority=point.priority,
            group=group,
        )
    a, b = rand(S, S), rand(S, S)
    out = torch.empty(S, S, device=device, dtype=dtype)
    comm = EmulatedComm(S * S * torch.empty((), dtype=dtype).element_size(), device, n_sms=point.comm_sms)
    ov = Overlap(
        lambda: gemm(a, b, config=cfg, out=out),
        comm,
        device=device,
        priority=point.priority,
        config=cfg,
        label="gemm+emulated",
    )
    ov.info.update(M=S, N=S, K=S, chunks=1, message_bytes=comm.nbytes, comm_sms=comm.n_sms)
    return ov


def run_sweep(
    points: Iterable[SweepPoint],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str = torch.float32,
    repeats: int = 3,
    warmup: int = 1,
    group: Any = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Measure every point; one flat row each (times, metrics, config fields, notes).

    Collective points need ``torch.distributed`` initialized (all ranks call with the same
    points). A point that fails (e.g. a config that does not fit) gives a row with ``error``.
    """
    import torch.distributed as dist

    from cokit.triton_kernels.backend import cached_device_limits

    from .guard import reserved_sms
    from .streams import _device

    device = _device(device)
    dt = parse_dtype(dtype)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    points = list(points)
    for p in points:
        check_point(p, world)
    limits = cached_device_limits(device) if device.type == "cuda" else None
    rows = []
    for i, p in enumerate(points):
        row: dict[str, Any] = {**p.fields(), "dtype": str(dt).removeprefix("torch."), "device": str(device)}
        if device.type == "cpu":
            row["note"] = CPU_NOTE
        try:
            wl = _workload(p, device, dt, group, world, seed=1000 + i)
            res = wl.measure(repeats=repeats, warmup=warmup)
            row.update({k: v for k, v in res.flat().items() if k not in row})
            close = getattr(getattr(wl, "communicate", None), "close", None)
            if close is not None:
                close()
        except Exception as exc:  # recorded in the row, the sweep goes on
            if dist.is_available() and dist.is_initialized() and world > 1:
                raise  # ranks would fall out of step: stop everywhere
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["reserved_sms"] = reserved_sms(p.config, limits) if limits is not None else 0
        rows.append(row)
        if progress is not None:
            progress(i, row)
    return rows
