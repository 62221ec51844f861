"""Sweep overlap settings: GEMM configs x message sizes x collectives (x chunks, priorities).

The library side of sweeps, everything that needs neither the application nor matplotlib:
:func:`config_grid` and :func:`sweep_points` build the grid, :func:`run_sweep` measures every
point with :func:`cokit.overlap.measure.measure` (every rank of a group runs the same points in
the same order), one row (a dict) per point; :class:`SweepProgress` prints a line per finished
point; :func:`rows_csv` / :func:`rows_json` serialize the rows, :func:`sweep_meta` describes a
run and :func:`summary` is the printed table. Launching ranks, writing files, telemetry and
the plots are the application's (:mod:`cokit.sweeps`, ``cokit sweep``).

A point's GEMM is square, ``size x size x size``; its message is the ``size x size`` product
(all-reduce, reduce-scatter, or the gathered operand for all-gather; ``emulated`` is the
one-GPU copy of :class:`cokit.overlap.emulate.EmulatedComm` of that many bytes). On CPU the
occupancy knobs of the config (num_warps, smem_bytes, num_sms) do not change anything (the
GEMM runs on torch or the interpreter): they are recorded, and rows say so.

Every row also carries the GEMM config's occupancy (``blocks_per_sm``, ``limiter``,
``smem_per_block``, ``reserved_sms``, and ``occupancy_source`` saying where they come from):
on a GPU from the compiled kernel and the live device's limits (:mod:`cokit.triton_kernels.
compile_cache`), on CPU ``None`` (no SM is occupied there; ``reserved_sms`` too). And every
measured row is checked against the physical bounds of overlap (:func:`bound_violations`):
``T_ovl`` can be no shorter than compute alone or communication alone, so the speedup can be
no larger than the ideal ``(T_comp + T_comm) / max(T_comp, T_comm)``. A row that breaks them
is timing noise: its ``noise`` column says why, and :func:`best_row` never picks it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

import torch

from cokit.triton_kernels.gemm_config import GemmConfig, parse_dtype

__all__ = [
    "CPU_OCCUPANCY",
    "NOISE_RULE",
    "OCCUPANCY_FIELDS",
    "SWEEP_COLLECTIVES",
    "SweepPoint",
    "SweepProgress",
    "best_row",
    "bound_violations",
    "check_point",
    "config_grid",
    "describe_point",
    "flag_noise",
    "point_occupancy",
    "rows_csv",
    "rows_json",
    "run_sweep",
    "summary",
    "sweep_meta",
    "sweep_points",
]

SWEEP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "emulated")
CPU_NOTE = (
    "CPU run: GemmConfig occupancy knobs (num_warps, num_stages, smem_bytes, num_sms) and stream "
    "priority are recorded but have no effect on the torch/gloo path; only size, chunks and the "
    "collective change what runs"
)
#: the occupancy columns of a row (the names of telemetry's ``kernels`` entries)
OCCUPANCY_FIELDS = ("blocks_per_sm", "limiter", "smem_per_block", "reserved_sms")
CPU_OCCUPANCY = "none: CPU run (the GEMM runs torch code; there is no SM to occupy)"
#: what the ``noise`` column means (written into a sweep's metadata)
NOISE_RULE = (
    "a row is flagged as noise (column 'noise' holds the reasons) when its median overlapped time "
    "T_ovl is below compute alone or communication alone, i.e. its speedup exceeds the ideal bound "
    "(T_comp + T_comm) / max(T_comp, T_comm); flagged rows are never chosen as best"
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the config as :meth:`GemmConfig.to_dict`): what spawned ranks get."""
        return {
            "collective": self.collective,
            "size": self.size,
            "chunks": self.chunks,
            "config": self.config.to_dict(),
            "priority": self.priority,
            "comm_sms": self.comm_sms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepPoint:
        """The point :meth:`to_dict` described."""
        return cls(
            d["collective"],
            d["size"],
            d["chunks"],
            GemmConfig.from_dict(d["config"]),
            d["priority"],
            d["comm_sms"],
        )


def config_grid(
    base: GemmConfig,
    *,
    num_warps: Sequence[int] | None = None,
    smem_bytes: Sequence[int | None] | None = None,
    num_sms: Sequence[int | None] | None = None,
    device: torch.device | str = "cpu",
    limits: Any = None,
    dtype: torch.dtype | None = None,
) -> list[GemmConfig]:
    """``base`` with every combination of ``num_warps`` x ``smem_bytes`` x ``num_sms`` (None:
    the base's value; a ``num_sms`` makes the GEMM persistent on that many SMs, None keeps the
    base's form), each validated for the GEMM path ``device`` runs (and ``limits``/``dtype``
    when given): ``ValueError`` naming the config that does not fit, before anything runs."""
    from .schedules import _config_backend

    backend = _config_backend(torch.device(device))
    out = []
    for w in num_warps or [base.num_warps]:
        for s in smem_bytes or [base.smem_bytes]:
            for n in num_sms or [base.num_sms]:
                cfg = base.replace(
                    num_warps=w, smem_bytes=s, num_sms=n, persistent=n is not None or base.persistent
                )
                try:
                    cfg.validate(backend, limits, dtype=dtype)
                except ValueError as exc:
                    raise ValueError(f"config {cfg.spec()}: {exc}") from None
                out.append(cfg)
    return out


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


def bound_violations(row: dict[str, Any]) -> list[str]:
    """Why a measured row breaks the physical bounds of overlap (empty when it does not, or
    when it has no times): ``T_ovl`` below compute alone or communication alone, or a
    speedup above the ideal bound ``(T_comp + T_comm) / max(T_comp, T_comm)``. The times are
    the row's medians (``compute_ms``, ``communicate_ms``, ``overlapped_ms``)."""
    try:
        tc, tm, to = (float(row[k]) for k in ("compute_ms", "communicate_ms", "overlapped_ms"))
    except (KeyError, TypeError, ValueError):
        return []
    if not all(math.isfinite(v) and v > 0 for v in (tc, tm, to)):
        return []
    out = []
    bound = (tc + tm) / max(tc, tm)
    speedup = row.get("speedup")
    speedup = (tc + tm) / to if speedup is None else float(speedup)
    if speedup > bound:
        out.append(f"speedup {speedup:.3f} above the ideal bound {bound:.3f}")
    if to < tc:
        out.append(f"T_ovl {to:.3f} ms below compute alone {tc:.3f} ms")
    if to < tm:
        out.append(f"T_ovl {to:.3f} ms below communication alone {tm:.3f} ms")
    return out


def flag_noise(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set every row's ``noise`` column: the reasons of :func:`bound_violations` joined by
    '; ', or '' for a physical row (rows change in place; returned as a list)."""
    out = list(rows)
    for r in out:
        r["noise"] = "; ".join(bound_violations(r))
    return out


def best_row(rows: Iterable[dict[str, Any]], key: str = "speedup") -> dict[str, Any] | None:
    """The row with the largest ``key`` among those that ran and respect the physical
    bounds (checked here, whatever their ``noise`` column says); None when there is none."""
    ok = [
        r
        for r in rows
        if not r.get("error") and r.get(key) is not None and not r.get("noise") and not bound_violations(r)
    ]
    return max(ok, key=lambda r: float(r[key])) if ok else None


def point_occupancy(config: GemmConfig, limits: Any, dtype: torch.dtype | str) -> dict[str, Any]:
    """The occupancy columns of a config: from the compiled kernel (compile cache) and the
    live GPU's ``limits``; with ``limits=None`` (CPU) every column is None and
    ``occupancy_source`` says so. A config whose kernel cannot be read gives None columns
    and the reason in ``occupancy_source``."""
    from cokit.triton_kernels.compile_cache import gemm_occupancy_cached

    from .guard import reserved_sms

    if limits is None:
        return {**dict.fromkeys(OCCUPANCY_FIELDS), "occupancy_source": CPU_OCCUPANCY}
    row: dict[str, Any] = {**dict.fromkeys(OCCUPANCY_FIELDS), "reserved_sms": reserved_sms(config, limits)}
    try:
        occ, facts, _ = gemm_occupancy_cached(config, None, dtype)
    except Exception as exc:  # recorded in the row; the sweep still measures the point
        row["occupancy_source"] = f"none: {type(exc).__name__}: {exc}"[:200]
        return row
    row.update(
        blocks_per_sm=occ.blocks_per_sm,
        limiter=occ.limiting,
        smem_per_block=occ.shared_bytes,
        occupancy_source=f"compiled kernel ({facts.registers} regs/thread) on {limits.name}",
    )
    return row


# ---------------------------------------------------------------------- progress and records
def describe_point(row: dict[str, Any]) -> str:
    """A short name of a row's setting: collective, size, chunks and the config knobs."""
    knobs = " ".join(
        f"{k}={'none' if row.get(k) is None else row.get(k)}"
        for k in ("num_warps", "smem_bytes", "num_sms")
        if k in row
    )
    extra = f" comm_sms={row['comm_sms']}" if row.get("comm_sms") is not None else ""
    return (
        f"{row.get('collective')} size={row.get('size')} chunks={row.get('chunks')} {knobs} "
        f"prio={row.get('priority')}{extra}"
    )


class SweepProgress:
    """The ``progress`` callback of :func:`run_sweep`: one line per finished point,
    ``[n/N] <setting> ... x.xx ms (eta 12 s)``, flushed at once.

    The time is the point's median overlapped time and its speedup; a point flagged as noise
    or failed says so on its line. ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(
        self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if total < 1:
            raise ValueError(f"total={total!r} is invalid; allowed: an integer >= 1")
        self.total = total
        self.stream = stream
        self.clock = clock
        self.start = clock()

    def line(self, i: int, row: dict[str, Any]) -> str:
        """The progress line of point ``i`` (from 0) that just finished."""
        n = i + 1
        elapsed = self.clock() - self.start
        if row.get("error"):
            result = f"error: {row['error']}"
        else:
            t = row.get("overlapped_ms")
            result = "-" if t is None else f"{float(t):.2f} ms"
            if row.get("speedup") is not None:
                result += f", speedup {float(row['speedup']):.3f}"
            if row.get("noise"):
                result += f" [NOISE: {row['noise']}]"
        left = self.total - n
        when = f"eta {elapsed / n * left:.0f} s" if left else f"total {elapsed:.0f} s"
        return f"[{n}/{self.total}] {describe_point(row)} ... {result} ({when})"

    def __call__(self, i: int, row: dict[str, Any]) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        print(self.line(i, row), file=stream, flush=True)


def rows_csv(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as CSV text (the union of their keys as columns, first-seen order; None as '')."""
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return buf.getvalue()


def rows_json(rows: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> str:
    """``{"meta": ..., "rows": [...]}`` as JSON text."""
    return json.dumps({"meta": meta or {}, "rows": list(rows)}, indent=1, default=str)


def sweep_meta(
    rows: Sequence[dict[str, Any]],
    *,
    world_size: int,
    backend: str,
    gpu: bool,
    dtype: torch.dtype | str,
    repeats: int,
    warmup: int,
    seconds: float,
) -> dict[str, Any]:
    """What a sweep's record says about its run: ranks, backend, device, dtype, rounds, torch,
    its duration, where the occupancy columns come from, the noise rule and how many rows
    (rank 0's, every rank's) it flagged."""
    return {
        "world_size": world_size,
        "backend": backend,
        "device": "gpu" if gpu else "cpu",
        "dtype": str(dtype),
        "repeats": repeats,
        "warmup": warmup,
        "torch": torch.__version__,
        "seconds": round(seconds, 2),
        "occupancy": (
            "from each config's compiled kernel on the live GPU (compile cache), see occupancy_source"
            if gpu
            else CPU_OCCUPANCY
        ),
        "noise_rule": NOISE_RULE,
        "noise_rows": {
            "rank0": sum(1 for r in rows if r.get("noise") and r.get("rank", 0) == 0),
            "all_ranks": sum(1 for r in rows if r.get("noise")),
        },
    }


#: the columns of :func:`summary` (row key, header)
SUMMARY_COLUMNS = (
    ("collective", "collective"),
    ("size", "size"),
    ("chunks", "chunks"),
    ("num_warps", "warps"),
    ("smem_bytes", "smem"),
    ("num_sms", "sms"),
    ("priority", "prio"),
    ("compute_ms", "T_comp"),
    ("communicate_ms", "T_comm"),
    ("sequential_ms", "T_seq_meas"),
    ("overlapped_ms", "T_ovl"),
    ("speedup", "speedup"),
    ("comm_hidden", "hidden"),
    ("compute_slowdown", "slowdown"),
    ("blocks_per_sm", "blk/SM"),
    ("limiter", "limiter"),
    ("noise", "flag"),
)


def summary(rows: Sequence[dict[str, Any]], rank: int = 0) -> str:
    """Rank ``rank``'s rows as the printed table (medians in ms), then each error, each point
    flagged as noise with its reasons, and the best point within the physical bounds
    (:func:`best_row`) or that there is none."""

    def cell(k: str, v: object) -> str:
        if k == "noise":
            return "NOISE" if v else ""
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None or v == "" else str(v)

    table = [[h for _, h in SUMMARY_COLUMNS]] + [
        [cell(k, r.get(k)) for k, _ in SUMMARY_COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(SUMMARY_COLUMNS))]
    lines = [f"rank {rank} (times: medians in ms; T_seq_meas = both run back to back, unchunked):"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    for r in rows:
        if r.get("error"):
            lines.append(f"  error at {r['collective']} size {r['size']} chunks {r['chunks']}: {r['error']}")
    noisy = [r for r in rows if r.get("noise")]
    if noisy:
        lines.append(
            f"NOISE: {len(noisy)} point(s) break the physical bounds of overlap (timing noise; never 'best'):"
        )
        lines += [f"  {describe_point(r)}: {r['noise']}" for r in noisy]
    best = best_row(rows)
    if best is not None:
        lines.append(
            f"best within the physical bounds: {describe_point(best)}, speedup {float(best['speedup']):.3f}"
        )
    elif any(not r.get("error") for r in rows):
        lines.append("no point within the physical bounds: no best point")
    return "\n".join(lines)


# ---------------------------------------------------------------------- measurement
def run_sweep(
    points: Iterable[SweepPoint],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str = torch.float32,
    repeats: int = 3,
    warmup: int = 1,
    group: Any = None,
    progress: Callable[[int, dict[str, Any]], Any] | None = None,
) -> list[dict[str, Any]]:
    """Measure every point; one flat row each (times, metrics, config fields, occupancy,
    ``noise`` flags, notes).

    Collective points need ``torch.distributed`` initialized (all ranks call with the same
    points). A point that fails (e.g. a config that does not fit) gives a row with ``error``.
    ``progress(i, row)`` is called as each point finishes (``i`` counts from 0).
    """
    import torch.distributed as dist

    from cokit.triton_kernels.backend import cached_device_limits

    from .streams import _device

    device = _device(device)
    dt = parse_dtype(dtype)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    points = list(points)
    for p in points:
        check_point(p, world)
    limits = cached_device_limits(device) if device.type == "cuda" else None
    occupancies: dict[GemmConfig, dict[str, Any]] = {}
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
        if p.config not in occupancies:
            occupancies[p.config] = point_occupancy(p.config, limits, dt)
        row.update(occupancies[p.config])
        row["noise"] = "; ".join(bound_violations(row))
        rows.append(row)
        if progress is not None:
            progress(i, row)
    return rows
