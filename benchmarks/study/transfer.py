"""The held-out protocol: choose compression settings on some workloads, report them on others.

    cokit bench validate --protocol transfer            # full -> benchmarks/results/transfer/
    cokit bench validate --protocol transfer --quick    # shorter runs -> benchmarks/out/transfer-quick/

A setting tuned and reported on the same workloads is a best case. Here the candidates are
compared on the *selection* workloads only (the study's Python-source LM, the digits MLP and the
conv autoencoder), and each compression tier's winner is then run, untouched, on *held-out*
workloads none of them was chosen on: a char LM on English prose, a 1.3M-parameter char LM on C
headers and a CNN on the digits. The headline ranges come from the held-out ones.

Rules, the same for every method:
* warm-up (5% of the steps) and cosine decay of the lr (to 10%), at every horizon;
* each method's lr is tuned per workload and horizon on a half-decade grid; a grid edge that wins
  gets the next point beyond it (twice at most; a best lr still at an edge is flagged "edge");
* the dense baselines (``DENSE``: AdamW and Muon, each the same fp32 all-reduce every step, then
  its optimizer) run at every horizon; their lr is the best by the mean over every seed; the
  others' by seed 0, then more seeds at it;
* selection: at ``SELECT_HORIZON`` x the steps, seed 0; per tier (``TIERS``: at least R x fewer
  bytes than dense, within a tolerance of AdamW) the candidate with the smallest mean relative
  gap over the selection workloads among those at R x on all of them;
* report: every held-out workload at 1x and 3x its steps (10x on the small ``LONG_WORKLOAD``),
  ``seeds`` seeds; each method's gap against AdamW, against the dense run of its own inner
  optimizer and against the best dense run; the gap against steps, and each tier's target met
  or missed by how much.

Every run is one JSON under ``<out>/runs/`` (resumable, as in :mod:`cokit.validation.grid`);
``transfer.md``, ``transfer.json`` and ``transfer.csv`` hold the report.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from cokit.bench.study import transfer_report as tr
from cokit.files import atomic_write_text
from cokit.validation.grid import (
    GRID_POINTS,
    PRESETS,
    MethodDef,
    WorkloadDef,
    execute,
    machine_info,
    make_job,
    method_catalog,
)
from cokit.validation.report import gap_cell

DEFAULT_OUT = {
    "full": os.path.join("benchmarks", "results", "transfer"),
    "quick": os.path.join("benchmarks", "out", "transfer-quick"),
    "toy": os.path.join("benchmarks", "out", "transfer-toy"),
}
#: (at least this many times fewer bytes than dense, held-out loss within this of AdamW's)
TIERS = [(30.0, 0.01), (100.0, 0.03), (300.0, 0.05)]
SELECT = ("text", "digits", "digits-ae")
HELDOUT = ("prose", "c-1m", "digits-cnn")
SELECT_HORIZON = 3
HORIZONS = (1, 3)
LONG_WORKLOAD, LONG_HORIZON = "digits-cnn", 10
SCHEDULE = {"schedule": "cosine", "warmup": 0.05}
#: the dense baselines every table holds (labels of the catalog; AdamW first, the reference of
#: the selection and of the tiers)
DENSE = ("adamw", "muon")
MAX_EXTENSIONS = 2
#: the settings compared on the selection workloads (labels of :func:`transfer_methods`)
CANDIDATES = (
    "demo-ns-k32-c64",
    "diloco-h30",
    "sparseloco-h5-k64-int2",
    "sparseloco-h5-k64-int2-warm1",
    "sparseloco-h5-k64-int2-muon",
    "sparseloco-h5-k16-int2-c32",
    "sparseloco-h10-k64-int2",
    "sparseloco-h15-k64-int2",
    "sparseloco-h15-k64-int2-ends",
    "sparseloco-h15-k64-int2-muon",
    "sparseloco-h15-k64-int2-nesterov",
    "sparseloco-h10-k16-int2",
    "dion-r1",
    "sparseloco-h15-k64-int2-adaptk",
    "sparseloco-h15-k64-int2-muon-adaptk",
)


#: the variants of SparseLoCo (its options against the gap that grows with training length) the
#: protocol compares: options, the family whose lr grid they use (None: SparseLoCo's), and their
#: description
VARIANTS: dict[str, tuple[tuple[tuple[str, Any], ...], str | None, str]] = {
    "warm1": ((("dense_warmup_fraction", 0.01),), None, "after 1% of the steps dense"),
    "muon": ((("inner", "muon"),), "sparseloco-muon", "Muon inner optimizer (AdamW on vectors, ends)"),
    "ends": ((("dense_ends", True),), None, "embeddings / first and last layers dense"),
    "nesterov": (
        (("outer", "nesterov"), ("outer_lr", 0.7), ("outer_momentum", 0.9)),
        None,
        "outer Nesterov (lr 0.7, momentum 0.9)",
    ),
    "adaptk": ((("adaptive_topk", True),), None, "k per tensor by the energy its selection missed"),
}


def _sparseloco(h: int, *variants: str) -> MethodDef:
    """SparseLoCo at H=h, top-64 of 64x64 tiles, int2 values, with some of :data:`VARIANTS`
    (``warm1``: 1% dense warm-up steps; ``muon``: the hybrid Muon inner optimizer; ``ends``:
    input and output layers dense; ``nesterov``: DiLoCo's outer Nesterov; ``adaptk``: adaptive
    k per tensor)."""
    options: tuple[tuple[str, Any], ...] = (
        ("sync_every", h),
        ("topk", 64),
        ("chunk", 64),
        ("payload", "int2"),
        ("dct", False),
    )
    family, about = "sparseloco", ""
    for v in variants:
        extra, grid, what = VARIANTS[v]
        options += extra
        family = grid or family
        about += f", {what}"
    inner = "Muon" if "muon" in variants else "AdamW"
    return MethodDef(
        "-".join([f"sparseloco-h{h}-k64-int2", *variants]),
        family,
        "sparseloco",
        options,
        about=f"SparseLoCo: {h} local {inner} steps, then top-64 per 64-tile of the error-fed "
        f"pseudo-gradient, int2 values{about}",
    )


def transfer_methods() -> dict[str, MethodDef]:
    """The study's catalog plus the settings only this protocol compares."""
    extra = [
        _sparseloco(15),
        _sparseloco(5, "warm1"),
        _sparseloco(5, "muon"),
        _sparseloco(15, "ends"),
        _sparseloco(15, "muon"),
        _sparseloco(15, "nesterov"),
        _sparseloco(15, "adaptk"),
        _sparseloco(15, "muon", "adaptk"),
        MethodDef(
            "dion-r1",
            "dion",
            "dion",
            (("rank", 1),),
            about="Dion: rank-1 orthonormalized update with error feedback every step (two fp32 "
            "all-reduces of m + n values per matrix), AdamW on vectors",
        ),
    ]
    return {**method_catalog(), **{m.label: m for m in extra}}


# Muon's and Dion's lrs are ~10-20x AdamW's (their AdamW parts run at 0.05 and 0.1 x it)
_LM_LRS = (
    ("adamw", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("muon", (3e-3, 1e-2, 3e-2, 0.1)),
    ("sparseloco-muon", (3e-3, 1e-2, 3e-2, 0.1)),
    ("dion", (3e-3, 1e-2, 3e-2, 0.1)),
)
_DIGITS_LRS = (
    ("adamw", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("muon", (1e-2, 3e-2, 0.1, 0.3)),
    ("sparseloco-muon", (1e-2, 3e-2, 0.1, 0.3)),
    ("dion", (1e-2, 3e-2, 0.1, 0.3)),
)


def make_workloads(preset: str) -> dict[str, WorkloadDef]:
    """The six workloads sized for ``preset``: name -> definition (steps = the 1x horizon)."""
    from cokit.bench.study.digits import DigitsWorkloadConfig
    from cokit.bench.study.digits_ae import DigitsAEWorkloadConfig
    from cokit.bench.study.digits_cnn import DigitsCNNWorkloadConfig
    from cokit.workloads import CorpusConfig, ModelConfig, TextWorkloadConfig
    from cokit.workloads.text import VOCAB_SIZE

    def lm(source: str, d: int, layers: int, chars: int, batch: int, seq: int) -> TextWorkloadConfig:
        # toy: files cut to 10K characters, so even the prose (a few long documents) splits
        cut = 10_000 if preset == "toy" else CorpusConfig.max_file_chars
        return TextWorkloadConfig(
            corpus=CorpusConfig(max_chars=chars, max_file_chars=cut, source=source),
            model=ModelConfig(
                VOCAB_SIZE, d_model=d, n_layers=layers, n_heads=min(4, d // 16), max_seq_len=seq
            ),
            batch_size=batch,
            eval_batches=8 if preset != "toy" else 2,
        )

    if preset == "toy":
        factories = {
            "text": lm("python", 32, 1, 40_000, 2, 16),
            "digits": DigitsWorkloadConfig(hidden=(32,), batch_size=8),
            "digits-ae": DigitsAEWorkloadConfig(channels=(4, 8, 8), latent=4, batch_size=8),
            "prose": lm("prose", 32, 1, 40_000, 2, 16),
            "c-1m": lm("c", 32, 1, 40_000, 2, 16),
            "digits-cnn": DigitsCNNWorkloadConfig(channels=(4, 8), batch_size=8),
        }
        steps = dict.fromkeys(factories, (4, 2))
    else:
        factories = {
            "text": lm("python", 64, 2, 400_000, 8, 64),  # the study's text workload (117K params)
            "digits": DigitsWorkloadConfig(hidden=(128, 128), batch_size=32),
            "digits-ae": DigitsAEWorkloadConfig(batch_size=32),
            "prose": lm("prose", 96, 2, 400_000, 8, 64),  # 249K params
            "c-1m": lm("c", 160, 4, 400_000, 8, 64),  # 1.28M params
            "digits-cnn": DigitsCNNWorkloadConfig(batch_size=32),
        }
        if preset == "full":
            steps = {
                "text": (250, 25),
                "digits": (200, 20),
                "digits-ae": (200, 20),
                "prose": (300, 25),
                "c-1m": (250, 25),
                "digits-cnn": (200, 20),
            }
        else:
            steps = dict.fromkeys(factories, (80, 10))
    lrs = {"text": _LM_LRS, "prose": _LM_LRS, "c-1m": _LM_LRS}
    return {
        name: WorkloadDef(name, f, steps[name][0], steps[name][1], lrs.get(name, _DIGITS_LRS))
        for name, f in factories.items()
    }


def at_horizon(wl: WorkloadDef, factor: int) -> WorkloadDef:
    """``wl`` at ``factor`` x its steps (runs under ``runs/<name>-x<factor>/``; 1: ``wl``)."""
    if factor == 1:
        return wl
    return dataclasses.replace(
        wl, name=f"{wl.name}-x{factor}", steps=wl.steps * factor, eval_every=wl.eval_every * factor
    )


@dataclass
class TransferConfig:
    """Everything that defines a run of the protocol (see :func:`make_config`)."""

    preset: str
    out_dir: str
    world_size: int
    select: list[WorkloadDef]
    heldout: list[WorkloadDef]
    candidates: list[str]
    seeds: int = 3
    horizons: tuple[int, ...] = HORIZONS
    select_horizon: int = SELECT_HORIZON
    long: tuple[str, int] | None = (LONG_WORKLOAD, LONG_HORIZON)
    tiers: list[tuple[float, float]] = field(default_factory=lambda: list(TIERS))
    verbose: bool = False
    telemetry: bool = False
    methods_by_label: dict[str, MethodDef] = field(default_factory=transfer_methods, repr=False)

    def method(self, label: str) -> MethodDef:
        return self.methods_by_label[label]


def make_config(
    preset: str = "full",
    *,
    out_dir: str | None = None,
    world_size: int | None = None,
    select: list[str] | None = None,
    heldout: list[str] | None = None,
    candidates: list[str] | None = None,
    seeds: int | None = None,
    verbose: bool = False,
) -> TransferConfig:
    """A preset's protocol with optional overrides; ValueError naming a bad value."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    wls = make_workloads(preset)
    select = list(SELECT) if select is None else select
    heldout = list(HELDOUT) if heldout is None else heldout
    for names, what in ((select, "selection"), (heldout, "held-out")):
        bad = [n for n in names if n not in wls]
        if not names or bad or len(set(names)) != len(names):
            raise ValueError(f"{what} workloads must be distinct names from {', '.join(wls)}; got {names}")
    if set(select) & set(heldout):
        raise ValueError(
            f"a workload cannot be both selection and held-out: {sorted(set(select) & set(heldout))}"
        )
    catalog = transfer_methods()
    candidates = list(CANDIDATES) if candidates is None else candidates
    bad = [c for c in candidates if c not in catalog or c in DENSE]
    if not candidates or bad or len(set(candidates)) != len(candidates):
        raise ValueError(
            f"candidates must be distinct compressed methods of --list-methods; got {candidates}"
        )
    seeds = (1 if preset == "toy" else 3) if seeds is None else seeds
    if not 1 <= seeds <= 10:
        raise ValueError(f"seeds must be in [1, 10], got {seeds}")
    world = (2 if preset == "toy" else 4) if world_size is None else world_size
    if not 2 <= world <= 64:
        raise ValueError(f"world size must be in [2, 64] (compression needs ranks), got {world}")
    long = (LONG_WORKLOAD, LONG_HORIZON) if LONG_WORKLOAD in heldout else None
    return TransferConfig(
        preset=preset,
        out_dir=out_dir or DEFAULT_OUT[preset],
        world_size=world,
        select=[wls[n] for n in select],
        heldout=[wls[n] for n in heldout],
        candidates=candidates,
        seeds=seeds,
        long=long,
        verbose=verbose,
        methods_by_label=catalog,
    )


# --------------------------------------------------------------------------------------------
# running


def tune(
    cfg: TransferConfig,
    wl: WorkloadDef,
    methods: list[str],
    seeds: dict[str, int],
    phase: str,
    run: bool = True,
) -> tuple[list[dict], dict[str, list[float]]]:
    """Each method's lr grid on ``wl`` (``seeds[m]`` seeds at every lr: the mean chooses), with
    up to ``MAX_EXTENSIONS`` points added beyond an edge that wins. Returns the runs and each
    method's grid as tried."""
    grids = {m: list(wl.grid(cfg.method(m).family, GRID_POINTS)) for m in methods}
    records: list[dict] = []
    for round_ in range(MAX_EXTENSIONS + 1):
        jobs = [
            make_job(cfg, wl, m, lr, s, **SCHEDULE)
            for m in methods
            for lr in grids[m]
            for s in range(seeds[m])
        ]
        records = execute(
            cfg, wl, jobs, f"{phase}, lr grid" + (f" + {round_} extension(s)" if round_ else ""), run
        )
        grown = False
        for m in methods:
            mine = [r for r in records if r["method"] == m]
            nxt = tr.extend_grid(grids[m], tr.choose_lr(mine, seeds[m]))
            if nxt is not None and round_ < MAX_EXTENSIONS and len({r["lr"] for r in mine}) == len(grids[m]):
                grids[m].append(nxt)
                grown = True
        if not grown:
            break
    return records, grids


def report_runs(
    cfg: TransferConfig, wl: WorkloadDef, methods: list[str], phase: str, run: bool = True
) -> tuple[list[dict], dict[str, list[float]]]:
    """The dense baselines by the mean of ``cfg.seeds`` seeds per lr; the others by seed 0, then
    seeds ``1..seeds-1`` at their chosen lr."""
    seeds = {m: cfg.seeds if m in DENSE else 1 for m in methods}
    records, grids = tune(cfg, wl, methods, seeds, phase, run)
    more = []
    for m in methods:
        if m in DENSE:
            continue
        lr = tr.choose_lr([r for r in records if r["method"] == m])
        if lr is not None:
            more += [make_job(cfg, wl, m, lr, s, **SCHEDULE) for s in range(1, cfg.seeds)]
    if more:
        records += execute(cfg, wl, more, f"{phase}, seeds 1..{cfg.seeds - 1} at the chosen lr", run)
    return records, grids


def run_transfer(cfg: TransferConfig, report_only: bool = False) -> dict[str, Any]:
    """Selection, held-out runs at every horizon, then the report; returns ``transfer.json``'s dict."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    start = time.perf_counter()
    run = not report_only
    methods = [*DENSE, *cfg.candidates]
    selection: dict[str, list[dict]] = {}
    for wl in cfg.select:
        longer = at_horizon(wl, cfg.select_horizon)
        selection[longer.name], _ = tune(cfg, longer, methods, dict.fromkeys(methods, 1), "selection", run)
    # the dense baselines other than the reference are scored too (never chosen: 1x fewer bytes)
    scores = tr.selection_scores(selection, [*DENSE[1:], *cfg.candidates])
    chosen = tr.choose_per_tier(scores, cfg.tiers)
    picked = list(dict.fromkeys(m for m in chosen.values() if m is not None))
    baselines = {m: cfg.method(m).baseline for m in [*DENSE, *picked]}
    tables: dict[str, list[dict]] = {}
    gaps: dict[str, dict[str, dict[int, float]]] = {}
    for wl in cfg.heldout:
        horizons = list(cfg.horizons) + ([cfg.long[1]] if cfg.long and cfg.long[0] == wl.name else [])
        for h in horizons:
            at = at_horizon(wl, h)
            recs, grids = report_runs(cfg, at, [*DENSE, *picked], f"held-out {h}x", run)
            name = f"{wl.name}@{h}x"
            tables[name] = tr.result_rows(recs, [*DENSE, *picked], cfg.seeds, grids, baselines)
            gaps[name] = tr.gap_curve(recs, tables[name], cfg.seeds)
    targets = tr.tier_results({k: v for k, v in tables.items() if k.endswith("@3x")}, chosen, cfg.tiers)
    doc = {
        "protocol": describe(cfg),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "elapsed_s_this_invocation": round(time.perf_counter() - start, 1),
        "selection": scores,
        "chosen": {f"{r:g}": m for r, m in chosen.items()},
        "heldout_tables": tables,
        "gap_vs_steps": {
            k: {m: {str(s): g for s, g in v.items()} for m, v in d.items()} for k, d in gaps.items()
        },
        "targets": targets,
    }
    return write_transfer_report(cfg.out_dir, doc)


def describe(cfg: TransferConfig) -> dict[str, Any]:
    """JSON-ready description of the protocol (for ``transfer.json``)."""
    return {
        "preset": cfg.preset,
        "world_size": cfg.world_size,
        "backend": "gloo",
        "device": "cpu",
        "seeds": cfg.seeds,
        "selection_workloads": {w.name: {"steps_1x": w.steps, "config": repr(w.factory)} for w in cfg.select},
        "heldout_workloads": {w.name: {"steps_1x": w.steps, "config": repr(w.factory)} for w in cfg.heldout},
        "selection_horizon": cfg.select_horizon,
        "horizons": list(cfg.horizons),
        "long": list(cfg.long) if cfg.long else None,
        "schedule": SCHEDULE,
        "tiers": [{"min_ratio": r, "tolerance": t} for r, t in cfg.tiers],
        "candidates": {m: cfg.method(m).about for m in cfg.candidates},
        "lr_rule": "half-decade grid per method, extended past a winning edge up to "
        f"{MAX_EXTENSIONS} times; the dense baselines ({', '.join(DENSE)}) by their {cfg.seeds}-seed "
        "mean, others by seed 0",
        "baselines": {m: cfg.method(m).baseline for m in [*DENSE, *cfg.candidates]},
    }


# --------------------------------------------------------------------------------------------
# report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}x"


def loss_cell(row: dict[str, Any]) -> str:
    """A held-out row's loss as the report shows it: mean ± std, or why there is none (a
    partial report, ``--report-only`` while the study runs, has rows with no runs yet)."""
    if row["heldout_mean"] is None:
        return "failed" if row.get("runs", 1) else "not run yet"
    std = row["heldout_std"]
    return f"{row['heldout_mean']:.4f}" + ("" if std is None else f" ± {std:.4f}")


def transfer_markdown(doc: dict[str, Any]) -> str:
    """The report: selection table, choices, held-out tables, gap against steps, targets."""
    p, m = doc["protocol"], doc["machine"]
    sel_names = list(p["selection_workloads"])
    parts = [
        f"Held-out protocol, preset `{p['preset']}`, {doc['date']}: {p['world_size']} {p['backend']} ranks "
        f"on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, triton {m['triton']}. Lr warm-up "
        f"{p['schedule']['warmup']:.0%} then cosine to 10% for every method. Settings are chosen on "
        f"{', '.join(sel_names)} at {p['selection_horizon']}x their steps (seed 0) and reported on "
        f"{', '.join(p['heldout_workloads'])}, which took no part in choosing. {p['lr_rule']}.",
        "**Selection** (relative gap of the held-out loss to AdamW's, each at its best lr; ratio = "
        "times fewer bytes than dense, the smallest over the workloads):",
    ]
    head = (
        "| candidate | "
        + " | ".join(f"{w}-x{p['selection_horizon']}" for w in sel_names)
        + " | mean | max | min ratio |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in doc["selection"]:
        cells = [_pct(s["gaps"].get(f"{w}-x{p['selection_horizon']}")) for w in sel_names]
        lines.append(
            f"| {s['method']} | " + " | ".join(cells) + f" | {_pct(s['mean_gap'])} | {_pct(s['max_gap'])} | "
            f"{_ratio(s['min_ratio'])} |"
        )
    parts.append("\n".join(lines))
    parts.append(
        "**Chosen per tier** (smallest mean gap at the tier's ratio on every selection workload): "
        + "; ".join(f">= {r}x: {m or 'none reaches it'}" for r, m in doc["chosen"].items())
    )
    for name, rows in doc["heldout_tables"].items():
        lines = [
            f"**{name}** (held-out; mean ± std over seeds at the chosen lr)",
            "",
            "| method | lr | held-out loss | vs AdamW | vs own dense | vs best dense | fewer bytes | seeds |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            loss = loss_cell(r)
            lr = "-" if r["lr"] is None else f"{r['lr']:g}" + (" (edge)" if r["lr_at_edge"] else "")
            own = gap_cell(r.get("gap_vs_baseline"), r.get("baseline"), r["method"])
            best = gap_cell(r.get("gap_vs_best_dense"), r.get("best_dense"), r["method"])
            lines.append(
                f"| {r['method']} | {lr} | {loss} | {_pct(r['gap_vs_adamw'])} | {own} | {best} | "
                f"{_ratio(r['ratio_to_dense'])} | {r['seeds']} |"
            )
        curve = doc["gap_vs_steps"].get(name, {})
        if curve:
            steps = sorted({int(s) for v in curve.values() for s in v})
            lines += [
                "",
                "gap to AdamW against steps:",
                "",
                "| method | " + " | ".join(f"step {s}" for s in steps) + " |",
            ]
            lines.append("|" + "---|" * (len(steps) + 1))
            for meth, v in curve.items():
                lines.append(f"| {meth} | " + " | ".join(_pct(v.get(str(s))) for s in steps) + " |")
        parts.append("\n".join(lines))
    lines = [
        "**Targets** (held-out workloads at 3x their steps, mean over seeds; the gap is AdamW's, "
        "the last two columns judge the same row against the best dense run):",
        "",
        "| tier | workload | method | fewer bytes | gap | result | vs best dense | result vs best dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in doc["targets"]:
        if t["met"]:
            verdict = "met"
        elif t["gap"] is None:
            verdict = "no result"
        else:
            misses = []
            if t["gap_over_tolerance"]:
                misses.append(f"gap {100 * t['gap_over_tolerance']:.1f} points over")
            if t["ratio_short"]:
                misses.append(f"ratio {t['ratio_short']:.0f}x short")
            verdict = "missed: " + ", ".join(misses)
        lines.append(
            f"| >= {t['tier_ratio']:g}x within {100 * t['tolerance']:g}% | {t['table']} | {t['method'] or '-'} | "
            f"{_ratio(t['ratio_to_dense'])} | {_pct(t['gap'])} | {verdict} | "
            f"{gap_cell(t.get('gap_vs_best_dense'), t.get('best_dense'))} | "
            f"{'met' if t.get('met_vs_best_dense') else ('missed' if t.get('gap_vs_best_dense') is not None else '-')} |"
        )
    parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_transfer_report(out_dir: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Write ``transfer.md``, ``transfer.csv`` (one row per held-out method) and ``transfer.json``
    atomically; return ``doc`` with ``markdown`` and ``files``."""
    md = transfer_markdown(doc)
    atomic_write_text(os.path.join(out_dir, "transfer.md"), md)
    buf = io.StringIO(newline="")
    fields = [
        "table",
        "method",
        "lr",
        "lr_at_edge",
        "lrs_tried",
        "seeds",
        "failed_seeds",
        "heldout_mean",
        "heldout_std",
        "gap_vs_adamw",
        "baseline",
        "gap_vs_baseline",
        "best_dense",
        "gap_vs_best_dense",
        "ratio_to_dense",
        "bytes_per_step",
    ]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for name, rows in doc["heldout_tables"].items():
        w.writerows({**r, "table": name} for r in rows)
    atomic_write_text(os.path.join(out_dir, "transfer.csv"), buf.getvalue())
    doc = {**doc, "markdown": md, "files": ["transfer.md", "transfer.csv", "transfer.json"]}
    atomic_write_text(os.path.join(out_dir, "transfer.json"), json.dumps(doc, indent=1, default=str))
    return doc
