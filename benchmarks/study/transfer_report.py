"""The held-out protocol's arithmetic: lr choice, edge extension, selection and the tables.

Pure functions over the study's run JSONs (:func:`cokit.validation.runs.run_record`), so every
rule the protocol follows is tested without training anything:

* :func:`choose_lr` -- the lr with the lowest held-out loss, seed 0 or (the dense baselines)
  the mean over every seed; :func:`extend_grid` adds the next point beyond a grid edge that won.
* :func:`selection_scores` / :func:`choose_per_tier` -- on the selection workloads, each
  candidate's mean relative gap to AdamW; per compression tier the candidate with the
  smallest mean gap among those at the tier's ratio on every selection workload.
* :func:`result_rows`, :func:`gap_curve`, :func:`tier_results` -- the held-out report: mean ±
  std over seeds at the chosen lr, the gaps to AdamW, to the dense run of the method's own inner
  optimizer and to the best dense run, the gap to AdamW against steps, and each tier's target
  met or missed (with its size).
"""

from __future__ import annotations

import statistics
from typing import Any

from cokit.validation.records import (  # noqa: F401 - the lr rules, re-exported
    amortized_bytes,
    at_edge,
    choose_lr,
    dense_gaps,
    extend_grid,
    half_decade,
    lr_means,
)


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and r["summary"]["final_heldout_loss"] is not None


def _loss(r: dict) -> float:
    return float(r["summary"]["final_heldout_loss"])


def relative_gap(loss: float, reference: float) -> float:
    """``loss / reference - 1``: the held-out loss above AdamW's, as a fraction."""
    return loss / reference - 1.0


def best_run(records: list[dict], method: str, lr: float | None, seed: int = 0) -> dict | None:
    """The finished run of ``method`` at ``lr`` and ``seed``."""
    return next(
        (r for r in records if r["method"] == method and r["lr"] == lr and r["seed"] == seed and _ok(r)), None
    )


def selection_scores(
    records: dict[str, list[dict]], candidates: list[str], reference: str = "adamw"
) -> list[dict[str, Any]]:
    """Per candidate, over the selection workloads (``records``: workload -> its runs, seed 0):
    the relative gap to the reference at each one's best lr, their mean and max, and the
    smallest ratio to dense bytes. A candidate missing a workload gets no mean (not chosen)."""
    base: dict[str, float] = {}
    for wl, recs in records.items():
        mine = [r for r in recs if r["method"] == reference]
        run = best_run(mine, reference, choose_lr(mine))
        if run is not None:
            base[wl] = _loss(run)
    out = []
    for m in candidates:
        gaps: dict[str, float] = {}
        ratios: dict[str, float] = {}
        for wl, recs in records.items():
            mine = [r for r in recs if r["method"] == m]
            run = best_run(mine, m, choose_lr(mine))
            if run is None or wl not in base:
                continue
            gaps[wl] = relative_gap(_loss(run), base[wl])
            ratios[wl] = float(run["summary"]["ratio_to_dense"] or 0.0)
        complete = len(gaps) == len(records) and bool(records)
        out.append(
            {
                "method": m,
                "gaps": gaps,
                "ratios": ratios,
                "mean_gap": statistics.fmean(gaps.values()) if complete else None,
                "max_gap": max(gaps.values()) if complete else None,
                "min_ratio": min(ratios.values()) if complete else None,
            }
        )
    return out


def choose_per_tier(
    scores: list[dict[str, Any]], tiers: list[tuple[float, float]]
) -> dict[float, str | None]:
    """Per tier ``(min_ratio, tolerance)``: the candidate with the smallest mean gap (then the
    smallest max gap) among those with at least ``min_ratio`` x fewer bytes on every selection
    workload; None when no candidate reaches that ratio."""
    out: dict[float, str | None] = {}
    for ratio, _ in tiers:
        fit = [s for s in scores if s["mean_gap"] is not None and s["min_ratio"] >= ratio]
        out[ratio] = min(fit, key=lambda s: (s["mean_gap"], s["max_gap"]))["method"] if fit else None
    return out


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def result_rows(
    records: list[dict],
    methods: list[str],
    seeds: int,
    grids: dict[str, list[float]],
    baselines: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per method on one workload and horizon: the chosen lr (a dense baseline by the
    mean over ``seeds`` seeds, the others by seed 0), whether it sits at its grid's edge, the
    mean and std of the final held-out loss over the seeds run there, the ratio to dense bytes,
    and the relative gap of the mean to AdamW's mean, to its own dense baseline's and to the
    best dense run's (:func:`cokit.validation.records.dense_gaps`; ``baselines``: method -> the
    label of the dense run of its inner optimizer, a dense method itself; default: AdamW)."""
    baselines = baselines or dict.fromkeys(methods, "adamw")
    rows: list[dict[str, Any]] = []
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        lr = choose_lr(mine, seeds if baselines.get(m) == m else 1)
        at = [r for r in mine if r["lr"] == lr and r["seed"] < seeds]
        done = [r for r in at if _ok(r)]
        mean, std = _stats([_loss(r) for r in done])
        first = done[0]["summary"] if done else {}
        rows.append(
            {
                "method": m,
                "lr": lr,
                "lr_at_edge": at_edge(grids.get(m, []), lr),
                "lrs_tried": len(grids.get(m, [])),
                "seeds": len(done),
                "failed_seeds": len(at) - len(done),
                "runs": len(mine),  # every lr and seed, finished or not (0: not run yet)
                "heldout_mean": mean,
                "heldout_std": std,
                "ratio_to_dense": first.get("ratio_to_dense"),
                "bytes_per_step": amortized_bytes(first) if first else None,
            }
        )
    base = next((r["heldout_mean"] for r in rows if r["method"] == "adamw"), None)
    for r in rows:
        r["gap_vs_adamw"] = (
            relative_gap(r["heldout_mean"], base)
            if base is not None and r["heldout_mean"] is not None
            else None
        )
    dense_gaps(rows, baselines, "heldout_mean")
    return rows


def mean_curve(records: list[dict], method: str, lr: float | None, seeds: int) -> dict[int, float]:
    """Step -> held-out loss averaged over the seeds of ``method`` at ``lr`` (steps every seed
    evaluated)."""
    runs = [r for r in records if r["method"] == method and r["lr"] == lr and r["seed"] < seeds and _ok(r)]
    if not runs:
        return {}
    curves = [
        {e["step"]: e["heldout_loss"] for e in r["evals"] if e["heldout_loss"] is not None} for r in runs
    ]
    common = set(curves[0]).intersection(*curves[1:])
    return {s: statistics.fmean(c[s] for c in curves) for s in sorted(common)}


def gap_curve(records: list[dict], rows: list[dict[str, Any]], seeds: int, fractions=(0.25, 0.5, 0.75, 1.0)):
    """Per method (not AdamW): its relative gap to AdamW's mean held-out curve at the evaluated
    steps nearest to ``fractions`` of the run. Returns ``{method: {step: gap}}``."""
    lrs = {r["method"]: r["lr"] for r in rows}
    base = mean_curve(records, "adamw", lrs.get("adamw"), seeds)
    out: dict[str, dict[int, float]] = {}
    if not base:
        return out
    last = max(base)
    for m, lr in lrs.items():
        if m == "adamw":
            continue
        curve = mean_curve(records, m, lr, seeds)
        steps = sorted(set(curve) & set(base) - {0})
        if not steps:
            continue
        picks = sorted({min(steps, key=lambda s: abs(s - f * last)) for f in fractions})
        out[m] = {s: relative_gap(curve[s], base[s]) for s in picks}
    return out


def tier_results(
    tables: dict[str, list[dict[str, Any]]], chosen: dict[float, str | None], tiers: list[tuple[float, float]]
) -> list[dict[str, Any]]:
    """Each tier's target on each held-out table (``tables``: "workload @ horizon" -> rows):
    met when the tier's method has at least the tier's ratio there and a mean gap within its
    tolerance; otherwise missed, with the gap over the tolerance and the ratio short of it. The
    gap is AdamW's; ``gap_vs_best_dense`` and ``met_vs_best_dense`` judge the same row against the
    best dense run of the table."""
    out = []
    for ratio, tol in tiers:
        m = chosen.get(ratio)
        for name, rows in tables.items():
            row = next((r for r in rows if r["method"] == m), None)
            gap = None if row is None else row["gap_vs_adamw"]
            got = None if row is None else row["ratio_to_dense"]
            met = gap is not None and got is not None and gap <= tol and got >= ratio
            best = None if row is None else row.get("gap_vs_best_dense")
            out.append(
                {
                    "tier_ratio": ratio,
                    "tolerance": tol,
                    "table": name,
                    "method": m,
                    "gap": gap,
                    "ratio_to_dense": got,
                    "met": met,
                    "gap_over_tolerance": None if gap is None else max(0.0, gap - tol),
                    "ratio_short": None if got is None else max(0.0, ratio - got),
                    "best_dense": None if row is None else row.get("best_dense"),
                    "gap_vs_best_dense": best,
                    "met_vs_best_dense": best is not None
                    and got is not None
                    and best <= tol
                    and got >= ratio,
                }
            )
    return out


def gap_range(
    results: list[dict[str, Any]], ratio: float, horizon: str | None = None
) -> tuple[float, float] | None:
    """The smallest and largest gap of a tier over the held-out tables (of one horizon suffix,
    e.g. ``"@3x"``), for the headline's ranges."""
    gaps = [
        r["gap"]
        for r in results
        if r["tier_ratio"] == ratio
        and r["gap"] is not None
        and (horizon is None or r["table"].endswith(horizon))
    ]
    return (min(gaps), max(gaps)) if gaps else None
