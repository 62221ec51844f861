"""Reading the study's run records (the JSONs :func:`cokit.validation.runs.run_record` writes).

The report, the plots and the held-out protocol all read runs the same way; these helpers are
their one copy, below all three (they import nothing of the study).
"""

from __future__ import annotations

import math
import statistics


def best_lr(records: list[dict]) -> float | None:
    """The lr whose seed-0 run ended with the lowest finite held-out loss (None: all failed)."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok" and r["seed"] == 0 and r["summary"]["final_heldout_loss"] is not None
    ]
    return min(ok, key=lambda r: r["summary"]["final_heldout_loss"])["lr"] if ok else None


def amortized_bytes(summary: dict) -> float:
    """Bytes sent per rank per step, averaged over the run (a method that syncs every H steps
    sends nothing on the others; the median would say 0)."""
    mean = summary.get("mean_bytes_per_step")
    return float(summary["bytes_per_step"] if mean is None else mean)


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and r["summary"]["final_heldout_loss"] is not None


def lr_means(records: list[dict], seeds: int) -> dict[float, float]:
    """lr -> mean final held-out loss over seeds ``0..seeds-1``, for the lrs where every one of
    those seeds finished (a diverged or failed seed counts as +inf: that lr is not chosen)."""
    by_lr: dict[float, dict[int, float]] = {}
    for r in records:
        if r["seed"] < seeds:
            loss = float(r["summary"]["final_heldout_loss"]) if _ok(r) else math.inf
            by_lr.setdefault(r["lr"], {})[r["seed"]] = loss
    return {lr: statistics.fmean(v.values()) for lr, v in by_lr.items() if len(v) == seeds}


def choose_lr(records: list[dict], seeds: int = 1) -> float | None:
    """The lr of ``records`` (one method on one workload) with the lowest held-out loss: seed 0's
    when ``seeds == 1``, else the mean over ``seeds`` seeds. None when no lr finished."""
    means = {lr: v for lr, v in lr_means(records, seeds).items() if math.isfinite(v)}
    return min(means, key=lambda lr: (means[lr], lr)) if means else None


def at_edge(grid: list[float], lr: float | None) -> bool:
    """Whether ``lr`` is the smallest or largest point of a grid of at least 2 points."""
    return lr is not None and len(grid) > 1 and lr in (min(grid), max(grid))


def half_decade(lr: float, steps: int) -> float:
    """The point ``steps`` half-decades from ``lr`` on the 1-3-10 ladder (1e-3, 3e-3, 1e-2, ...)."""
    k = round(2 * math.log10(lr)) + steps
    mantissa = 1.0 if k % 2 == 0 else 3.0
    return float(f"{mantissa * 10.0 ** ((k - k % 2) // 2):.4g}")


def extend_grid(grid: list[float], lr: float | None) -> float | None:
    """The next lr beyond the edge ``lr`` won at, one half-decade further out on the 1-3-10
    ladder; None when ``lr`` is interior, missing or the grid too short. The one rule of the
    study's sweep and of the held-out protocol."""
    if lr is None or not at_edge(grid, lr):
        return None
    return half_decade(lr, 1 if lr == max(grid) else -1)


def dense_gaps(rows: list[dict], baselines: dict[str, str], loss_key: str) -> None:
    """Add to each row (one method on one workload, its mean held-out loss at ``loss_key``) its
    gap against the dense run of its own inner optimizer and against the best dense run:
    ``baseline`` (``baselines[method]``; a dense method maps to itself), ``gap_vs_baseline``,
    ``best_dense`` (the dense row with the lowest loss) and ``gap_vs_best_dense``, each
    ``loss / reference - 1`` (None where a loss or the reference is missing)."""
    loss = {r["method"]: r.get(loss_key) for r in rows}
    dense = {m: v for m, v in loss.items() if baselines.get(m) == m and v is not None}
    best = min(dense, key=lambda m: dense[m]) if dense else None
    for r in rows:
        own, v = baselines.get(r["method"]), r.get(loss_key)
        ref = loss.get(own) if own is not None else None
        r["baseline"] = own
        r["gap_vs_baseline"] = None if v is None or ref is None else v / ref - 1.0
        r["best_dense"] = best
        r["gap_vs_best_dense"] = None if v is None or best is None else v / dense[best] - 1.0
