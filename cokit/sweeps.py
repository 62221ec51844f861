"""The application side of overlap sweeps (``cokit sweep``, notebook 01).

:func:`sweep_main` runs :func:`cokit.overlap.sweep.run_sweep` on local ranks (spawned) or on
torchrun's ranks; :func:`write_csv` / :func:`write_json` record the rows (atomically); the
plots are speedup heatmaps (:func:`plot_heatmap`: over num_warps x smem_bytes, reserved SMs x
message size, chunks x message size) and a timeline-style bar chart of one point
(:func:`plot_timeline`). Figures are drawn on :class:`matplotlib.figure.Figure` objects, so
writing them never touches pyplot's backend (inline plots in a notebook keep working).
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cokit.files import atomic_savefig, atomic_write_text
from cokit.overlap.sweep import SweepPoint, run_sweep
from cokit.triton_kernels.gemm_config import GemmConfig

#: the files ``cokit sweep`` writes into its folder (names and glob patterns): a folder
#: holding any of them holds an earlier sweep's results
OUTPUTS = ("sweep.csv", "sweep.json", "heatmap_*.png", "timeline_best.png")


# ---------------------------------------------------------------------- records
def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Rows to CSV (the union of their keys as columns, first-seen order)."""
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return atomic_write_text(path, buf.getvalue())


def write_json(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike, meta: dict[str, Any] | None = None
) -> Path:
    """``{"meta": ..., "rows": [...]}`` as JSON."""
    return atomic_write_text(
        path, json.dumps({"meta": meta or {}, "rows": list(rows)}, indent=1, default=str)
    )


# ---------------------------------------------------------------------- plots
def _figure(figsize: tuple[float, float]) -> Any:
    """A figure outside pyplot's state (no backend involved; nothing to close)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _save(fig: Any, path: str | os.PathLike) -> Path:
    """Write a figure as PNG, atomically."""
    fig.tight_layout()
    return atomic_savefig(fig, path, format="png", dpi=100)


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
    grid = [
        [statistics.median(cells[(vx, vy)]) if (vx, vy) in cells else float("nan") for vx in xs] for vy in ys
    ]
    fig = _figure((max(5.0, 1.6 + 1.1 * len(xs)), max(3.0, 1.4 + 0.7 * len(ys))))
    ax = fig.subplots()
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
    ax.set_title(
        label + ("\n(median over other axes)" if any(len(v) > 1 for v in cells.values()) else ""), fontsize=9
    )
    fig.colorbar(im, ax=ax, label=value)
    return _save(fig, path)


def plot_timeline(row: dict[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Timeline-style bars of one row: compute and communication alone, back to back
    (T_seq), overlapped (measured, with compute under overlap), and the ideal."""
    need = ("compute_ms", "communicate_ms", "overlapped_ms")
    if any(row.get(k) is None for k in need):
        raise ValueError(
            f"row lacks {', '.join(k for k in need if row.get(k) is None)}; it needs {', '.join(need)}"
        )
    tc, tm, to = row["compute_ms"], row["communicate_ms"], row["overlapped_ms"]
    tu = row.get("compute_under_overlap_ms") or tc
    comm_name = "EMULATED comm" if row.get("emulated") else "communication"
    fig = _figure((9, 3.2))
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
    uniq = dict(zip(labels, handles))
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
    ax.set_title(desc, fontsize=8)
    return _save(fig, path)


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
        paths.append(
            plot_heatmap(
                sel,
                "message_bytes",
                "chunks",
                out_dir / f"heatmap_chunks_message_{col}.png",
                title=f"speedup, {col}: chunks x message bytes",
            )
        )
    best = max(rows, key=lambda r: r.get("speedup") or 0.0)
    paths.append(plot_timeline(best, out_dir / "timeline_best.png"))
    return paths


# ---------------------------------------------------------------------- entry (all ranks)
def _sweep_worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawned rank: rebuild the points and run them (module-level for pickling)."""
    from cokit.launch import local_device

    device = local_device(spec["device"])
    points = [
        SweepPoint(
            p["collective"],
            p["size"],
            p["chunks"],
            GemmConfig.from_dict(p["config"]),
            p["priority"],
            p["comm_sms"],
        )
        for p in spec["points"]
    ]
    return run_sweep(
        points, device=device, dtype=spec["dtype"], repeats=spec["repeats"], warmup=spec["warmup"]
    )


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
    from cokit.launch import in_torchrun, run

    if world_size == 1 and not in_torchrun():
        return run_sweep(points, device=device, dtype=dtype, repeats=repeats, warmup=warmup)
    spec: dict[str, Any] = {
        "device": "cuda" if backend == "nccl" else "cpu",
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "points": [
            {
                "collective": p.collective,
                "size": p.size,
                "chunks": p.chunks,
                "config": p.config.to_dict(),
                "priority": p.priority,
                "comm_sms": p.comm_sms,
            }
            for p in points
        ],
    }
    per_rank = run(world_size, _sweep_worker, spec, device=spec["device"])
    return None if per_rank is None else [row for rows in per_rank for row in rows]
