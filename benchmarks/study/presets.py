"""The validation study's own grid: its presets and its three workloads (a checkout's).

``cokit bench validate [--quick | --preset toy]`` builds its configuration here and runs it
with :func:`cokit.validation.grid.run_study`; the command's options and the study's
description are in :mod:`cokit.validation.cli`.
"""

from __future__ import annotations

import os

from cokit.validation.grid import GRID_POINTS, PRESETS, StudyConfig, WorkloadDef, method_catalog

DEFAULT_OUT = {
    "full": os.path.join("benchmarks", "results", "validation"),
    "quick": os.path.join("benchmarks", "out", "validation-quick"),
    "toy": os.path.join("benchmarks", "out", "validation-toy"),
}
HEADLINE = ("adamw", "muon", "powersgd-r4", "demo-compact-k32-c64")
TARGET_WORKLOAD = "text"  # the >= 100x target is checked on it

# Muon's lr is ~10-20x AdamW's (its AdamW part runs at 0.05 x it)
_TEXT_LRS = (
    ("adamw", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("muon", (3e-3, 1e-2, 3e-2, 0.1)),
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("demo", (3e-4, 1e-3, 3e-3, 1e-2)),
)
_DIGITS_LRS = (
    ("adamw", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("muon", (1e-2, 3e-2, 0.1, 0.3)),
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("demo", (1e-3, 3e-3, 1e-2, 3e-2)),
)


_AE_LRS = (
    ("adamw", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("muon", (1e-2, 3e-2, 0.1, 0.3)),
    ("sgd", (0.03, 0.1, 0.3, 1.0)),  # 0.01..0.3 put the best (0.3) on the edge
    ("powersgd", (1e-3, 3e-3, 1e-2, 3e-2)),
    ("demo", (1e-3, 3e-3, 1e-2, 3e-2)),
)


def make_workloads(preset: str, steps: int | None = None) -> list[WorkloadDef]:
    """The three workloads sized for ``preset`` (``steps`` overrides every step budget)."""
    from cokit.bench.study.digits import DigitsWorkloadConfig
    from cokit.bench.study.digits_ae import DigitsAEWorkloadConfig
    from cokit.workloads import CorpusConfig, ModelConfig, TextWorkloadConfig
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
) -> StudyConfig:
    """A preset's configuration with optional overrides; raises ValueError on bad values."""
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
            "muon",
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
        target_workload=TARGET_WORKLOAD,
        methods_by_label=catalog,
    )
