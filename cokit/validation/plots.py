"""The study's plots: held-out loss vs step and vs bytes sent; quality vs k and the Pareto front."""

from __future__ import annotations

import os
import re
from itertools import accumulate
from typing import Any

from cokit.display import pyplot
from cokit.files import atomic_savefig
from cokit.validation.records import amortized_bytes

_DEMO = re.compile(r"demo-compact-k(\d+)-c(\d+)")
# families after DeMo's sign rule: one hue each, solid for the first variant, dashed after
_FAMILY_HUES = (
    ("demo-rms-", "tab:green"),
    ("demo-adam-", "tab:cyan"),
    ("demo-ns-", "tab:brown"),
    ("sparseloco-", "tab:pink"),
    ("diloco-", "tab:olive"),
)


def style(method: str) -> dict[str, Any]:
    """Colour and line style of a method, fixed across plots (families share a hue)."""
    from matplotlib import colormaps

    fixed = {
        "adamw": ("black", "-"),
        "sgd-momentum": ("0.55", "-"),
        "powersgd-r1": ("tab:blue", "--"),
        "powersgd-r4": ("tab:blue", "-"),
        "demo-reference-k32-c64": ("tab:red", ":"),
        "demo-sign-k32-c64": ("tab:orange", "-"),
    }
    if method in fixed:
        color, ls = fixed[method]
        return {"color": color, "ls": ls, "lw": 2.0 if method in ("adamw", "powersgd-r4") else 1.4}
    m = _DEMO.fullmatch(method)
    if m:
        k, chunk = int(m.group(1)), int(m.group(2))
        shade = {4: 0.15, 8: 0.35, 16: 0.55, 32: 0.75, 64: 0.92}.get(k, 0.5)
        return {
            "color": colormaps["viridis"](shade),
            "ls": "-" if chunk == 64 else "--",
            "lw": 2.0 if (k, chunk) == (32, 64) else 1.1,
        }
    for prefix, hue in _FAMILY_HUES:
        if method.startswith(prefix):
            dashed = (
                "-k8-" in method
                or "-h30" in method
                or method.endswith(("-dct", "-sign"))
                or "-k16-" in method
            )
            return {"color": hue, "ls": "--" if dashed else "-", "lw": 1.6}
    return {"color": "tab:purple", "ls": "-", "lw": 1.2}


def plot_names(workload: str) -> list[str]:
    """The files :func:`plot_curves` and :func:`plot_pareto` write for ``workload``."""
    return [f"{workload}_heldout_vs_step.png", f"{workload}_heldout_vs_bytes.png", f"{workload}_pareto.png"]


def _evals(rec: dict) -> tuple[list[int], list[float]]:
    pts = [(e["step"], e["heldout_loss"]) for e in rec["evals"] if e["heldout_loss"] is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_curves(
    out_dir: str,
    workload: str,
    records: list[dict],
    uniform: float | None,
    title: str,
    baseline: str = "uniform-guess loss",
) -> list[str]:
    """``<workload>_heldout_vs_step.png`` and ``<workload>_heldout_vs_bytes.png``: one line per
    method (its best lr, seed 0); the bytes axis is cumulative bytes sent per rank (log)."""
    plt = pyplot()
    paths = []
    for kind in ("step", "bytes"):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for rec in records:
            steps, loss = _evals(rec)
            if kind == "bytes":
                cum = list(accumulate(rec["series"]["bytes_sent"]))
                pts = [(cum[s - 1], v) for s, v in zip(steps, loss, strict=True) if s > 0 and cum[s - 1] > 0]
                if not pts:
                    continue
                steps, loss = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(
                steps,
                loss,
                marker="o",
                ms=2.5,
                label=f"{rec['method']} (lr {rec['lr']:g})",
                **style(rec["method"]),
            )
        if uniform is not None and kind == "step":
            ax.axhline(uniform, color="gray", ls=":", lw=1, label=baseline)
        if kind == "bytes":
            ax.set_xscale("log")
            ax.set_xlabel("cumulative bytes sent per rank")
        else:
            ax.set_xlabel("step")
        ax.set_ylabel("held-out loss")
        lows = [v for rec in records for v in _evals(rec)[1]]
        if lows:  # the interesting part: from the best value to a bit above the median
            lo, mid = min(lows), sorted(lows)[len(lows) // 2]
            ax.set_ylim(lo - 0.05 * abs(lo) - 0.01, max(mid, lo) + 0.6 * (max(mid, lo) - lo) + 0.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"held-out loss vs {kind}\n{title}", fontsize=9)
        fig.tight_layout()
        name = plot_names(workload)[0 if kind == "step" else 1]
        atomic_savefig(fig, os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        paths.append(name)
    return paths


def plot_pareto(
    out_dir: str, workload: str, records: list[dict], front: list[str], uniform: float | None, title: str
) -> str:
    """``<workload>_pareto.png``: final held-out loss vs DeMo's k (one line per chunk, baselines
    as horizontal lines) and vs bytes sent per step (all methods, Pareto front joined)."""
    plt = pyplot()
    fig, (ax_k, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    final = {r["method"]: r["summary"]["final_heldout_loss"] for r in records}
    per_step = {r["method"]: amortized_bytes(r["summary"]) for r in records}
    grid: dict[int, list[tuple[int, float]]] = {}
    for method, loss in final.items():
        m = _DEMO.fullmatch(method)
        if m and loss is not None:
            grid.setdefault(int(m.group(2)), []).append((int(m.group(1)), loss))
    for chunk, pts in sorted(grid.items()):
        pts.sort()
        ax_k.plot(
            [k for k, _ in pts],
            [v for _, v in pts],
            marker="o",
            label=f"DeMo compact, chunk {chunk}",
            color="tab:green" if chunk == 64 else "tab:olive",
            ls="-" if chunk == 64 else "--",
        )
    for method in ("adamw", "sgd-momentum", "powersgd-r4", "powersgd-r1", "demo-sign-k32-c64"):
        if final.get(method) is not None:
            st = style(method)
            ax_k.axhline(final[method], color=st["color"], ls=st["ls"], lw=1, label=method)
    if grid:
        ks = sorted({k for pts in grid.values() for k, _ in pts})
        ax_k.set_xscale("log", base=2)
        ax_k.set_xticks(ks, [str(k) for k in ks])
    ax_k.set_xlabel("k (DCT coefficients kept per tile)")
    ax_k.set_ylabel("final held-out loss (best lr, seed 0)")
    ax_k.set_title("quality vs k", fontsize=10)
    ax_k.grid(alpha=0.3)
    ax_k.legend(fontsize=7)

    for method, loss in final.items():
        if loss is None or per_step.get(method, 0) <= 0:
            continue
        st = style(method)
        ax_b.scatter(
            per_step[method],
            loss,
            color=st["color"],
            s=40 if method in front else 18,
            edgecolors="black" if method in front else "none",
            zorder=3,
        )
        ax_b.annotate(
            method.replace("demo-compact-", "").replace("-k32-c64", ""),
            (per_step[method], loss),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    fx = [per_step[m] for m in front]
    fy = [final[m] for m in front]
    if fx:
        ax_b.plot(fx, fy, drawstyle="steps-post", color="tab:red", lw=1, alpha=0.7, label="Pareto front")
        ax_b.legend(fontsize=7)
    ax_b.set_xscale("log")
    ax_b.set_xlabel("bytes sent per rank per step (log)")
    ax_b.set_ylabel("final held-out loss")
    ax_b.set_title("quality vs bytes (kK-cC = DeMo compact, top-k K, chunk C)", fontsize=10)
    ax_b.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    name = plot_names(workload)[2]
    atomic_savefig(fig, os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    return name


def plot_decomposition(tables: dict[str, list[dict[str, Any]]], out_dir: str) -> list[str]:
    """One bar chart per table of a decomposition (``benchmarks/study/decompose.py``): each
    ingredient's held-out loss gap against the dense run of the same inner optimizer (bar: the
    seed mean; dots: each seed), its bytes ratio under the bar. Saves
    ``decompose_<table>.png`` in ``out_dir`` (the backend is left alone); returns the names."""
    plt = pyplot()
    names = []
    for table, rows in tables.items():
        shown = [r for r in rows if r["ingredient"] != "dense"]
        ref = next((r["heldout_mean"] for r in rows if r["ingredient"] == "dense"), None)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(shown)), 4.0))
        for i, r in enumerate(shown):
            gap = r["gap_vs_own_dense"]
            if gap is not None:
                ax.bar(i, 100 * gap, color="tab:pink" if r["ingredient"].startswith("full") else "tab:blue")
            if ref:
                seeds = [100 * (v / ref - 1) for v in r["heldout_per_seed"] if v is not None]
                ax.plot([i] * len(seeds), seeds, "k.", ms=4)
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels(
            [
                f"{r['ingredient']}\n"
                + ("-" if r["ratio_to_dense"] is None else f"{r['ratio_to_dense']:,.0f}x fewer")
                for r in shown
            ],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        own = rows[0]["own_dense"] if rows else "dense"
        ax.set_ylabel(f"held-out loss vs dense {own} (%)")
        ax.set_title(f"{table}: the gap taken apart", fontsize=9)
        fig.tight_layout()
        name = "decompose_" + re.sub(r"[^A-Za-z0-9_.-]", "_", table) + ".png"
        atomic_savefig(fig, os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        names.append(name)
    return names
