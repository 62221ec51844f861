"""The application side of overlap sweeps (``cokit sweep``, notebook 01): ranks, files,
telemetry and plots. The grid, the measurement, the progress lines, the records' text and the
printed table are the library's (:mod:`cokit.overlap.sweep`).

:func:`sweep_main` runs :func:`cokit.overlap.sweep.run_sweep` on local ranks (spawned) or on
torchrun's ranks, printing a progress line per point
(:class:`~cokit.overlap.sweep.SweepProgress`, rank 0) and writing each rank's telemetry
(:class:`SweepTelemetry`); :func:`write_csv` / :func:`write_json` record the rows
(atomically); the plots are speedup heatmaps (:func:`plot_heatmap`: over num_warps x
smem_bytes, reserved SMs x message size, chunks x message size; each cell shows the median and
the IQR over repeats) and a timeline-style bar chart of one point (:func:`plot_timeline`). Rows flagged as noise (they
break the physical bounds of overlap, see :func:`cokit.overlap.sweep.bound_violations`) are
marked in every plot and never drawn as the best point. Figures are drawn on
:class:`matplotlib.figure.Figure` objects, so writing them never touches pyplot's backend
(inline plots in a notebook keep working); ``*_figure`` functions return them unsaved.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cokit.files import atomic_savefig, atomic_write_text
from cokit.overlap.sweep import (
    SweepPoint,
    SweepProgress,
    best_row,
    bound_violations,
    rows_csv,
    rows_json,
    run_sweep,
)

#: the files ``cokit sweep`` writes into its folder (names and glob patterns): a folder
#: holding any of them holds an earlier sweep's results
OUTPUTS = ("sweep.csv", "sweep.json", "heatmap_*.png", "timeline_best.png")


# ---------------------------------------------------------------------- records
def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Rows to CSV (:func:`~cokit.overlap.sweep.rows_csv`), written atomically."""
    return atomic_write_text(path, rows_csv(rows))


def write_json(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike, meta: dict[str, Any] | None = None
) -> Path:
    """``{"meta": ..., "rows": [...]}`` (:func:`~cokit.overlap.sweep.rows_json`), written atomically."""
    return atomic_write_text(path, rows_json(rows, meta))


# ---------------------------------------------------------------------- plots
def _figure(figsize: tuple[float, float]) -> Any:
    """A figure outside pyplot's state (no backend involved; nothing to close)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _key(v: Any) -> tuple:
    return (0, v) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, str(v))


def _is_noise(r: dict[str, Any]) -> bool:
    return bool(r.get("noise")) or bool(bound_violations(r))


def _cell_key(r: dict[str, Any], axis: str) -> Any:
    v = r.get(axis)
    return str(v) if v is None else v


def heatmap_figure(
    rows: Sequence[dict[str, Any]],
    x: str,
    y: str,
    *,
    value: str = "speedup",
    title: str | None = None,
) -> Any:
    """The heatmap of ``value`` over the ``x`` and ``y`` fields of ``rows`` (a Figure).

    Each cell shows the median of its rows (several when other axes vary) and, below it,
    the IQR over repeats (``<value>_iqr``; the largest of the cell's rows). Rows flagged as
    noise are left out of a cell's value; a cell with only such rows shows their median in
    red, outlined and marked ``noise``, and a cell with some marks their count. Rows with
    errors are skipped. One title (``title`` or a default; CPU / EMULATED tags appended).
    """
    ok = [r for r in rows if not r.get("error") and r.get(value) is not None]
    if not ok:
        raise ValueError(f"no successful rows with {value!r} to plot")
    xs = sorted({_cell_key(r, x) for r in ok}, key=_key)
    ys = sorted({_cell_key(r, y) for r in ok}, key=_key)
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        cells.setdefault((_cell_key(r, x), _cell_key(r, y)), []).append(r)

    def summary(members: list[dict[str, Any]]) -> tuple[float, float | None, int, bool]:
        clean = [r for r in members if not _is_noise(r)]
        use = clean or members
        iqrs = [float(r[f"{value}_iqr"]) for r in use if r.get(f"{value}_iqr") is not None]
        med = statistics.median(float(r[value]) for r in use)
        return med, (max(iqrs) if iqrs else None), len(members) - len(clean), not clean

    stats = {k: summary(v) for k, v in cells.items()}
    nan = float("nan")
    grid = [[stats[(vx, vy)][0] if (vx, vy) in stats else nan for vx in xs] for vy in ys]
    fig = _figure((max(5.5, 1.8 + 1.3 * len(xs)), max(3.4, 1.8 + 0.8 * len(ys))))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30)
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    n_noise = 0
    for j, vy in enumerate(ys):
        for i, vx in enumerate(xs):
            if (vx, vy) not in stats:
                continue
            med, iqr, noisy, only_noise = stats[(vx, vy)]
            n_noise += noisy
            text = f"{med:.2f}" + ("" if iqr is None else f"\nIQR {iqr:.2f}")
            weight = "normal"
            if only_noise:
                text += "\nNOISE"
                weight = "bold"
                ax.add_patch(_cell_outline(i, j))
            elif noisy:
                text += f"\n(+{noisy} noise)"
            ax.text(
                i,
                j,
                text,
                ha="center",
                va="center",
                color="white",
                fontsize=7,
                weight=weight,
                bbox={"facecolor": "black", "alpha": 0.55, "edgecolor": "none", "pad": 1.5},
            )
    label = title or f"{value} over {x} x {y}"
    if any(r.get("emulated") for r in ok):
        label += " [EMULATED comm]"
    if any(str(r.get("device", "")).startswith("cpu") for r in ok):
        label += " [CPU]"
    ax.set_title(label, fontsize=9)
    notes = ["cell: median; IQR over repeats"]
    if any(len(v) > 1 for v in cells.values()):
        notes[0] += " (several rows per cell: median over the other axes, largest IQR)"
    if n_noise:
        notes.append(
            f"{n_noise} row(s) flagged as noise (T_ovl below a part alone) are left out; "
            "hatched red = only noise"
        )
    fig.text(0.01, 0.01, "\n".join(notes), fontsize=6.5, ha="left", va="bottom", color="dimgray")
    fig.colorbar(im, ax=ax, label=value)
    fig.tight_layout(rect=(0, 0.035 * len(notes) + 0.01, 1, 1))
    return fig


def _cell_outline(i: int, j: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(
        (i - 0.5, j - 0.5), 1, 1, fill=False, hatch="//", edgecolor="red", linewidth=2, alpha=0.6
    )


def plot_heatmap(
    rows: Sequence[dict[str, Any]],
    x: str,
    y: str,
    path: str | os.PathLike,
    *,
    value: str = "speedup",
    title: str | None = None,
) -> Path:
    """:func:`heatmap_figure` written as PNG (atomically)."""
    fig = heatmap_figure(rows, x, y, value=value, title=title)
    return atomic_savefig(fig, path, format="png", dpi=100)


def timeline_figure(row: dict[str, Any], *, title: str | None = None) -> Any:
    """Timeline-style bars of one row (a Figure): compute and communication alone, back to
    back (T_seq), overlapped (measured, with compute under overlap), and the ideal. A row
    that breaks the physical bounds is titled NOISE in red, with the reasons."""
    need = ("compute_ms", "communicate_ms", "overlapped_ms")
    if any(row.get(k) is None for k in need):
        raise ValueError(
            f"row lacks {', '.join(k for k in need if row.get(k) is None)}; it needs {', '.join(need)}"
        )
    tc, tm, to = row["compute_ms"], row["communicate_ms"], row["overlapped_ms"]
    tu = row.get("compute_under_overlap_ms") or tc
    comm_name = "EMULATED comm" if row.get("emulated") else "communication"
    fig = _figure((9, 3.4))
    ax = fig.subplots()
    lanes: list[tuple[str, list[tuple[float, float, str, str | None]]]] = [
        (
            "sequential (T_comp+T_comm)",
            [(0, tc, "tab:blue", "compute (alone)"), (tc, tm, "tab:orange", f"{comm_name} (alone)")],
        ),
        (
            "overlapped (measured)",
            [
                (0, tu, "tab:blue", "compute under overlap"),
                (0, tm, "tab:orange", None),
                (0, to, "none", None),
            ],
        ),
        ("ideal max(T_comp, T_comm)", [(0, max(tc, tm), "tab:gray", "ideal")]),
    ]
    for lane, (name, bars) in enumerate(lanes):
        for start, width, color, lab in bars:
            if color == "none":
                ax.barh(
                    lane,
                    width,
                    left=start,
                    height=0.7,
                    fill=False,
                    edgecolor="black",
                    linewidth=1.5,
                    label="T_ovl (measured)",
                )
                continue
            h = 0.3 if name.startswith("overlapped") else 0.6
            off = (0.17 if color == "tab:blue" else -0.17) if name.startswith("overlapped") else 0
            ax.barh(lane + off, width, left=start, height=h, color=color, label=lab)
    ax.set_yticks(range(len(lanes)), [n for n, _ in lanes])
    ax.set_xlabel("ms (medians)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    knobs = ", ".join(
        f"{k}={row.get(k)}"
        for k in ("num_warps", "smem_bytes", "num_sms", "priority")
        if row.get(k) not in (None, "")
    )
    desc = title or (
        f"{row.get('collective', '')}, size {row.get('size', '')}, chunks {row.get('chunks', '')}, "
        f"{knobs}\nspeedup {row.get('speedup', float('nan')):.3f} (T_comp+T_comm)/T_ovl"
    )
    if str(row.get("device", "")).startswith("cpu"):
        desc += " [CPU]"
    reasons = row.get("noise") or "; ".join(bound_violations(row))
    if reasons:
        desc = f"NOISE (not a real result): {reasons}\n{desc}"
    ax.set_title(desc, fontsize=8, color="red" if reasons else "black")
    fig.tight_layout()
    return fig


def plot_timeline(row: dict[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """:func:`timeline_figure` written as PNG (atomically)."""
    return atomic_savefig(timeline_figure(row, title=title), path, format="png", dpi=100)


def default_plots(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """The plots that mean something for these rows: num_warps x smem_bytes and reserved
    SMs x message size when those axes vary, chunks x message size per collective, and the
    timeline of the best point within the physical bounds (:func:`best_row`; none when
    every point is noise), all from rank 0's rows."""
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
        paths.append(
            plot_heatmap(
                sel,
                "message_bytes",
                "chunks",
                out_dir / f"heatmap_chunks_message_{col}.png",
                title=f"speedup, {col}: chunks x message bytes",
            )
        )
    best = best_row(rows)
    if best is not None:
        paths.append(plot_timeline(best, out_dir / "timeline_best.png"))
    return paths


# ---------------------------------------------------------------------- entry (all ranks)
def _sweep_worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawned rank: rebuild the points and run them (module-level for pickling)."""
    from cokit.launch import local_device

    device = local_device(spec["device"])
    points = [SweepPoint.from_dict(p) for p in spec["points"]]
    return run_sweep(
        points,
        device=device,
        dtype=spec["dtype"],
        repeats=spec["repeats"],
        warmup=spec["warmup"],
        progress=point_callbacks(rank, points, spec),
    )


class SweepTelemetry:
    """A telemetry run per rank for a sweep (``<out>/telemetry/sweep/rank<r>.jsonl``): one
    step line per point, its GEMM config (with occupancy) as the kernel in use and the
    point's times, speedup and noise flag as metrics; closed after the last point."""

    METRICS = ("compute_ms", "communicate_ms", "sequential_ms", "overlapped_ms", "speedup")

    def __init__(self, out_dir: str, points: Sequence[SweepPoint], spec: dict[str, Any]) -> None:
        from cokit.telemetry import Monitor

        self.points = list(points)
        config = {k: spec[k] for k in ("dtype", "repeats", "warmup")}
        self.monitor = Monitor(out_dir, "sweep", gather=False, method="sweep", config=config)

    def __call__(self, i: int, row: dict[str, Any]) -> None:
        point = self.points[i]
        self.monitor.add_kernel("sweep GEMM", point.config, dtype=str(row.get("dtype", "fp32")))
        metrics = {k: row[k] for k in self.METRICS if isinstance(row.get(k), (int, float))}
        metrics["noise"] = 1.0 if row.get("noise") else 0.0
        self.monitor.step(i + 1, **metrics)
        if i + 1 == len(self.points):
            self.monitor.close()


def point_callbacks(
    rank: int, points: Sequence[SweepPoint], spec: dict[str, Any]
) -> Callable[[int, dict[str, Any]], None] | None:
    """What runs on each rank as each point finishes: the progress line on rank 0 when
    ``spec["progress"]``, and the rank's telemetry when ``spec["telemetry_dir"]``; None when
    there is nothing to call."""
    calls: list[Callable[[int, dict[str, Any]], None]] = []
    if spec.get("progress") and rank == 0:
        calls.append(SweepProgress(len(points)))
    if spec.get("telemetry_dir"):
        calls.append(SweepTelemetry(spec["telemetry_dir"], points, spec))
    if not calls:
        return None

    def done(i: int, row: dict[str, Any]) -> None:
        for call in calls:
            call(i, row)

    return done


def sweep_main(
    points: Sequence[SweepPoint],
    *,
    world_size: int,
    backend: str,
    dtype: str = "fp32",
    repeats: int = 3,
    warmup: int = 1,
    device: str | None = None,
    progress: bool = False,
    telemetry_dir: str | None = None,
) -> list[dict[str, Any]] | None:
    """Run the points on ``world_size`` local ranks (spawned, which inherit this process's
    environment, TRITON_INTERPRET included; in-process for 1 rank) or, under torchrun, on the
    ranks torchrun started (``world_size`` ignored). Returns every rank's rows in rank order;
    under torchrun they are gathered on rank 0 and the other ranks get ``None``. With
    ``progress``, rank 0 prints a :class:`SweepProgress` line as each point finishes; with
    ``telemetry_dir``, every rank writes its :class:`SweepTelemetry` there."""
    from cokit.launch import in_torchrun, run

    spec: dict[str, Any] = {
        "device": "cuda" if backend == "nccl" else "cpu",
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "progress": progress,
        "telemetry_dir": telemetry_dir,
        "points": [p.to_dict() for p in points],
    }
    if world_size == 1 and not in_torchrun():
        return run_sweep(
            points,
            device=device,
            dtype=dtype,
            repeats=repeats,
            warmup=warmup,
            progress=point_callbacks(0, points, spec),
        )
    per_rank = run(world_size, _sweep_worker, spec, device=spec["device"])
    return None if per_rank is None else [row for rows in per_rank for row in rows]
