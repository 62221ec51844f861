"""``cokit bench validate --on module:factory``: a small grid on your own model and data.

The factory is described in :mod:`cokit.validation.user_workload`. The grid runs a few methods
(the dense baselines AdamW and Muon, and compressed settings) at 4 lrs, one seed, on 2 local
gloo ranks; the report (``<out>/table.md``) gives each method's gap against the dense run of
its own inner optimizer and against the best dense run, and recommends the most compressed
method within :data:`CALIBRATION_TOLERANCE` of the best dense run's held-out loss (or says that
the best dense run wins, and by how much). Everything here ships in the wheel:
calibrating needs no source checkout.
"""

from __future__ import annotations

from cokit.validation.grid import GRID_POINTS, StudyConfig, WorkloadDef, method_catalog
from cokit.validation.user_workload import UserWorkloadFactory

CALIBRATION_METHODS = (
    "adamw",
    "muon",
    "demo-compact-k32-c64",
    "demo-sign-k32-c64",
    "sparseloco-h5-k64-int2",
    "sparseloco-h10-k16-int2",
)
CALIBRATION_STEPS = 200
CALIBRATION_OUT = "calibration"
CALIBRATION_TOLERANCE = 0.03  # a recommendation must stay within this of the best dense run's loss

_USER_LRS = (
    ("adamw", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("muon", (3e-3, 1e-2, 3e-2, 0.1)),  # Muon's lr is ~10-20x AdamW's
    ("sgd", (0.01, 0.03, 0.1, 0.3)),
    ("powersgd", (3e-4, 1e-3, 3e-3, 1e-2)),
    ("demo", (3e-4, 1e-3, 3e-3, 1e-2)),
)


def user_workload(spec: str, steps: int | None = None) -> WorkloadDef:
    """``--on module:factory`` as the grid's one workload, named ``yours`` (the factory is
    imported and called here first: its errors come before any rank starts)."""
    n = CALIBRATION_STEPS if steps is None else steps
    return WorkloadDef("yours", UserWorkloadFactory.checked(spec), n, max(1, min(20, n // 5)), _USER_LRS)


def calibration_config(
    on: str,
    *,
    out_dir: str | None = None,
    world_size: int | None = None,
    methods: list[str] | None = None,
    lr_points: int | None = None,
    steps: int | None = None,
    verbose: bool = False,
    telemetry: bool = True,
) -> StudyConfig:
    """The calibration grid on ``on``'s workload (2 ranks, 1 seed, no long horizon);
    ValueError with a one-line message on bad values."""
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
        recommend_within=CALIBRATION_TOLERANCE,
        methods_by_label=catalog,
    )
