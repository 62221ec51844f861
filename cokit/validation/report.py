"""The study's report: aggregate the per-run JSONs into tables (markdown, CSV) and plots."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import statistics
from typing import Any

from cokit.display import NO_MATPLOTLIB, have_matplotlib, human_bytes
from cokit.files import atomic_write_text
from cokit.validation.plots import plot_curves, plot_names, plot_pareto
from cokit.validation.records import amortized_bytes, choose_lr, dense_gaps

SUMMARY_FIELDS = (
    "final_train_loss",
    "final_heldout_loss",
    "heldout_accuracy",
    "bytes_per_step",
    "mean_bytes_per_step",
    "total_bytes_sent",
    "dense_bytes_per_step",
    "ratio_to_dense",
    "time_per_step_s",
    "opt_time_per_step_s",
    "total_time_s",
    "max_replica_diff",
)
RUN_FIELDS = ("workload", "method", "family", "lr", "seed", "steps", "world_size", "status", *SUMMARY_FIELDS)
TABLE_FIELDS = (
    "workload",
    "method",
    "family",
    "best_lr",
    "lr_at_edge",
    "lrs_tried",
    "seeds",
    "final_train_loss_mean",
    "final_train_loss_std",
    "final_heldout_loss_mean",
    "final_heldout_loss_std",
    "final_heldout_loss_min",
    "final_heldout_loss_max",
    "heldout_accuracy_mean",
    "heldout_accuracy_std",
    "delta_heldout_vs_adamw",
    "baseline",
    "gap_vs_baseline",
    "best_dense",
    "gap_vs_best_dense",
    "bytes_per_step",
    "total_bytes_sent",
    "ratio_to_dense",
    "time_per_step_s",
    "opt_time_per_step_s",
    "failed_lrs",
)


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def aggregate(
    records: list[dict],
    methods: list[str],
    lrs_tried: dict[str, int],
    lr_seeds: dict[str, int] | None = None,
    baselines: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per method: its lr (the lowest held-out loss of seed 0, or of the mean over
    ``lr_seeds[method]`` seeds), then mean/std over the seeds run at that lr, and the gaps of
    :func:`cokit.validation.records.dense_gaps` (``baselines``: method -> the label of its dense
    baseline; default: AdamW for every method)."""

    rows = []
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        lr = choose_lr(mine, (lr_seeds or {}).get(m, 1))
        failed = sorted({r["lr"] for r in mine if r["seed"] == 0 and r.get("status") != "ok"})
        grid = sorted({r["lr"] for r in mine if r["seed"] == 0})
        row: dict[str, Any] = {
            "method": m,
            "family": mine[0]["family"] if mine else "",
            "best_lr": lr,
            "lr_at_edge": len(grid) > 1 and lr in (grid[0], grid[-1]),
            "lrs_tried": lrs_tried.get(m, 0),
            "failed_lrs": failed,
            "seeds": 0,
        }
        at = [r for r in mine if r["lr"] == lr and r.get("status") == "ok"] if lr is not None else []
        if at:
            row["seeds"] = len(at)
            for f in ("final_train_loss", "final_heldout_loss", "heldout_accuracy"):
                row[f"{f}_mean"], row[f"{f}_std"] = _stats([r["summary"][f] for r in at])
            losses = [r["summary"]["final_heldout_loss"] for r in at]
            row["final_heldout_loss_min"], row["final_heldout_loss_max"] = min(losses), max(losses)
            s0 = next(r for r in at if r["seed"] == min(x["seed"] for x in at))["summary"]
            for f in ("total_bytes_sent", "ratio_to_dense"):
                row[f] = s0[f]
            row["bytes_per_step"] = amortized_bytes(s0)
            for f in ("time_per_step_s", "opt_time_per_step_s"):
                row[f] = statistics.median(r["summary"][f] for r in at)
        rows.append(row)
    base = next(
        (r for r in rows if r["method"] == "adamw" and r.get("final_heldout_loss_mean") is not None), None
    )
    for r in rows:
        if base is not None and r.get("final_heldout_loss_mean") is not None:
            r["delta_heldout_vs_adamw"] = r["final_heldout_loss_mean"] - base["final_heldout_loss_mean"]
    dense_gaps(rows, baselines or dict.fromkeys(methods, "adamw"), "final_heldout_loss_mean")
    return rows


def gap_cell(gap: float | None, reference: str | None, itself: str | None = None) -> str:
    """A relative gap and the run it is against, e.g. ``+12.3% (muon)``; ``itself`` for the
    reference's own row (``-`` when there is no gap)."""
    if reference is not None and reference == itself:
        return "itself"
    return "-" if gap is None else f"{100 * gap:+.1f}% ({reference})"


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Labels of the points (label, bytes, loss) that no other point beats on both axes."""
    front, best = [], math.inf
    for label, _, loss in sorted(points, key=lambda p: (p[1], p[2])):
        if loss < best:
            front.append(label)
            best = loss
    return front


def _fmt(mean: float | None, std: float | None, digits: int = 3, pct: bool = False) -> str:
    if mean is None:
        return "failed"
    scale = 100.0 if pct else 1.0
    s = f"{mean * scale:.{digits}f}"
    return s + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def markdown_table(
    rows: list[dict], workload: str, steps: int, uniform: float | None, baseline: str = "uniform-guess loss"
) -> str:
    """The per-workload table in markdown."""
    head = (
        "| method | lr (best of N) | seeds | train loss | held-out loss | Δ vs AdamW | vs own dense "
        "| vs best dense | held-out acc % "
        "| bytes/step/rank | total bytes/rank | ratio to dense | time/step | opt/step |"
    )
    lines = [
        f"**{workload}** ({steps} steps" + (f"; {baseline} {uniform:.3f}" if uniform else "") + ")",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        lr = "-" if r["best_lr"] is None else f"{r['best_lr']:g} (of {r['lrs_tried']})"
        if r.get("lr_at_edge"):
            lr += " edge"
        if r.get("failed_lrs"):
            lr += " [" + ",".join(f"{x:g}" for x in r["failed_lrs"]) + " failed]"
        d = r.get("delta_heldout_vs_adamw")
        ratio = r.get("ratio_to_dense")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["method"],
                    lr,
                    str(r["seeds"]),
                    _fmt(r.get("final_train_loss_mean"), r.get("final_train_loss_std")),
                    _fmt(r.get("final_heldout_loss_mean"), r.get("final_heldout_loss_std")),
                    "-" if d is None else f"{d:+.3f}",
                    gap_cell(r.get("gap_vs_baseline"), r.get("baseline"), r["method"]),
                    gap_cell(r.get("gap_vs_best_dense"), r.get("best_dense"), r["method"]),
                    "-"
                    if r.get("heldout_accuracy_mean") is None and r.get("final_heldout_loss_mean") is not None
                    else _fmt(r.get("heldout_accuracy_mean"), r.get("heldout_accuracy_std"), 1, pct=True),
                    human_bytes(r.get("bytes_per_step")),
                    human_bytes(r.get("total_bytes_sent")),
                    "-" if ratio is None else f"{ratio:.1f}x",
                    "-" if r.get("time_per_step_s") is None else f"{r['time_per_step_s'] * 1e3:.0f} ms",
                    "-"
                    if r.get("opt_time_per_step_s") is None
                    else f"{r['opt_time_per_step_s'] * 1e3:.0f} ms",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def write_report(
    out_dir: str,
    info: dict[str, Any],
    records: dict[str, list[dict]],
    cfg: Any,
    longer: dict[str, list[dict]] | None = None,
) -> dict[str, Any]:
    """Write ``table.md``, ``table.csv``, ``runs.csv``, ``study.json`` and the plots; return the
    study document (with ``table_markdown`` and ``files``). ``longer``: per workload, the runs
    at the longer horizon (phase 3). Without matplotlib the plots are skipped (and an earlier
    report's removed): ``plots_skipped`` says why."""
    files: list[str] = []
    draw = have_matplotlib()
    tables: dict[str, list[dict]] = {}
    md_parts = [_header(info)]
    pareto: dict[str, list[str]] = {}
    for wl in cfg.workloads:
        recs = records.get(wl.name, [])
        tried = {
            m: len(
                set(wl.grid(cfg.method(m).family, cfg.lr_points))
                | {r["lr"] for r in recs if r["method"] == m}
            )
            for m in cfg.methods
        }
        seeds = {m: cfg.seeds if cfg.method(m).dense else 1 for m in cfg.methods}
        baselines = {m: cfg.method(m).baseline for m in cfg.methods}
        rows = aggregate(recs, cfg.methods, tried, seeds, baselines)
        for r in rows:
            r["workload"] = wl.name
        tables[wl.name] = rows
        about = info.get("workload_info", {}).get(wl.name, {})
        uniform, baseline = about.get("uniform_loss"), about.get("baseline_label", "uniform-guess loss")
        md_parts.append(markdown_table(rows, wl.name, wl.steps, uniform, baseline))
        best = {r["method"]: r["best_lr"] for r in rows if r["best_lr"] is not None}
        chosen = [
            r for r in recs if r["seed"] == 0 and r.get("status") == "ok" and best.get(r["method"]) == r["lr"]
        ]
        chosen.sort(key=lambda r: cfg.methods.index(r["method"]))
        points = [
            (r["method"], amortized_bytes(r["summary"]), r["summary"]["final_heldout_loss"])
            for r in chosen
            if amortized_bytes(r["summary"]) > 0
        ]
        pareto[wl.name] = pareto_front(points)
        if pareto[wl.name]:
            md_parts.append(
                f"Pareto front of **{wl.name}** (held-out loss vs bytes per step, best lr, seed 0; "
                "fewest bytes first): " + ", ".join(pareto[wl.name])
            )
        if not draw:
            for name in plot_names(wl.name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(out_dir, name))  # they would describe other runs
        elif chosen:
            files += plot_curves(out_dir, wl.name, chosen, uniform, _title(info, wl), baseline)
            files.append(plot_pareto(out_dir, wl.name, chosen, pareto[wl.name], uniform, _title(info, wl)))
    target = target_check(tables, info.get("target"))
    if target:
        md_parts.append(target_markdown(target))
    advice = None
    if getattr(cfg, "recommend_within", None) is not None:
        wl = cfg.workloads[0]
        advice = recommend(tables.get(wl.name, []), cfg.recommend_within, wl.steps)
        md_parts.append(advice)
    horizon = {
        wl: horizon_rows(tables[wl], recs) for wl, recs in (longer or {}).items() if recs and wl in tables
    }
    for wl, rows in horizon.items():
        md_parts.append(horizon_markdown(wl, rows))
    md_parts.append(_footnotes(info))
    md = "\n\n".join(md_parts) + "\n"
    atomic_write_text(os.path.join(out_dir, "table.md"), md)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=TABLE_FIELDS, extrasaction="ignore")
    w.writeheader()
    for rows in tables.values():
        w.writerows({**r, "failed_lrs": " ".join(f"{x:g}" for x in r.get("failed_lrs", []))} for r in rows)
    atomic_write_text(os.path.join(out_dir, "table.csv"), buf.getvalue())
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=RUN_FIELDS, extrasaction="ignore")
    w.writeheader()
    for recs in [*records.values(), *(longer or {}).values()]:
        for r in sorted(recs, key=lambda r: (r["method"], r["lr"], r["seed"])):
            w.writerow({**r, **r.get("summary", {})})
    atomic_write_text(os.path.join(out_dir, "runs.csv"), buf.getvalue())
    files = ["table.md", "table.csv", "runs.csv", "study.json", *files]
    doc = {
        **info,
        "tables": tables,
        "pareto_front": pareto,
        "target_check": target,
        "long_horizon_rows": horizon,
        "recommendation": advice,
        "files": files,
        "plots_skipped": None if draw else NO_MATPLOTLIB,
        "table_markdown": md,
    }
    atomic_write_text(os.path.join(out_dir, "study.json"), json.dumps(doc, indent=1, default=str))
    return doc


def _is_dense(row: dict) -> bool:
    return row.get("baseline", "adamw") == row["method"]


def recommend(rows: list[dict], tolerance: float, steps: int) -> str:
    """``--on``'s advice from one workload's table, judged against the best dense run (the dense
    baseline with the lowest held-out loss: AdamW, Muon, ...): the compressed method with the most
    fewer bytes within ``tolerance`` of it; else that the best dense run wins, and by how much
    over the closest compressed method."""
    dense = [r for r in rows if _is_dense(r) and r.get("final_heldout_loss_mean") is not None]
    if not dense:
        return "No recommendation: no dense baseline (AdamW, Muon) has a finished run."
    best = min(dense, key=lambda r: r["final_heldout_loss_mean"])
    ref = best["final_heldout_loss_mean"]
    compressed = [
        r
        for r in rows
        if not _is_dense(r)
        and r.get("final_heldout_loss_mean") is not None
        and (r.get("ratio_to_dense") or 0) > 1
    ]
    if not compressed:
        return "No recommendation: no compressed method finished a run."
    gap = {r["method"]: r["final_heldout_loss_mean"] / ref - 1.0 for r in compressed}
    within = [r for r in compressed if gap[r["method"]] <= tolerance]
    pick = (
        max(within, key=lambda r: r["ratio_to_dense"])
        if within
        else min(compressed, key=lambda r: gap[r["method"]])
    )
    what = (
        f"{pick['method']} at lr {pick['best_lr']:g}: {pick['ratio_to_dense']:.0f}x fewer bytes than a "
        f"dense all-reduce, held-out loss {gap[pick['method']] * 100:+.1f}% vs the best dense run "
        f"({best['method']}, {ref:.4g})"
    )
    own = pick.get("baseline")
    if own is not None and own != best["method"] and pick.get("gap_vs_baseline") is not None:
        what += f", {pick['gap_vs_baseline'] * 100:+.1f}% vs its own optimizer's dense run ({own})"
    text = (
        f"Recommendation: {what}, within {tolerance:.0%}."
        if within
        else f"No compressed method came within {tolerance:.0%} of the best dense run: {best['method']} "
        f"(dense all-reduce) wins. Closest: {what}."
    )
    if pick.get("lr_at_edge"):
        text += " Its best lr is at the edge of the grid: the true best may lie outside it."
    return (
        text + f" One seed, {steps} steps: the gap can grow with training length "
        "(docs/validation-study.md), so check the choice at your real horizon."
    )


def target_check(tables: dict[str, list[dict]], target: dict | None) -> dict[str, Any] | None:
    """The quality target on ``target["workload"]``: the best method (by mean held-out loss over
    its seeds) at >= ``min_ratio_to_dense`` x fewer bytes, against AdamW's mean; None without
    an AdamW row or the workload."""
    if not target or target["workload"] not in tables:
        return None
    rows = tables[target["workload"]]
    base = next((r for r in rows if r["method"] == "adamw" and r.get("final_heldout_loss_mean")), None)
    if base is None:
        return None
    eligible = [
        r
        for r in rows
        if r.get("final_heldout_loss_mean") is not None
        and (r.get("ratio_to_dense") or 0.0) >= target["min_ratio_to_dense"]
    ]
    best = min(eligible, key=lambda r: r["final_heldout_loss_mean"]) if eligible else None
    out: dict[str, Any] = {
        **target,
        "adamw_mean": base["final_heldout_loss_mean"],
        "adamw_std": base.get("final_heldout_loss_std"),
        "adamw_seeds": base["seeds"],
        "method": None,
        "met": False,
    }
    if best is not None:
        rel = best["final_heldout_loss_mean"] / base["final_heldout_loss_mean"] - 1.0
        out.update(
            method=best["method"],
            mean=best["final_heldout_loss_mean"],
            std=best.get("final_heldout_loss_std"),
            seeds=best["seeds"],
            ratio_to_dense=best["ratio_to_dense"],
            relative_delta=rel,
            met=rel <= target["max_delta_vs_adamw"] and best["seeds"] >= 3,
        )
    return out


def target_markdown(t: dict[str, Any]) -> str:
    """The target check as a short paragraph."""
    head = (
        f"**Target** ({t['workload']}, matched steps): held-out loss within "
        f"{100 * t['max_delta_vs_adamw']:g}% of AdamW's mean "
        f"({_fmt(t['adamw_mean'], t['adamw_std'])}, {t['adamw_seeds']} seeds) at >= "
        f"{t['min_ratio_to_dense']:g}x fewer bytes per step, 3 seeds. "
    )
    if t["method"] is None:
        return head + f"No method reached {t['min_ratio_to_dense']:g}x: **missed**."
    verdict = (
        "**met**"
        if t["met"]
        else (
            f"**missed** by {100 * (t['relative_delta'] - t['max_delta_vs_adamw']):.1f} percentage points"
            if t["relative_delta"] > t["max_delta_vs_adamw"]
            else "**not confirmed** (fewer than 3 seeds)"
        )
    )
    return head + (
        f"Best such method: `{t['method']}`, {_fmt(t['mean'], t['std'])} ({t['seeds']} seeds), "
        f"{100 * t['relative_delta']:+.1f}% vs AdamW at {t['ratio_to_dense']:.0f}x fewer bytes: {verdict}."
    )


def horizon_rows(rows: list[dict], longer: list[dict]) -> list[dict[str, Any]]:
    """Per method of the longer runs: held-out loss at the study's steps (seed 0, same lr) and
    at the longer horizon, each with its relative gap to AdamW at the same horizon."""
    short = {r["method"]: r for r in rows}
    out = []
    for rec in sorted(longer, key=lambda r: r["method"] != "adamw"):
        if rec.get("status") != "ok":
            out.append({"method": rec["method"], "status": rec.get("status")})
            continue
        evals = {e["step"]: e["heldout_loss"] for e in rec["evals"] if e["heldout_loss"] is not None}
        out.append(
            {
                "method": rec["method"],
                "lr": rec["lr"],
                "steps": rec["steps"],
                "status": "ok",
                "heldout_at_steps": evals,
                "final_heldout_loss": rec["summary"]["final_heldout_loss"],
                "short_heldout_loss": short.get(rec["method"], {}).get("final_heldout_loss_min"),
                "ratio_to_dense": rec["summary"]["ratio_to_dense"],
            }
        )
    base = next((r for r in out if r["method"] == "adamw" and r["status"] == "ok"), None)
    for r in out:
        if base is None or r["status"] != "ok":
            continue
        common = sorted(set(r["heldout_at_steps"]) & set(base["heldout_at_steps"]))
        r["gap_vs_adamw"] = {s: r["heldout_at_steps"][s] / base["heldout_at_steps"][s] - 1.0 for s in common}
    return out


def horizon_markdown(workload: str, rows: list[dict[str, Any]]) -> str:
    """The longer-horizon table: held-out loss and relative gap to AdamW at a few steps."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return f"**{workload}, longer horizon**: every run failed."
    steps = sorted(ok[0]["heldout_at_steps"])
    picks = sorted({steps[len(steps) // 3], steps[(2 * len(steps)) // 3], steps[-1]} - {0})
    head = "| method | lr | " + " | ".join(f"held-out @ {s} (gap vs AdamW)" for s in picks) + " |"
    lines = [
        f"**{workload}, longer horizon** ({ok[0]['steps']} steps, seed 0, each at its best lr of the "
        "study's steps; does the gap to AdamW close or grow?)",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | - | " + " | ".join(r["status"] for _ in picks) + " |")
            continue
        cells = []
        for s in picks:
            v, gap = r["heldout_at_steps"].get(s), r.get("gap_vs_adamw", {}).get(s)
            cells.append("-" if v is None else f"{v:.3f}" + ("" if gap is None else f" ({100 * gap:+.1f}%)"))
        lines.append(f"| {r['method']} | {r['lr']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _title(info: dict, wl: Any) -> str:
    return (
        f"{wl.name}: {wl.steps} steps, {info['world_size']} {info['backend']} ranks on CPU, "
        f"best-of-{info['lr_points']} lr per method, seed 0 ({info['date']})"
    )


def _header(info: dict) -> str:
    m = info["machine"]
    return (
        f"Validation study, preset `{info['preset']}`, {info['date']}: {info['world_size']} ranks "
        f"(`{info['backend']}`, {info['device']}) on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
        f"triton {m['triton']}. Every method: same model, seed, batches and steps; lr = best of the "
        f"method's grid by final held-out loss of seed 0, for the dense baselines by the mean over "
        f"every seed, a winning grid edge extended by one point (the best-of-N is in the lr column); "
        f"mean ± sample std over the seeds column. Each method's gap is against the dense run of "
        f"its own inner optimizer (vs own dense: AdamW-inner methods, PowerSGD and DeMo against "
        f"adamw; Muon-inner methods and Dion against muon) and against the best dense run."
    )


def _footnotes(info: dict) -> str:
    return (
        'lr "edge": the best lr is the smallest or largest of the grid (a wider grid might do '
        "better). Train loss: mean of the last 10% of steps. Held-out loss/accuracy: after the last step "
        "(text: next-character top-1 accuracy). Bytes: sent per rank per step, amortized (the mean "
        "over the run, so methods that sync every H steps compare with those that send every step; "
        "ring all-reduce of fp32 gradients for dense methods; PowerSGD's 10% dense warm-up counts), "
        "ratio to dense = dense all-reduce bytes / bytes sent over the run. Times: medians "
        "per step on a shared CPU with more ranks than cores; opt/step is the exchange + update "
        "after backward (PowerSGD's exchange runs inside backward, in DDP's hook, so its opt/step "
        "leaves it out). CPU/gloo times say nothing about GPU speed."
    )
