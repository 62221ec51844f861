"""Sweep overlap settings: GEMM configs x message sizes x collectives (x chunks, priorities).

:func:`sweep_points` builds the grid, :func:`run_sweep` measures every point with
:func:`cokit.overlap.measure.measure` (every rank of a group runs the same points in the same
order), :func:`write_csv` / :func:`write_json` record the rows, and the plots are
speedup heatmaps (:func:`plot_heatmap`: over num_warps x smem_bytes, reserved SMs x message
size, chunks x message size) and a timeline-style bar chart of one point
(:func:`plot_timeline`). :func:`sweep_main` is what ``cokit sweep`` runs.

A point's GEMM is square, ``size x size x size``; its message is the ``size x size`` product
(all-reduce, reduce-scatter, or the gathered operand for all-gather; ``emulated`` is the
one-GPU copy of :class:`cokit.overlap.emulate.EmulatedComm` of that many bytes). On CPU the
occupancy knobs of the config (num_warps, smem_bytes, num_sms) do not change anything (the
GEMM runs on torch or the interpreter): they are recorded, and rows say so.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from cokit.triton_kernels.gemm_configs import GemmConfig, parse_dtype

__all__ = [
    "SWEEP_COLLECTIVES",
    "SweepPoint",
    "check_point",
    "plot_heatmap",
    "plot_timeline",
    "run_sweep",
    "sweep_main",
    "sweep_points",
    "write_csv",
    "write_json",
]

SWEEP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "emulated")
CPU_NOTE = ("CPU run: GemmConfig occupancy knobs (num_warps, num_stages, smem_bytes, num_sms) and stream "
            "priority are recorded but have no effect on the torch/gloo path; only size, chunks and the "
            "collective change what runs")


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
        return {"collective": self.collective, "size": self.size, "chunks": self.chunks,
                "num_warps": c.num_warps, "num_stages": c.num_stages, "BLOCK_M": c.BLOCK_M, "BLOCK_N": c.BLOCK_N,
                "BLOCK_K": c.BLOCK_K, "persistent": c.persistent, "num_sms": c.num_sms, "smem_bytes": c.smem_bytes,
                "priority": self.priority, "comm_sms": self.comm_sms, "config_spec": c.spec()}


def sweep_points(
    configs: Sequence[GemmConfig],
    sizes: Sequence[int],
    collectives: Sequence[str],
    chunks: Sequence[int] = (2,),
    priorities: Sequence[str | int] = ("high",),
    comm_sms: Sequence[int | None] = (None,),
) -> list[SweepPoint]:
    """The product of the axes, validated (clear errors for bad values)."""
    for name, seq in (("configs", configs), ("sizes", sizes), ("collectives", collectives), ("chunks", chunks),
                      ("priorities", priorities), ("comm_sms", comm_sms)):
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
    for col, size, ch, cfg, prio, sms in itertools.product(collectives, sizes, chunks, configs, priorities, comm_sms):
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
        raise ValueError(f"collective {point.collective!r} needs a process group of >= 2 ranks (world size {W}); "
                         "use 'emulated' on one device")
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
        return GemmCollective(rand(S, S), rand(S, S), collective=point.collective, chunks=point.chunks,
                              config=cfg, priority=point.priority, group=group)
    if point.collective == "all_gather":
        return AllGatherGemm(rand(S // world, S), rand(S, S), operand="a", chunks=point.chunks, config=cfg,
                             priority=point.priority, group=group)
    a, b = rand(S, S), rand(S, S)
    out = torch.empty(S, S, device=device, dtype=dtype)
    comm = EmulatedComm(S * S * torch.empty((), dtype=dtype).element_size(), device, n_sms=point.comm_sms)
    ov = Overlap(lambda: gemm(a, b, config=cfg, out=out), comm, device=device, priority=point.priority,
                 config=cfg, label="gemm+emulated")
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
    dtype = parse_dtype(dtype)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    points = list(points)
    for p in points:
        check_point(p, world)
    limits = cached_device_limits(device) if device.type == "cuda" else None
    rows = []
    for i, p in enumerate(points):
        row: dict[str, Any] = {**p.fields(), "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
        if device.type == "cpu":
            row["note"] = CPU_NOTE
        try:
            wl = _workload(p, device, dtype, group, world, seed=1000 + i)
            res = wl.measure(repeats=repeats, warmup=warmup)
            row.update({k: v for k, v in res.flat().items() if k not in row})
            close = getattr(getattr(wl, "communicate", None), "close", None)
            if close is not None:
                close()
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the sweep goes on
            if dist.is_available() and dist.is_initialized() and world > 1:
                raise  # ranks would fall out of step: stop everywhere
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["reserved_sms"] = reserved_sms(p.config, limits) if limits is not None else 0
        rows.append(row)
        if progress is not None:
            progress(i, row)
    return rows


# ---------------------------------------------------------------------- records
def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Rows to CSV (the union of their keys as columns, first-seen order)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return path


def write_json(rows: Sequence[dict[str, Any]], path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    """``{"meta": ..., "rows": [...]}`` as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta or {}, "rows": list(rows)}, indent=1, default=str))
    return path


# ---------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | os.PathLike) -> Path:
    """Write a figure as PNG (creating the folder) and close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _key(v: Any) -> tuple:
    return (0, v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, str(v))


def plot_heatmap(
    rows: Sequence[dict[str, Any]],
    x: str,
    y: str,
    path: str | os.PathLike,
    *,
    value: str = "speedup",
    title: str | None = None,
) -> Path:
    """A heatmap of ``value`` over the ``x`` and ``y`` fields of ``rows`` (PNG). Cells with
    several rows (other axes varying) show their median; rows with errors are skipped."""
    plt = _plt()
    ok = [r for r in rows if not r.get("error") and r.get(value) is not None]
    if not ok:
        raise ValueError(f"no successful rows with {value!r} to plot")
    xs = sorted({str(r.get(x)) if r.get(x) is None else r.get(x) for r in ok}, key=_key)
    ys = sorted({str(r.get(y)) if r.get(y) is None else r.get(y) for r in ok}, key=_key)
    cells: dict[tuple, list[float]] = {}
    for r in ok:
        kx = str(r.get(x)) if r.get(x) is None else r.get(x)
        ky = str(r.get(y)) if r.get(y) is None else r.get(y)
        cells.setdefault((kx, ky), []).append(float(r[value]))
    grid = [[statistics.median(cells[(vx, vy)]) if (vx, vy) in cells else float("nan") for vx in xs] for vy in ys]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.1 * len(xs)), max(3.0, 1.4 + 0.7 * len(ys))))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30)
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    for j, row in enumerate(grid):
        for i, v in enumerate(row):
            if v == v:
                ax.text(i, j, f"{v:.2f}", ha="center", va="center", color="white", fontsize=8)
    emulated = any(r.get("emulated") for r in ok)
    label = title or f"{value} over {x} x {y}"
    if emulated:
        label += " [EMULATED comm]"
    if any(str(r.get("device", "")).startswith("cpu") for r in ok):
        label += " [CPU]"
    ax.set_title(label + ("\n(median over other axes)" if any(len(v) > 1 for v in cells.values()) else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label=value)
    return _save(plt, fig, path)


def plot_timeline(row: dict[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Timeline-style bars of one row: compute and communication alone, back to back
    (T_seq), overlapped (measured, with compute under overlap), and the ideal."""
    plt = _plt()
    need = ("compute_ms", "communicate_ms", "overlapped_ms")
    if any(row.get(k) is None for k in need):
        raise ValueError(f"row lacks {', '.join(k for k in need if row.get(k) is None)}; it needs {', '.join(need)}")
    tc, tm, to = row["compute_ms"], row["communicate_ms"], row["overlapped_ms"]
    tu = row.get("compute_under_overlap_ms") or tc
    comm_name = "EMULATED comm" if row.get("emulated") else "communication"
    fig, ax = plt.subplots(figsize=(9, 3.2))
    lanes = [
        ("sequential (T_comp+T_comm)", [(0, tc, "tab:blue", "compute (alone)"),
                                        (tc, tm, "tab:orange", f"{comm_name} (alone)")]),
        ("overlapped (measured)", [(0, tu, "tab:blue", "compute under overlap"), (0, tm, "tab:orange", None),
                                   (0, to, "none", None)]),
        ("ideal max(T_comp, T_comm)", [(0, max(tc, tm), "tab:gray", "ideal")]),
    ]
    for lane, (name, bars) in enumerate(lanes):
        for start, width, color, lab in bars:
            if color == "none":
                ax.barh(lane, width, left=start, height=0.7, fill=False, edgecolor="black", linewidth=1.5,
                        label="T_ovl (measured)")
                continue
            h = 0.3 if name.startswith("overlapped") else 0.6
            off = (0.17 if color == "tab:blue" else -0.17) if name.startswith("overlapped") else 0
            ax.barh(lane + off, width, left=start, height=h, color=color, label=lab)
    ax.set_yticks(range(len(lanes)), [n for n, _ in lanes])
    ax.set_xlabel("ms (medians)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    knobs = ", ".join(f"{k}={row.get(k)}" for k in ("num_warps", "smem_bytes", "num_sms", "priority")
                      if row.get(k) not in (None, ""))
    desc = title or (f"{row.get('collective', '')}, size {row.get('size', '')}, chunks {row.get('chunks', '')}, "
                     f"{knobs}\nspeedup {row.get('speedup', float('nan')):.3f} (T_comp+T_comm)/T_ovl")
    if str(row.get("device", "")).startswith("cpu"):
        desc += " [CPU]"
    ax.set_title(desc, fontsize=8)
    return _save(plt, fig, path)


def default_plots(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """The plots that mean something for these rows: num_warps x smem_bytes and reserved
    SMs x message size when those axes vary, chunks x message size per collective, and the
    timeline of the best point (rank 0's rows)."""
    out_dir = Path(out_dir)
    rows = [r for r in rows if r.get("rank", 0) == 0 and not r.get("error")]
    if not rows:
        return []

    def varies(k: str) -> bool:
        return len({str(r.get(k)) for r in rows}) > 1

    paths = []
    if varies("num_warps") or varies("smem_bytes"):
        paths.append(plot_heatmap(rows, "num_warps", "smem_bytes", out_dir / "heatmap_warps_smem.png"))
    if varies("reserved_sms") or varies("comm_sms"):
        axis = "reserved_sms" if varies("reserved_sms") else "comm_sms"
        paths.append(plot_heatmap(rows, "message_bytes", axis, out_dir / f"heatmap_{axis}_message.png"))
    for col in sorted({r["collective"] for r in rows}):
        sel = [r for r in rows if r["collective"] == col]
        paths.append(plot_heatmap(sel, "message_bytes", "chunks", out_dir / f"heatmap_chunks_message_{col}.png",
                                  title=f"speedup, {col}: chunks x message bytes"))
    best = max(rows, key=lambda r: r.get("speedup") or 0.0)
    paths.append(plot_timeline(best, out_dir / "timeline_best.png"))
    return paths


# ---------------------------------------------------------------------- entry (all ranks)
def _sweep_worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawned rank: rebuild the points and run them (module-level for pickling)."""
    from .launch import local_device

    device = local_device(spec["device"])
    points = [SweepPoint(p["collective"], p["size"], p["chunks"], GemmConfig.from_dict(p["config"]), p["priority"],
                         p["comm_sms"]) for p in spec["points"]]
    return run_sweep(points, device=device, dtype=spec["dtype"], repeats=spec["repeats"], warmup=spec["warmup"])


def sweep_main(
    points: Sequence[SweepPoint],
    *,
    world_size: int,
    backend: str,
    dtype: str = "fp32",
    repeats: int = 3,
    warmup: int = 1,
    device: str | None = None,
) -> list[dict[str, Any]] | None:
    """Run the points on ``world_size`` local ranks (spawned, which inherit this process's
    environment, TRITON_INTERPRET included; in-process for 1 rank) or, under torchrun, on the
    ranks torchrun started (``world_size`` ignored). Returns every rank's rows in rank order;
    under torchrun they are gathered on rank 0 and the other ranks get ``None``."""
    from .launch import in_torchrun, run

    if world_size == 1 and not in_torchrun():
        return run_sweep(points, device=device, dtype=dtype, repeats=repeats, warmup=warmup)
    spec = {"device": "cuda" if backend == "nccl" else "cpu", "dtype": dtype, "repeats": repeats, "warmup": warmup,
            "points": [{"collective": p.collective, "size": p.size, "chunks": p.chunks, "config": p.config.to_dict(),
                        "priority": p.priority, "comm_sms": p.comm_sms} for p in points]}
    per_rank = run(world_size, _sweep_worker, spec, device=spec["device"])
    return None if per_rank is None else [row for rows in per_rank for row in rows]
