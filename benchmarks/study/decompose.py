"""The gap taken apart: one compressed setting's ingredients, each on its own and together.

    cokit bench validate --decompose sparseloco-h5-k64-int2-muon --workloads prose --seeds 3

A compressed setting (a SparseLoCo label of the held-out protocol's catalog, e.g. H=5, top-64
of 64x64 tiles, int2 values, Muon or AdamW inner, outer average) is rebuilt one ingredient at
a time on each workload, every row from the same seeds, batches and lr schedule (warm-up 5%,
cosine to 10%, :data:`cokit.bench.study.transfer.SCHEDULE`), at one lr rule for all:

* ``dense`` -- the dense run of the setting's inner optimizer (an fp32 all-reduce of the
  gradients every step; the reference of every gap);
* ``local-average`` -- SparseLoCo at H=1 with a dense fp32 pseudo-gradient, outer average:
  every rank steps its inner optimizer on its own gradients and the updates are averaged every
  step (a control: the cost of per-rank optimizer state, no compression at all);
* ``sparsify`` -- + top-k per tile with error feedback, fp32 values (the ``compact`` payload:
  int16 indices, fp32 values), synced every step;
* ``quantize`` -- + the setting's value codec (e.g. int2), synced every step;
* ``no-error-feedback`` -- ``quantize`` with the error buffer off (``error_decay=0``: each
  sync sends the top-k of this step's pseudo-gradient and drops the rest);
* ``interval`` -- ``local-average`` at the setting's H (a dense pseudo-gradient every H steps,
  outer average);
* ``outer`` -- ``interval`` with the other outer step (Nesterov, lr 0.7, momentum 0.9, unless
  the setting's own outer is Nesterov: then ``interval`` averages and ``outer`` is its Nesterov);
* ``full`` -- the setting itself; ``full-no-error-feedback`` and ``full-other-outer`` -- the
  setting with error feedback off, with the other outer step.

Every row names the row it differs from and the option group that differs
(:func:`ingredient_rows`), so each gap is one ingredient's. The other dense baseline (AdamW or
Muon) runs too: every gap is against the dense run of the same inner optimizer and against the
best dense run.

Learning rates (``lr_rule``): ``"dense"`` (default) -- every row at the lr of the dense run of
the same inner optimizer; ``"own"`` -- the SparseLoCo rows at the setting's own lr. An lr not
given (``lrs``) is chosen on the workload at the horizon: a dense run's by the mean over every
seed on its family's grid, the setting's by seed 0 (the held-out protocol's rules, grids
extended past a winning edge).

Runs are resumable JSONs under ``<out>/runs/`` (:mod:`cokit.validation.grid`); the report is
``decompose.md``, ``decompose.csv``, ``decompose.json`` and one ``decompose_<workload>.png``
each (:func:`cokit.validation.plots.plot_decomposition`).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from cokit.bench.study import transfer
from cokit.files import atomic_write_text
from cokit.validation.grid import PRESETS, MethodDef, WorkloadDef, execute, machine_info, make_job

DEFAULT_OUT = {
    "full": os.path.join("benchmarks", "results", "decompose"),
    "quick": os.path.join("benchmarks", "out", "decompose-quick"),
    "toy": os.path.join("benchmarks", "out", "decompose-toy"),
}
DEFAULT_WORKLOADS = ("prose",)
LR_RULES = ("dense", "own")
#: DiLoCo's outer Nesterov, the ``outer`` row's when the setting averages
NESTEROV = (("outer", "nesterov"), ("outer_lr", 0.7), ("outer_momentum", 0.9))
AVERAGE = (("outer", "average"),)
DEFAULT_ERROR_DECAY = 0.95  # SparseLoCo's default
#: the setting's options by ingredient; every option of a setting must be in one
GROUPS: dict[str, tuple[str, ...]] = {
    "interval": ("sync_every",),
    "sparsity": ("topk", "chunk", "dct", "adaptive_topk", "adaptive_range", "dense_ends", "dense_params"),
    "values": ("payload", "value_dtype"),
    "error feedback": ("error_decay",),
    "outer": ("outer", "outer_lr", "outer_momentum"),
    "inner": ("inner", "inner_options"),
    "shared": ("dense_warmup_fraction",),
}
#: what turns sparsification off (a dense fp32 pseudo-gradient)
DENSE_PSEUDO = (("topk", None),)
#: fp32 values of a top-k selection: int16 (or int32) indices and fp32 values
FP32_VALUES = (("payload", "compact"), ("value_dtype", "float32"))


@dataclass(frozen=True)
class Ingredient:
    """One row of the decomposition: what it adds, to which row, in which option groups."""

    name: str
    parent: str | None  # the row it differs from (None: the dense reference)
    groups: tuple[str, ...]  # the option groups that differ from the parent's
    about: str


INGREDIENTS: dict[str, Ingredient] = {
    i.name: i
    for i in (
        Ingredient("dense", None, (), "dense all-reduce of the gradients every step, same inner optimizer"),
        Ingredient(
            "local-average",
            "dense",
            ("method",),
            "H=1, dense fp32 pseudo-gradient averaged (per-rank inner state; no compression)",
        ),
        Ingredient(
            "sparsify",
            "local-average",
            ("sparsity", "values", "error feedback"),
            "top-k of chunk with error feedback, fp32 values, synced every step",
        ),
        Ingredient("quantize", "sparsify", ("values",), "+ the setting's value codec, synced every step"),
        Ingredient(
            "no-error-feedback", "quantize", ("error feedback",), "quantize with error feedback off (decay 0)"
        ),
        Ingredient(
            "interval",
            "local-average",
            ("interval",),
            "dense fp32 pseudo-gradient every H steps, outer average",
        ),
        Ingredient("outer", "interval", ("outer",), "interval with the other outer step"),
        Ingredient("full", "quantize", ("interval", "outer"), "the setting itself"),
        Ingredient(
            "full-no-error-feedback", "full", ("error feedback",), "the setting with error feedback off"
        ),
        Ingredient("full-other-outer", "full", ("outer",), "the setting with the other outer step"),
    )
}


@dataclass
class DecomposeConfig:
    """Everything that defines a decomposition (see :func:`make_config`)."""

    preset: str
    out_dir: str
    world_size: int
    setting: str
    workloads: list[WorkloadDef]
    ingredients: list[str]
    seeds: int
    horizon: int
    lr_rule: str
    lrs: dict[str, float]
    rows: dict[str, MethodDef]  # every ingredient -> its method (``dense``: the catalog's dense run)
    other_dense: str
    verbose: bool = False
    telemetry: bool = False
    methods_by_label: dict[str, MethodDef] = field(default_factory=dict, repr=False)

    def method(self, label: str) -> MethodDef:
        return self.methods_by_label[label]

    @property
    def dense(self) -> str:
        """The label of the dense run of the setting's inner optimizer."""
        return self.rows["dense"].label


def _group_of(option: str) -> str:
    for group, names in GROUPS.items():
        if option in names:
            return group
    raise ValueError(
        f"the decomposition does not know option {option!r} of the setting; it splits "
        f"{', '.join(n for names in GROUPS.values() for n in names)}"
    )


def ingredient_rows(setting: MethodDef, catalog: dict[str, MethodDef]) -> dict[str, MethodDef]:
    """Every ingredient's method for ``setting`` (a SparseLoCo entry of the catalog): ingredient
    -> :class:`MethodDef` (labels ``<setting>.<ingredient>``; ``dense`` is the catalog's dense
    run of the setting's inner optimizer). ValueError when the setting cannot be taken apart."""
    if setting.runner != "sparseloco":
        raise ValueError(f"--decompose takes a SparseLoCo setting, got {setting.label!r} ({setting.runner})")
    opts = dict(setting.options)
    by_group: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for k, v in opts.items():
        by_group[_group_of(k)][k] = v
    h = int(opts.get("sync_every", 5))
    if h < 2:
        raise ValueError(f"{setting.label}: sync_every is {h}; the interval ingredient needs H >= 2")
    if opts.get("topk", 64) is None:
        raise ValueError(
            f"{setting.label}: a dense pseudo-gradient (topk None) has no sparsification to take apart"
        )
    decay = float(opts.get("error_decay", DEFAULT_ERROR_DECAY))
    if decay <= 0:
        raise ValueError(f"{setting.label}: error feedback is already off (error_decay {decay})")
    inner = tuple(by_group["inner"].items())
    shared = tuple(by_group["shared"].items())
    sparsity = tuple({"topk": 64, "chunk": 64, "dct": False, **by_group["sparsity"]}.items())
    values = tuple({"payload": "int2", **by_group["values"]}.items())
    if dict(values) == dict(FP32_VALUES):
        raise ValueError(f"{setting.label}: its values are fp32 already; no quantization to take apart")
    ef = (("error_decay", decay),)
    no_ef = (("error_decay", 0.0),)
    nesterov = by_group["outer"].get("outer") == "nesterov"
    own_outer = tuple(by_group["outer"].items()) if nesterov else AVERAGE
    other_outer = AVERAGE if nesterov else NESTEROV
    one, every_h = (("sync_every", 1),), (("sync_every", h),)
    base = inner + shared
    options = {
        "local-average": base + one + DENSE_PSEUDO + AVERAGE,
        "sparsify": base + one + sparsity + FP32_VALUES + ef + AVERAGE,
        "quantize": base + one + sparsity + values + ef + AVERAGE,
        "no-error-feedback": base + one + sparsity + values + no_ef + AVERAGE,
        "interval": base + every_h + DENSE_PSEUDO + (AVERAGE if nesterov else own_outer),
        "outer": base + every_h + DENSE_PSEUDO + (own_outer if nesterov else other_outer),
        "full": base + every_h + sparsity + values + ef + own_outer,
        "full-no-error-feedback": base + every_h + sparsity + values + no_ef + own_outer,
        "full-other-outer": base + every_h + sparsity + values + ef + other_outer,
    }
    family = setting.family
    rows = {"dense": catalog[setting.baseline]}
    for name, o in options.items():
        rows[name] = MethodDef(
            f"{setting.label}.{name}",
            family,
            "sparseloco",
            o,
            about=f"{setting.label} taken apart: {INGREDIENTS[name].about}",
        )
    return rows


def option_groups_differing(a: MethodDef, b: MethodDef) -> set[str]:
    """The option groups (:data:`GROUPS`, or ``"method"`` when the runners differ) in which two
    rows' options differ (an option one row leaves out counts as differing)."""
    if a.runner != b.runner:
        return {"method"}
    oa, ob = dict(a.options), dict(b.options)
    return {_group_of(k) for k in set(oa) | set(ob) if oa.get(k, "<unset>") != ob.get(k, "<unset>")}


def make_config(
    setting: str,
    preset: str = "full",
    *,
    out_dir: str | None = None,
    world_size: int | None = None,
    workloads: list[str] | None = None,
    ingredients: list[str] | None = None,
    seeds: int | None = None,
    horizon: int = 1,
    lr_rule: str = "dense",
    lrs: dict[str, float] | None = None,
    verbose: bool = False,
) -> DecomposeConfig:
    """A decomposition of ``setting`` with the held-out protocol's workloads sized for
    ``preset``; ValueError naming a bad value (checked before anything runs)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    catalog = transfer.transfer_methods()
    if setting not in catalog:
        known = [
            m for m, d in catalog.items() if d.runner == "sparseloco" and dict(d.options).get("topk", 64)
        ]
        raise ValueError(f"unknown setting {setting!r}; SparseLoCo settings: {', '.join(known)}")
    rows = ingredient_rows(catalog[setting], catalog)
    names = list(INGREDIENTS) if ingredients is None else ingredients
    bad = [n for n in names if n not in INGREDIENTS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"ingredients must be distinct names from {', '.join(INGREDIENTS)}; got {names}")
    names = ["dense", *[n for n in INGREDIENTS if n in names and n != "dense"]]  # table order
    wls = transfer.make_workloads(preset)
    chosen = list(DEFAULT_WORKLOADS) if workloads is None else workloads
    bad = [w for w in chosen if w not in wls]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"workloads must be distinct names from {', '.join(wls)}; got {chosen}")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or not 1 <= horizon <= 30:
        raise ValueError(
            f"horizon must be a whole factor of the workload's steps in [1, 30], got {horizon!r}"
        )
    if lr_rule not in LR_RULES:
        raise ValueError(f"lr rule must be one of {', '.join(LR_RULES)}, got {lr_rule!r}")
    seeds = (1 if preset == "toy" else 3) if seeds is None else seeds
    if not 1 <= seeds <= 10:
        raise ValueError(f"seeds must be in [1, 10], got {seeds}")
    world = (2 if preset == "toy" else 4) if world_size is None else world_size
    if not 2 <= world <= 64:
        raise ValueError(f"world size must be in [2, 64] (compression needs ranks), got {world}")
    h = int(dict(rows["full"].options)["sync_every"])
    short = [w for w in chosen if wls[w].steps * horizon < 2 * h]
    if short:
        raise ValueError(
            f"horizon {horizon}: {', '.join(short)} would run fewer than two syncs of H={h} "
            f"({wls[short[0]].steps * horizon} steps); take a larger horizon"
        )
    dense = rows["dense"].label
    other = next(d for d in transfer.DENSE if d != dense)
    lrs = dict(lrs or {})
    allowed = {dense, other, setting}
    for k, v in lrs.items():
        if k not in allowed:
            raise ValueError(f"lrs: {k!r} is not one of {', '.join(sorted(allowed))}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"lrs: {k}={v!r} is not a positive number")
    by_label = {**catalog, **{m.label: m for m in rows.values()}}
    return DecomposeConfig(
        preset=preset,
        out_dir=out_dir or DEFAULT_OUT[preset],
        world_size=world,
        setting=setting,
        workloads=[wls[w] for w in chosen],
        ingredients=names,
        seeds=seeds,
        horizon=horizon,
        lr_rule=lr_rule,
        lrs=lrs,
        rows=rows,
        other_dense=other,
        verbose=verbose,
        methods_by_label=by_label,
    )


def parse_lrs(text: str | None) -> dict[str, float]:
    """``"muon=0.03,adamw=0.003"`` -> ``{"muon": 0.03, "adamw": 0.003}``; ValueError otherwise."""
    out: dict[str, float] = {}
    for part in [p.strip() for p in (text or "").split(",") if p.strip()]:
        label, sep, value = part.partition("=")
        try:
            lr = float(value) if sep else math.nan
        except ValueError:
            lr = math.nan
        if not label.strip() or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"--lrs wants label=lr pairs with positive lrs, got {part!r}")
        out[label.strip()] = lr
    return out


# --------------------------------------------------------------------------------------------
# running


def resolve_lrs(
    cfg: DecomposeConfig, wl: WorkloadDef, run: bool = True
) -> tuple[dict[str, float | None], str]:
    """The lr of the dense baselines and (``lr_rule="own"``) of the setting on ``wl``: given,
    or chosen on ``wl`` by the protocol's rules. Returns them and how each was chosen."""
    need = [cfg.dense, cfg.other_dense] + ([cfg.setting] if cfg.lr_rule == "own" else [])
    todo = [m for m in need if m not in cfg.lrs]
    chosen: dict[str, float | None] = {m: cfg.lrs[m] for m in need if m in cfg.lrs}
    notes = [f"{m} {cfg.lrs[m]:g} (given)" for m in need if m in cfg.lrs]
    if todo:
        seeds = {m: cfg.seeds if m in transfer.DENSE else 1 for m in todo}
        records, grids = transfer.tune(cfg, wl, todo, seeds, "lr choice", run)
        for m in todo:
            lr = transfer.tr.choose_lr([r for r in records if r["method"] == m], seeds[m])
            chosen[m] = lr
            how = f"{seeds[m]}-seed mean" if seeds[m] > 1 else "seed 0"
            notes.append(
                f"{m} {lr if lr is None else f'{lr:g}'} (chosen on {wl.name}, {how}, grid {grids[m]})"
            )
    return chosen, "; ".join(notes)


def row_lr(cfg: DecomposeConfig, ingredient: str, lrs: dict[str, float | None]) -> float | None:
    """The lr of one row under the config's lr rule."""
    if ingredient == "dense" or cfg.lr_rule == "dense":
        return lrs[cfg.dense]
    return lrs[cfg.setting]


def row_jobs(cfg: DecomposeConfig, wl: WorkloadDef, lrs: dict[str, float | None]) -> list:
    """Every row and the other dense baseline at their lrs, seeds ``0..seeds-1``."""
    jobs = []
    labels = [(cfg.rows[n].label, row_lr(cfg, n, lrs)) for n in cfg.ingredients]
    for label, lr in [*labels, (cfg.other_dense, lrs[cfg.other_dense])]:
        if lr is not None:
            jobs += [make_job(cfg, wl, label, lr, s, **transfer.SCHEDULE) for s in range(cfg.seeds)]
    return jobs


def _ok_loss(r: dict) -> float | None:
    if r.get("status") != "ok":
        return None
    return r["summary"]["final_heldout_loss"]


def table_rows(
    cfg: DecomposeConfig, records: list[dict], lrs: dict[str, float | None]
) -> list[dict[str, Any]]:
    """One row per ingredient (and the other dense baseline): lr, bytes ratio, held-out loss
    (seed mean, per seed), gaps against the dense run of the same inner optimizer and the best
    dense run."""

    def runs(label: str, lr: float | None) -> list[dict]:
        mine = [r for r in records if r["method"] == label and r["lr"] == lr and r["seed"] < cfg.seeds]
        return sorted(mine, key=lambda r: r["seed"])

    entries = [(n, cfg.rows[n], row_lr(cfg, n, lrs)) for n in cfg.ingredients]
    entries.append((f"dense ({cfg.other_dense})", cfg.method(cfg.other_dense), lrs[cfg.other_dense]))
    out: list[dict[str, Any]] = []
    for name, m, lr in entries:
        rs = runs(m.label, lr)
        per_seed = {r["seed"]: _ok_loss(r) for r in rs}
        losses = [v for v in per_seed.values() if v is not None]
        complete = len(losses) == cfg.seeds
        ratios = [r["summary"]["ratio_to_dense"] for r in rs if r.get("status") == "ok"]
        ing = INGREDIENTS.get(name)
        parent = ing.parent if ing else None
        out.append(
            {
                "ingredient": name,
                "method": m.label,
                "about": ing.about if ing else m.about,
                "differs_from": parent,
                "differs_in": sorted(option_groups_differing(cfg.rows[parent], m)) if parent else [],
                "options": {k: v for k, v in m.options},
                "lr": lr,
                "ratio_to_dense": statistics.fmean(ratios) if ratios else None,
                "bytes_per_step": statistics.fmean(r["summary"]["mean_bytes_per_step"] for r in rs)
                if rs and all(r.get("status") == "ok" for r in rs)
                else None,
                "heldout_mean": statistics.fmean(losses) if complete else None,
                "heldout_std": statistics.stdev(losses) if complete and len(losses) > 1 else None,
                "heldout_per_seed": [per_seed.get(s) for s in range(cfg.seeds)],
                "statuses": [r.get("status") for r in rs],
            }
        )
    dense_means = {
        r["method"]: r["heldout_mean"]
        for r in out
        if r["method"] in transfer.DENSE and r["heldout_mean"] is not None
    }
    own = dense_means.get(cfg.dense)
    best = min(dense_means, key=lambda k: dense_means[k]) if dense_means else None
    for r in out:
        loss = r["heldout_mean"]
        r["gap_vs_own_dense"] = None if loss is None or own is None else loss / own - 1.0
        r["own_dense"] = cfg.dense
        r["best_dense"] = best
        r["gap_vs_best_dense"] = None if loss is None or best is None else loss / dense_means[best] - 1.0
    return out


def run_decomposition(cfg: DecomposeConfig, report_only: bool = False) -> dict[str, Any]:
    """The lr choice (where lrs are not given), every row on every workload, then the report;
    returns ``decompose.json``'s dict."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    start = time.perf_counter()
    run = not report_only
    tables, lr_notes = {}, {}
    for base in cfg.workloads:
        wl = transfer.at_horizon(base, cfg.horizon)
        lrs, lr_notes[f"{base.name}@{cfg.horizon}x"] = resolve_lrs(cfg, wl, run)
        jobs = row_jobs(cfg, wl, lrs)
        records = execute(cfg, wl, jobs, f"decomposition of {cfg.setting}", run)
        tables[f"{base.name}@{cfg.horizon}x"] = table_rows(cfg, records, lrs)
    doc = {
        "protocol": describe(cfg),
        "machine": machine_info(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s_this_invocation": round(time.perf_counter() - start, 1),
        "lrs": lr_notes,
        "tables": tables,
    }
    return write_decomposition(cfg.out_dir, doc)


def describe(cfg: DecomposeConfig) -> dict[str, Any]:
    """JSON-ready description of the decomposition."""
    return {
        "preset": cfg.preset,
        "setting": cfg.setting,
        "setting_about": cfg.method(cfg.setting).about,
        "world_size": cfg.world_size,
        "backend": "gloo",
        "device": "cpu",
        "seeds": cfg.seeds,
        "horizon": cfg.horizon,
        "workloads": {
            w.name: {"steps": w.steps * cfg.horizon, "config": repr(w.factory)} for w in cfg.workloads
        },
        "schedule": transfer.SCHEDULE,
        "lr_rule": cfg.lr_rule,
        "lr_rule_about": "every row at the lr of the dense run of the same inner optimizer"
        if cfg.lr_rule == "dense"
        else "the SparseLoCo rows at the setting's own lr, the dense rows at theirs",
        "ingredients": {
            n: {"about": INGREDIENTS[n].about, "options": dict(cfg.rows[n].options)} for n in cfg.ingredients
        },
        "own_dense": cfg.dense,
        "other_dense": cfg.other_dense,
    }


# --------------------------------------------------------------------------------------------
# report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def decomposition_markdown(doc: dict[str, Any]) -> str:
    """One table per workload: ingredient, bytes ratio, held-out loss (mean and per seed), gaps."""
    p, m = doc["protocol"], doc["machine"]
    load = doc.get("load_average")
    parts = [
        f"Decomposition of `{p['setting']}` ({p['setting_about']}), preset `{p['preset']}`, {doc['date']}: "
        f"{p['world_size']} {p['backend']} ranks on {m['cpu']} ({m['cores']} cores"
        + (f", load average {load[0]:.1f} at the end" if load else "")
        + f"), {p['seeds']} seed(s), {p['horizon']}x the workload's steps, lr warm-up "
        f"{p['schedule']['warmup']:.0%} then cosine to 10%. Lr rule: {p['lr_rule_about']}."
    ]
    for name, rows in doc["tables"].items():
        wl = name.split("@")[0]
        steps = p["workloads"].get(wl, {}).get("steps")
        lines = [
            f"**{name}** ({steps} steps; lrs: {doc['lrs'].get(name, '-')})",
            "",
            "| ingredient | differs from (in) | lr | fewer bytes | held-out loss (mean ± std) | per seed | "
            f"vs dense {p['own_dense']} | vs best dense |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            mean = _loss(r["heldout_mean"]) + (
                "" if r["heldout_std"] is None else f" ± {r['heldout_std']:.4f}"
            )
            if r["heldout_mean"] is None:
                mean = "failed" if r["statuses"] else "not run"
            seeds = " / ".join(_loss(v) for v in r["heldout_per_seed"])
            parent = (
                "-" if r["differs_from"] is None else f"{r['differs_from']} ({', '.join(r['differs_in'])})"
            )
            ratio = "-" if r["ratio_to_dense"] is None else f"{r['ratio_to_dense']:,.1f}x"
            lr = "-" if r["lr"] is None else f"{r['lr']:g}"
            own = "itself" if r["ingredient"] == "dense" else _pct(r["gap_vs_own_dense"])
            best = _pct(r["gap_vs_best_dense"]) + (f" ({r['best_dense']})" if r["best_dense"] else "")
            lines.append(
                f"| {r['ingredient']} | {parent} | {lr} | {ratio} | {mean} | {seeds} | {own} | {best} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


CSV_FIELDS = [
    "table",
    "ingredient",
    "method",
    "differs_from",
    "differs_in",
    "lr",
    "ratio_to_dense",
    "bytes_per_step",
    "heldout_mean",
    "heldout_std",
    "heldout_per_seed",
    "own_dense",
    "gap_vs_own_dense",
    "best_dense",
    "gap_vs_best_dense",
]


def write_decomposition(out_dir: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Write ``decompose.md``, ``decompose.csv`` (one row per ingredient and workload),
    ``decompose.json`` (atomically) and the plots; return ``doc`` with ``markdown``, ``files``
    and ``plots_skipped`` (why no plot was drawn, or None)."""
    from cokit.validation.plots import plot_decomposition

    md = decomposition_markdown(doc)
    atomic_write_text(os.path.join(out_dir, "decompose.md"), md)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for name, rows in doc["tables"].items():
        for r in rows:
            w.writerow(
                {
                    **r,
                    "table": name,
                    "differs_in": "+".join(r["differs_in"]),
                    "heldout_per_seed": " ".join(
                        "" if v is None else f"{v:g}" for v in r["heldout_per_seed"]
                    ),
                }
            )
    atomic_write_text(os.path.join(out_dir, "decompose.csv"), buf.getvalue())
    files = ["decompose.md", "decompose.csv", "decompose.json"]
    skipped = None
    try:
        files += plot_decomposition(doc["tables"], out_dir)
    except ImportError as exc:  # matplotlib is optional
        skipped = f"matplotlib unavailable ({exc})"
    doc = {**doc, "markdown": md, "files": files, "plots_skipped": skipped}
    atomic_write_text(os.path.join(out_dir, "decompose.json"), json.dumps(doc, indent=1, default=str))
    return doc
