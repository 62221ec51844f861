"""The validation study: AdamW, SGD-momentum, PowerSGD, DeMo (four inner update rules),
SparseLoCo and DiLoCo at small scale.

    cokit bench validate               # full mode -> benchmarks/results/validation/
    cokit bench validate --quick       # < 10 minutes on 2 CPU cores -> benchmarks/out/validation-quick/
    python benchmarks/validate_compression.py --quick    # the same

Three workloads, nothing downloaded: ``text`` (the demo's character-level transformer on the
Python standard library's own sources), ``digits`` (an MLP on scikit-learn's bundled 8x8
digits) and ``digits-ae`` (a convolutional autoencoder of the same images). Every method
trains the same model from the same seed on the same batches for the same number of steps, on
``--world-size`` local gloo ranks (CPU). Each method runs a small learning-rate grid (4 values,
seed 0); the lr with the lowest final held-out loss is reported.

Phases, each resumable (a run whose JSON exists with the same configuration is skipped):
1. the lr grid of every method on every workload (seed 0);
2. at their best lr, seeds 1..N-1: the fixed headline methods, and per family the best
   configuration and the best one at >= 100x fewer bytes than dense;
3. (full) AdamW and the best compressed configuration at >= 100x fewer bytes, at 3x the steps;
4. the report: ``table.md``, ``table.csv``, ``runs.csv``, ``study.json`` and the plots, with
   the Pareto front of held-out loss vs bytes per step and issue 13's target check.

Every run also writes its per-step telemetry (each rank's JSONL in
``<out>/telemetry/<workload>-<method>-lr<lr>-s<seed>/``; ``cokit dashboard <out>`` draws it,
``--no-telemetry`` turns it off).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from cokit.train import MethodSpec
from cokit.validation.records import best_lr
from cokit.validation.report import write_report

PRESETS = ("toy", "quick", "full")
DEFAULT_OUT = {
    "full": os.path.join("benchmarks", "results", "validation"),
    "quick": os.path.join("benchmarks", "out", "validation-quick"),
    "toy": os.path.join("benchmarks", "out", "validation-toy"),
}
DEMO_KS = (4, 8, 16, 32, 64)
DEMO_CHUNKS = (32, 64)
HEADLINE = ("adamw", "powersgd-r4", "demo-compact-k32-c64")
# DeMo with another inner update rule: label part -> (family, DeMo's update_rule name)
RULE_FAMILIES = {"rms": "demo-rms", "adam": "demo-adam", "ns": "demo-ns"}
RULE_NAMES = {"rms": "rms", "adam": "adam", "ns": "newton_schulz"}
RULE_KS = (8, 32)
# The compression target of issue 13: at least this many times fewer bytes than dense.
TARGET_RATIO = 100.0
TARGET_DELTA = 0.03  # held-out loss within 3% of AdamW's mean
LONG_FACTOR = 3  # the longer horizon: this many times the workload's steps
COMPRESSED_FAMILIES = ("demo", "demo-rms", "demo-adam", "demo-ns", "sparseloco", "diloco")
# `--on module:factory`: calibrate on your own workload with a small grid (2 ranks, 1 seed)
CALIBRATION_METHODS = (
    "adamw",
    "demo-compact-k32-c64",
    "demo-sign-k32-c64",
    "sparseloco-h5-k64-int2",
    "sparseloco-h10-k16-int2",
)
CALIBRATION_STEPS = 200
CALIBRATION_OUT = "calibration"
CALIBRATION_TOLERANCE = 0.03  # a recommendation must stay within this of AdamW's held-out loss


# --------------------------------------------------------------------------------------------
# methods and workloads


@dataclass(frozen=True)
class MethodDef:
    """A method of the study: its label, family (for lr grids and colours) and runner options."""

    label: str
    family: str  # adamw | sgd | powersgd | demo | demo-rms | demo-adam | demo-ns | sparseloco | diloco
    runner: str  # the cokit.train method name
    options: tuple[tuple[str, Any], ...] = ()
    about: str = ""

    def spec(self, lr: float, seed: int, steps: int) -> MethodSpec:
        """The runner spec of this method at ``lr`` (PowerSGD: 10% dense warm-up, seeded; a
        ``dense_warmup_fraction`` becomes SparseLoCo's ``dense_warmup`` steps of this run)."""
        opts = dict(self.options)
        if self.runner == "powersgd":
            opts.update(start_iter=max(2, steps // 10), seed=seed)
        fraction = opts.pop("dense_warmup_fraction", None)
        if fraction is not None:
            opts["dense_warmup"] = max(1, round(fraction * steps))
        return MethodSpec(self.runner, lr, options=opts, label=self.label)


def _infrequent_methods() -> list[tuple[str, tuple[tuple[str, Any], ...], str]]:
    """SparseLoCo (top-k pseudo-gradients, error feedback, low-bit values) and DiLoCo (dense
    pseudo-gradients, outer Nesterov): label, options, description. The lr is the inner AdamW's."""
    out: list[tuple[str, tuple[tuple[str, Any], ...], str]] = []
    for h, k, chunk, payload, dct in (
        (5, 64, 64, "int2", False),
        (10, 64, 64, "int2", False),
        (30, 64, 64, "int2", False),
        (10, 64, 64, "int2", True),
        (10, 64, 64, "sign", False),
        (10, 16, 64, "int2", False),
        # chunk 32 (32x32 tiles): DeMo's best tiles on text
        (10, 16, 32, "int2", False),
        (10, 32, 32, "int2", False),
        (5, 16, 32, "int2", False),
    ):
        label = (
            f"sparseloco-h{h}-k{k}-{payload}"
            + ("-dct" if dct else "")
            + ("" if chunk == 64 else f"-c{chunk}")
        )
        opts = (("sync_every", h), ("topk", k), ("chunk", chunk), ("payload", payload), ("dct", dct))
        about = (
            f"SparseLoCo: {h} local AdamW steps, then top-{k} per {chunk}-tile"
            + (" DCT coefficients" if dct else "")
            + f" of the error-fed pseudo-gradient, {payload} values"
        )
        out.append((label, opts, about))
    for h in (10, 30):
        dense: tuple[tuple[str, Any], ...] = (
            ("sync_every", h),
            ("topk", None),
            ("outer", "nesterov"),
            ("outer_lr", 0.7),
            ("outer_momentum", 0.9),
        )
        out.append(
            (
                f"diloco-h{h}",
                dense,
                f"DiLoCo: {h} local AdamW steps, dense pseudo-gradient "
                "all-reduce, outer Nesterov (lr 0.7, momentum 0.9)",
            )
        )
    return out


def method_catalog() -> dict[str, MethodDef]:
    """Every method the study knows, by label, in table order."""
    ms = [
        MethodDef("adamw", "adamw", "adamw", about="AdamW, dense fp32 all-reduce (baseline)"),
        MethodDef(
            "sgd-momentum",
            "sgd",
            "sgd",
            (("momentum", 0.9),),
            about="SGD, momentum 0.9, dense fp32 all-reduce",
        ),
    ]
    for r in (1, 4):
        ms.append(
            MethodDef(
                f"powersgd-r{r}",
                "powersgd",
                "powersgd",
                (("rank", r),),
                about=f"torch DDP powerSGD_hook rank {r} (error feedback, warm start, "
                "10% dense warm-up) + AdamW",
            )
        )
    for payload in ("reference", "sign"):
        ms.append(
            MethodDef(
                f"demo-{payload}-k32-c64",
                "demo",
                "demo",
                (("compression_topk", 32), ("compression_chunk", 64), ("payload", payload)),
                about=f"DeMo k=32 chunk=64, {payload} payload",
            )
        )
    for chunk in DEMO_CHUNKS:
        for k in DEMO_KS:
            ms.append(
                MethodDef(
                    f"demo-compact-k{k}-c{chunk}",
                    "demo",
                    "demo",
                    (("compression_topk", k), ("compression_chunk", chunk), ("payload", "compact")),
                    about=f"DeMo k={k} chunk={chunk}, compact payload (int16 idx + bf16 values)",
                )
            )
    for rule, family in RULE_FAMILIES.items():
        for k in RULE_KS:
            ms.append(
                MethodDef(
                    f"demo-{rule}-k{k}-c64",
                    family,
                    "demo",
                    (
                        ("compression_topk", k),
                        ("compression_chunk", 64),
                        ("payload", "compact"),
                        ("update_rule", RULE_NAMES[rule]),
                    ),
                    about=f"DeMo k={k} chunk=64 compact, {RULE_NAMES[rule]} update rule on the "
                    "decoded direction",
                )
            )
    for label, opts, about in _infrequent_methods():
        ms.append(MethodDef(label, label.split("-")[0], "sparseloco", opts, about=about))
    return {m.label: m for m in ms}


@dataclass(frozen=True)
class WorkloadDef:
    """A workload of the study: a picklable factory, its step budget and lr grid per family."""

    name: str
    factory: Any  # TextWorkloadConfig | DigitsWorkloadConfig (has .build(device))
    steps: int
    eval_every: int
    lrs: tuple[tuple[str, tuple[float, ...]], ...]

    def grid(self, family: str, points: int) -> tuple[float, ...]:
        """The family's lr grid: all of it, or (``points == 1``) one value from its middle.
        Families without a grid of their own use AdamW's: their lr rules say AdamW's lr carries
        over (DeMo's update rules; the inner AdamW of SparseLoCo and DiLoCo)."""
        lrs = dict(self.lrs)
        grid = lrs.get(family, lrs["adamw"])
        return grid if points >= len(grid) else (grid[len(grid) // 2],)


# Four points per family, half a decade apart. With three, DeMo's best lr moved between grid
# edges with k and chunk (1e-3 for small k at chunk 64, 3e-3 at chunk 32); four bracket them all.
GRID_POINTS = 4
_TEXT_LRS = (
    ("adamw", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("demo", (3e-4, 1e-3, 3e-3, 1e-2)),
)
_DIGITS_LRS = (
    ("adamw", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("demo", (1e-3, 3e-3, 1e-2, 3e-2)),
)


_AE_LRS = (
    ("adamw", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("sgd", (0.03, 0.1, 0.3, 1.0)),  # 0.01..0.3 put the best (0.3) on the edge
    ("powersgd", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("demo", (1e-3, 3e-3, 1e-2, 3e-2)),
)


_USER_LRS = (
    ("adamw", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("demo", (3e-4, 1e-3, 3e-3, 1e-2)),
)


def user_workload(spec: str, steps: int | None = None) -> WorkloadDef:
    """``--on module:factory`` as the study's one workload, named ``yours`` (the factory is
    imported and called here first: its errors come before any rank starts)."""
    from cokit.validation.user_workload import UserWorkloadFactory

    n = CALIBRATION_STEPS if steps is None else steps
    return WorkloadDef("yours", UserWorkloadFactory.checked(spec), n, max(1, min(20, n // 5)), _USER_LRS)


def make_workloads(preset: str, steps: int | None = None) -> list[WorkloadDef]:
    """The three workloads sized for ``preset`` (``steps`` overrides every step budget)."""
    from cokit.workloads import CorpusConfig, DigitsAEWorkloadConfig, ModelConfig, TextWorkloadConfig
    from cokit.workloads.digits import DigitsWorkloadConfig
    from cokit.workloads.text import VOCAB_SIZE

    if preset == "toy":
        text = TextWorkloadConfig(
            corpus=CorpusConfig(max_chars=40_000),
            model=ModelConfig(VOCAB_SIZE, d_model=32, n_layers=1, n_heads=2, max_seq_len=16),
            batch_size=2,
            eval_batches=2,
        )
        digits = DigitsWorkloadConfig(hidden=(32,), batch_size=8)
        ae = DigitsAEWorkloadConfig(channels=(4, 8, 8), latent=4, batch_size=8)
        budget = {"text": (4, 2), "digits": (4, 2), "digits-ae": (4, 2)}
    else:
        text = TextWorkloadConfig(
            corpus=CorpusConfig(max_chars=400_000),
            model=ModelConfig(VOCAB_SIZE, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
            batch_size=8,
            eval_batches=8,
        )
        digits = DigitsWorkloadConfig(hidden=(128, 128), batch_size=32)
        ae = DigitsAEWorkloadConfig(batch_size=32)
        budget = (
            {"text": (250, 25), "digits": (200, 20), "digits-ae": (200, 20)}
            if preset == "full"
            else {"text": (100, 10), "digits": (100, 10), "digits-ae": (100, 10)}
        )
    out = []
    for name, factory, lrs in (
        ("text", text, _TEXT_LRS),
        ("digits", digits, _DIGITS_LRS),
        ("digits-ae", ae, _AE_LRS),
    ):
        n, every = budget[name]
        if steps is not None:
            n, every = steps, max(1, min(every, steps // 4 or 1))
        out.append(WorkloadDef(name, factory, n, every, lrs))
    return out


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class StudyConfig:
    """Everything that defines a study run (see :func:`make_config` for the presets)."""

    preset: str
    out_dir: str
    world_size: int
    workloads: list[WorkloadDef]
    methods: list[str]
    headline: list[str]
    seeds: int
    lr_points: int
    long_horizon: bool = False  # phase 3: AdamW and the best >= 100x method at 3x the steps
    verbose: bool = False
    telemetry: bool = True  # each run writes out_dir/telemetry/<workload>-<method>-lr<lr>-s<seed>/
    calibration: bool = False  # --on: the user's workload; the report recommends a method
    methods_by_label: dict[str, MethodDef] = field(default_factory=method_catalog, repr=False)

    def method(self, label: str) -> MethodDef:
        return self.methods_by_label[label]


def make_config(
    preset: str = "full",
    *,
    out_dir: str | None = None,
    world_size: int | None = None,
    workloads: list[str] | None = None,
    methods: list[str] | None = None,
    seeds: int | None = None,
    lr_points: int | None = None,
    steps: int | None = None,
    long_horizon: bool | None = None,
    verbose: bool = False,
    telemetry: bool = True,
    on: str | None = None,
) -> StudyConfig:
    """A preset's configuration with optional overrides; raises ValueError on bad values.
    ``on``: ``module:factory``, your workload instead of the study's (a calibration grid)."""
    if on is not None:
        return _calibration_config(on, out_dir, world_size, methods, lr_points, steps, verbose, telemetry)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    catalog = method_catalog()
    if preset == "full":
        default_methods, default_seeds, default_points = list(catalog), 3, GRID_POINTS
    elif preset == "quick":
        default_methods = [
            "adamw",
            "sgd-momentum",
            "powersgd-r4",
            "demo-compact-k32-c64",
            "demo-sign-k32-c64",
        ]
        default_seeds, default_points = 1, GRID_POINTS
    else:
        default_methods, default_seeds, default_points = (
            ["adamw", "powersgd-r4", "demo-compact-k32-c64"],
            1,
            1,
        )
    methods = default_methods if methods is None else methods
    unknown = [m for m in methods if m not in catalog]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; --list-methods shows the labels")
    if not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods must be a non-empty list without repeats, got {','.join(methods)!r}")
    all_workloads = make_workloads(preset, steps)
    names = [w.name for w in all_workloads]
    workloads = names if workloads is None else workloads
    if not workloads or any(w not in names for w in workloads) or len(set(workloads)) != len(workloads):
        raise ValueError(
            f"workloads must be distinct names from: {', '.join(names)}; got {','.join(workloads)}"
        )
    world = 2 if preset == "toy" else 4
    world = world if world_size is None else world_size
    if not 1 <= world <= 64:
        raise ValueError(f"world size must be in [1, 64], got {world}")
    seeds = default_seeds if seeds is None else seeds
    if not 1 <= seeds <= 10:
        raise ValueError(f"seeds must be in [1, 10], got {seeds}")
    points = default_points if lr_points is None else lr_points
    if points not in (1, GRID_POINTS):
        raise ValueError(f"lr points must be 1 (one value from the grid) or {GRID_POINTS}, got {points}")
    return StudyConfig(
        preset=preset,
        out_dir=out_dir or DEFAULT_OUT[preset],
        world_size=world,
        workloads=[w for w in all_workloads if w.name in workloads],
        methods=list(methods),
        headline=[m for m in HEADLINE if m in methods],
        seeds=seeds,
        lr_points=points,
        long_horizon=preset == "full" if long_horizon is None else long_horizon,
        verbose=verbose,
        telemetry=telemetry,
    )


def _calibration_config(
    on: str,
    out_dir: str | None,
    world_size: int | None,
    methods: list[str] | None,
    lr_points: int | None,
    steps: int | None,
    verbose: bool,
    telemetry: bool,
) -> StudyConfig:
    """``--on``: the calibration grid on the user's workload (2 ranks, 1 seed, no long horizon)."""
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    methods = list(CALIBRATION_METHODS) if methods is None else methods
    catalog = method_catalog()
    unknown = [m for m in methods if m not in catalog]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; --list-methods shows the labels")
    if "adamw" not in methods or len(set(methods)) != len(methods):
        raise ValueError("--on needs 'adamw' among the methods (the reference), without repeats")
    world = 2 if world_size is None else world_size
    if not 2 <= world <= 64:
        raise ValueError(f"world size must be in [2, 64] (compression needs ranks), got {world}")
    points = GRID_POINTS if lr_points is None else lr_points
    if points not in (1, GRID_POINTS):
        raise ValueError(f"lr points must be 1 or {GRID_POINTS}, got {points}")
    return StudyConfig(
        preset="quick",
        out_dir=out_dir or CALIBRATION_OUT,
        world_size=world,
        workloads=[user_workload(on, steps)],
        methods=methods,
        headline=[],
        seeds=1,
        lr_points=points,
        long_horizon=False,
        verbose=verbose,
        telemetry=telemetry,
        calibration=True,
    )


# --------------------------------------------------------------------------------------------
# planning and running


_SPEC_CORE = ("name", "lr", "weight_decay", "options", "label", "schedule", "warmup")


def _spec_identity(spec: MethodSpec) -> dict[str, Any]:
    """The spec's fields that define a run: the core ones, plus any other field that differs
    from its default (so adding a defaulted field to MethodSpec keeps finished runs valid)."""
    fields = dataclasses.asdict(spec)
    defaults = dataclasses.asdict(MethodSpec(spec.name, spec.lr))
    return {k: v for k, v in fields.items() if k in _SPEC_CORE or v != defaults.get(k)}


def _key(wl: WorkloadDef, spec: MethodSpec, seed: int, world: int) -> str:
    blob = json.dumps(
        [repr(wl.factory), wl.steps, wl.eval_every, world, _spec_identity(spec), seed],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_path(out_dir: str, workload: str, method: str, lr: float, seed: int) -> str:
    """Where one run's JSON lives."""
    return os.path.join(out_dir, "runs", workload, method, f"lr{lr:g}-s{seed}.json")


def telemetry_run(workload: str, method: str, lr: float, seed: int) -> str:
    """The telemetry run name of one run (its stream: ``<out>/telemetry/<name>/rank<r>.jsonl``)."""
    return f"{workload}-{method}-lr{lr:g}-s{seed}"


def make_job(cfg: Any, wl: WorkloadDef, label: str, lr: float, seed: int, **spec_fields: Any):
    """The :class:`cokit.validation.runs.Job` for one point of the study (``spec_fields``: other
    :class:`~cokit.train.MethodSpec` fields, e.g. the lr schedule, part of the run's key)."""
    from cokit.validation.runs import Job

    m = cfg.method(label)
    spec = dataclasses.replace(m.spec(lr, seed, wl.steps), **spec_fields)
    return Job(
        workload=wl.name,
        method=label,
        family=m.family,
        spec=spec,
        seed=seed,
        steps=wl.steps,
        eval_every=wl.eval_every,
        path=run_path(cfg.out_dir, wl.name, label, lr, seed),
        key=_key(wl, spec, seed, cfg.world_size),
        extra={"about": m.about},
        telemetry_dir=cfg.out_dir if cfg.telemetry else None,
        telemetry_run=telemetry_run(wl.name, label, lr, seed),
    )


def load_run(path: str, key: str | None = None) -> dict | None:
    """A run's JSON, or None when missing, unreadable or (with ``key``) from another config."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if key is None or doc.get("key") == key else None


def sweep_jobs(cfg: StudyConfig, wl: WorkloadDef) -> list:
    """Phase 1: every method at every lr of its grid, seed 0."""
    return [
        make_job(cfg, wl, m, lr, 0)
        for m in cfg.methods
        for lr in wl.grid(cfg.method(m).family, cfg.lr_points)
    ]


def _best_seed0(records: list[dict], min_ratio: float = 0.0) -> dict | None:
    """The seed-0 run with the lowest finite final held-out loss among ``records`` (at least
    ``min_ratio`` times fewer bytes than dense), or None."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok"
        and r["seed"] == 0
        and r["summary"]["final_heldout_loss"] is not None
        and (r["summary"]["ratio_to_dense"] or 0.0) >= min_ratio
    ]
    return min(ok, key=lambda r: r["summary"]["final_heldout_loss"]) if ok else None


def headline_methods(cfg: StudyConfig, sweep_records: list[dict]) -> list[str]:
    """The methods that get more seeds: the fixed headline ones, then per family the best
    configuration (seed 0, best lr) and the best one at >= ``TARGET_RATIO`` x fewer bytes."""
    out = list(cfg.headline)
    families = dict.fromkeys(cfg.method(m).family for m in cfg.methods)
    for fam in families:
        mine = [
            r for r in sweep_records if r["method"] in cfg.methods and cfg.method(r["method"]).family == fam
        ]
        for min_ratio in (0.0, TARGET_RATIO):
            best = _best_seed0(mine, min_ratio)
            if best is not None and best["method"] not in out:
                out.append(best["method"])
    return out


def seed_jobs(cfg: StudyConfig, wl: WorkloadDef, sweep_records: list[dict]) -> list:
    """Phase 2: the headline methods at their best lr (from phase 1's run JSONs), seeds 1..seeds-1."""
    jobs: list = []
    for m in headline_methods(cfg, sweep_records):
        lr = best_lr([r for r in sweep_records if r["method"] == m])
        if lr is not None:
            jobs.extend(make_job(cfg, wl, m, lr, s) for s in range(1, cfg.seeds))
    return jobs


def long_workload(wl: WorkloadDef) -> WorkloadDef:
    """``wl`` with ``LONG_FACTOR`` times the steps (its runs live under ``runs/<name>-x3/``)."""
    return dataclasses.replace(
        wl,
        name=f"{wl.name}-x{LONG_FACTOR}",
        steps=wl.steps * LONG_FACTOR,
        eval_every=wl.eval_every * LONG_FACTOR,
    )


def long_methods(cfg: StudyConfig, sweep_records: list[dict]) -> list[str]:
    """Phase 3's methods: AdamW and the best compressed configuration at >= ``TARGET_RATIO`` x
    fewer bytes (seed 0 of phase 1)."""
    compressed = [
        r
        for r in sweep_records
        if r["method"] in cfg.methods and cfg.method(r["method"]).family in COMPRESSED_FAMILIES
    ]
    best = _best_seed0(compressed, TARGET_RATIO)
    out = ["adamw"] if "adamw" in cfg.methods else []
    return out + ([best["method"]] if best is not None else [])


def long_jobs(cfg: StudyConfig, wl: WorkloadDef, sweep_records: list[dict]) -> list:
    """Phase 3: :func:`long_methods` at their best lr of phase 1, seed 0, ``LONG_FACTOR`` x the steps."""
    longer = long_workload(wl)
    jobs = []
    for m in long_methods(cfg, sweep_records):
        lr = best_lr([r for r in sweep_records if r["method"] == m])
        if lr is not None:
            jobs.append(make_job(cfg, longer, m, lr, 0))
    return jobs


def _execute(cfg: Any, wl: WorkloadDef, jobs: list, phase: str, run: bool = True) -> list[dict]:
    """Run the jobs without a current JSON (unless ``run`` is false); return the JSONs of the
    jobs that have one. ``cfg``: a study or protocol configuration (its ``world_size`` and
    ``verbose``)."""
    from cokit.train import run_distributed
    from cokit.validation.runs import run_jobs

    docs = [load_run(j.path, j.key) for j in jobs]
    todo = [j for j, doc in zip(jobs, docs) if doc is None]
    if not run:
        return [doc for doc in docs if doc is not None]
    print(
        f"[{wl.name}] {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} already done, "
        f"{len(todo)} to run ({wl.steps} steps each, {cfg.world_size} gloo ranks)",
        flush=True,
    )
    if todo:
        run_distributed(
            run_jobs,
            todo,
            wl.factory,
            "cpu",
            cfg.verbose,
            world_size=cfg.world_size,
            device="cpu",
            # a guard against a hang only (each run's collectives time out on their own): 2 s a
            # step, 5 min at least, per run; 300 s a run failed a batch of 750-step runs of a
            # 1.28M-parameter model on a loaded 2-core machine (about 500 s each there)
            timeout=600.0 + len(todo) * max(300.0, 2.0 * wl.steps),
        )
    docs = [doc if doc is not None else load_run(j.path, j.key) for j, doc in zip(jobs, docs)]
    return [doc for doc in docs if doc is not None]


def machine_info() -> dict[str, Any]:
    """CPU model, cores, OS and library versions of this machine."""
    import torch
    import triton

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def describe(cfg: StudyConfig) -> dict[str, Any]:
    """JSON-ready description of the configuration (for ``study.json``)."""
    wls = {}
    for wl in cfg.workloads:
        wls[wl.name] = {
            "steps": wl.steps,
            "eval_every": wl.eval_every,
            "config": repr(wl.factory),
            "lr_grids": {f: list(wl.grid(f, cfg.lr_points)) for f, _ in wl.lrs},
        }
    return {
        "preset": cfg.preset,
        "world_size": cfg.world_size,
        "device": "cpu",
        "backend": "gloo",
        "seeds": cfg.seeds,
        "lr_points": cfg.lr_points,
        "long_horizon": cfg.long_horizon
        and {
            "factor": LONG_FACTOR,
            "methods": f"adamw and the best compressed method at >= {TARGET_RATIO:g}x fewer bytes",
        },
        "target": {
            "workload": "text",
            "max_delta_vs_adamw": TARGET_DELTA,
            "min_ratio_to_dense": TARGET_RATIO,
        },
        "methods": {m: cfg.method(m).about for m in cfg.methods},
        "headline": cfg.headline,
        "workloads": wls,
        "lr_selection": "lowest final held-out loss of the seed-0 run",
    }


def run_study(cfg: StudyConfig, report_only: bool = False) -> dict[str, Any]:
    """Run the missing runs of every phase, then write the report; return ``study.json``'s dict."""

    os.makedirs(cfg.out_dir, exist_ok=True)
    start = time.perf_counter()
    run = not report_only
    records = {
        wl.name: _execute(cfg, wl, sweep_jobs(cfg, wl), "lr sweep (seed 0)", run) for wl in cfg.workloads
    }
    if cfg.seeds > 1:
        for wl in cfg.workloads:
            records[wl.name] += _execute(
                cfg,
                wl,
                seed_jobs(cfg, wl, records[wl.name]),
                f"headline seeds 1..{cfg.seeds - 1} at the best lr",
                run,
            )
    longer: dict[str, list[dict]] = {}
    if cfg.long_horizon:
        for wl in cfg.workloads:
            sweep = [r for r in records[wl.name] if r["seed"] == 0]
            longer[wl.name] = _execute(
                cfg, long_workload(wl), long_jobs(cfg, wl, sweep), f"{LONG_FACTOR}x the steps, seed 0", run
            )
    info = {
        **describe(cfg),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "elapsed_s_this_invocation": round(time.perf_counter() - start, 1),
        "run_time_s_all_runs": round(sum(r.get("elapsed_s", 0.0) for rs in records.values() for r in rs), 1),
        "workload_info": _workload_info(cfg, records),
    }
    if cfg.calibration:
        info["calibration_tolerance"] = CALIBRATION_TOLERANCE
    return write_report(cfg.out_dir, info, records, cfg, longer)


def _workload_info(cfg: StudyConfig, records: dict[str, list[dict]]) -> dict[str, Any]:
    """Each workload's ``info()`` and parameter count (from its run JSONs; a model is built
    only when no run recorded it)."""
    out = {}
    for wl in cfg.workloads:
        w = wl.factory.build("cpu")
        n = next((r["num_params"] for r in records.get(wl.name, []) if "num_params" in r), None)
        if n is None:
            n = sum(p.numel() for p in w.build_model(0).parameters())
        out[wl.name] = {**w.info(), "num_params": n}
    return out


# --------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The study's command-line options (shared by ``cokit bench validate`` and the script)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs, 5 methods, 1 seed (< 10 minutes on 2 CPU cores); same as --preset quick",
    )
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="full (default): every method x 4 lrs, 3 seeds for the headline rows; "
        "quick; toy (seconds, for tests)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: benchmarks/results/validation for "
        "full, benchmarks/out/validation-<preset> otherwise)",
    )
    p.add_argument("--world-size", type=int, default=None, help="gloo ranks to spawn (default 4; toy: 2)")
    p.add_argument(
        "--workloads", default=None, help="comma list of text,digits,digits-ae (default: all three)"
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma list of method labels (default: the preset's); see --list-methods",
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds for the headline methods (full: 3)")
    p.add_argument(
        "--lr-points",
        type=int,
        default=None,
        choices=(1, GRID_POINTS),
        help=f"{GRID_POINTS}: each method's lr grid (default); 1: one value from its middle",
    )
    p.add_argument("--steps", type=int, default=None, help="override the steps of every workload")
    p.add_argument(
        "--long-horizon",
        choices=("on", "off"),
        default=None,
        help=f"phase 3: AdamW and the best >= {TARGET_RATIO:g}x-compressed method at {LONG_FACTOR}x the "
        "steps (default: on for full)",
    )
    p.add_argument(
        "--on",
        default=None,
        metavar="MODULE:FACTORY",
        help="calibrate on YOUR model and data: factory() returns {'model', 'batch', 'heldout', 'loss'} "
        f"(docs/validation-study.md); a small grid on 2 ranks, {CALIBRATION_STEPS} steps, into ./{CALIBRATION_OUT}/",
    )
    p.add_argument(
        "--protocol",
        choices=("grid", "transfer"),
        default="grid",
        help="grid (default): every method on every workload; transfer: choose settings on the "
        "selection workloads, report them on held-out ones (cokit.validation.transfer)",
    )
    p.add_argument("--select", default=None, help="transfer: comma list of selection workloads")
    p.add_argument("--heldout", default=None, help="transfer: comma list of held-out workloads")
    p.add_argument("--candidates", default=None, help="transfer: comma list of candidate method labels")
    p.add_argument("--report-only", action="store_true", help="rebuild table and plots from existing JSONs")
    p.add_argument("--list-methods", action="store_true", help="print the method labels and exit")
    p.add_argument("--verbose", action="store_true", help="a progress line per evaluation, tracebacks")
    p.add_argument(
        "--no-telemetry",
        action="store_true",
        help="do not write each run's per-step telemetry stream (default: "
        "<out>/telemetry/<workload>-<method>-lr<lr>-s<seed>/rank<r>.jsonl, for `cokit dashboard`)",
    )


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def config_from_args(args: argparse.Namespace) -> Any:
    """Build the configuration (a :class:`StudyConfig`, or with ``--protocol transfer`` a
    :class:`cokit.validation.transfer.TransferConfig`); ValueError with a one-line message on
    bad arguments."""
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick conflicts with --preset {args.preset}")
    preset = "quick" if args.quick else (args.preset or "full")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a folder")
    transfer_only = {"--select": args.select, "--heldout": args.heldout, "--candidates": args.candidates}
    if args.protocol == "transfer":
        from cokit.validation import transfer

        grid_only = {
            "--on": args.on,
            "--workloads": args.workloads,
            "--methods": args.methods,
            "--lr-points": args.lr_points,
            "--steps": args.steps,
            "--long-horizon": args.long_horizon,
        }
        given = [k for k, v in grid_only.items() if v is not None]
        if given:
            raise ValueError(
                f"--protocol transfer chooses its own grid and horizons; drop {', '.join(given)}"
            )
        return transfer.make_config(
            preset,
            out_dir=args.out,
            world_size=args.world_size,
            select=_split(args.select),
            heldout=_split(args.heldout),
            candidates=_split(args.candidates),
            seeds=args.seeds,
            verbose=args.verbose,
        )
    given = [k for k, v in transfer_only.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} belong to --protocol transfer")
    on = getattr(args, "on", None)
    if on is not None and (args.quick or args.preset or args.workloads or args.seeds or args.long_horizon):
        raise ValueError(
            "--on runs its own grid: it takes --methods, --steps, --lr-points, --world-size, --out"
        )
    return make_config(
        preset,
        out_dir=args.out,
        world_size=args.world_size,
        workloads=_split(args.workloads),
        methods=_split(args.methods),
        seeds=args.seeds,
        lr_points=args.lr_points,
        steps=args.steps,
        long_horizon=None if args.long_horizon is None else args.long_horizon == "on",
        verbose=args.verbose,
        telemetry=not getattr(args, "no_telemetry", False),
        on=on,
    )


def run_from_args(args: argparse.Namespace, cfg: StudyConfig | None = None) -> int:
    """Run the study the arguments describe (``cfg``: their configuration, when already built);
    print the table; return an exit code."""
    if args.list_methods:
        for label, m in method_catalog().items():
            print(f"{label:28s} {m.about}")
        return 0
    cfg = config_from_args(args) if cfg is None else cfg
    if not isinstance(cfg, StudyConfig):
        from cokit.validation.transfer import run_transfer

        print(
            f"held-out protocol, preset {cfg.preset}: {len(cfg.candidates)} candidates chosen on "
            f"{', '.join(w.name for w in cfg.select)}, reported on {', '.join(w.name for w in cfg.heldout)}; "
            f"{cfg.world_size} gloo ranks; {cfg.seeds} seeds; out {cfg.out_dir}",
            flush=True,
        )
        doc = run_transfer(cfg, report_only=args.report_only)
        print()
        print(doc["markdown"])
        print(f"wrote {', '.join(doc['files'])} in {cfg.out_dir}")
        return 0
    print(
        f"validation study, preset {cfg.preset}: {len(cfg.methods)} methods x "
        f"{cfg.lr_points} lr(s) x {len(cfg.workloads)} workload(s); {cfg.world_size} gloo ranks on "
        f"{os.cpu_count()} CPU cores; headline seeds {cfg.seeds}; out {cfg.out_dir}",
        flush=True,
    )
    doc = run_study(cfg, report_only=args.report_only)
    print()
    print(doc["table_markdown"])
    print(f"\nwrote {', '.join(doc['files'])} in {cfg.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/validate_compression.py [options]``."""
    p = argparse.ArgumentParser(prog="validate_compression", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    cfg = None
    if not args.list_methods:
        try:
            cfg = config_from_args(args)
        except ValueError as exc:
            print(f"validate_compression: error: {exc}", file=sys.stderr)
            return 2
    return run_from_args(args, cfg)
