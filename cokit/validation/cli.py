"""The validation study: AdamW, Muon and SGD-momentum run dense (the baselines), PowerSGD, DeMo
(four inner update rules), SparseLoCo and DiLoCo at small scale; or, with ``--on``, a small grid on your own model.

    cokit bench validate --on mymodule:make_workload   # calibrate on your model -> ./calibration/
    cokit bench validate --decompose sparseloco-h5-k64-int2-muon --workloads prose   # the gap taken apart
    cokit bench validate               # the study, full mode -> benchmarks/results/validation/
    cokit bench validate --quick       # short runs, 1 seed -> benchmarks/out/validation-quick/
    python benchmarks/validate_compression.py --quick    # the same

``--on module:factory`` runs in any install (see docs/validation-study.md for the factory).
The study itself (its workloads, presets and the ``--protocol transfer`` held-out protocol)
is part of a source checkout, not of the wheel.

The study's three workloads, nothing downloaded: ``text`` (the demo's character-level
transformer on the Python standard library's own sources), ``digits`` (an MLP on
scikit-learn's bundled 8x8 digits) and ``digits-ae`` (a convolutional autoencoder of the same
images). Every method trains the same model from the same seed on the same batches for the
same number of steps, on ``--world-size`` local gloo ranks (CPU). Each method runs a small
learning-rate grid (4 values, seed 0; the dense baselines every seed); the lr with the lowest
final held-out loss (the dense baselines: its mean over the seeds) is reported. Every method's
gap is reported against the dense run of its own inner optimizer and against the best dense run.

Phases, each resumable (a run whose JSON exists with the same configuration is skipped):
1. the lr grid of every method on every workload (seed 0; the dense baselines every seed), then
   one point past each grid edge that won;
2. at their best lr, seeds 1..N-1: the fixed headline methods, and per family the best
   configuration and the best one at >= 100x fewer bytes than dense;
3. (full) AdamW, dense Muon and the best compressed configuration at >= 100x fewer bytes, at 3x
   the steps;
4. the report: ``table.md``, ``table.csv``, ``runs.csv``, ``study.json`` and the plots, with
   the Pareto front of held-out loss vs bytes per step and the >= 100x target check.

Every run also writes its per-step telemetry (each rank's JSONL in
``<out>/telemetry/<workload>-<method>-lr<lr>-s<seed>/``; ``cokit dashboard <out>`` draws it,
``--no-telemetry`` turns it off).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cokit._source_tree import checkout_module
from cokit.validation.calibrate import CALIBRATION_OUT, CALIBRATION_STEPS, calibration_config
from cokit.validation.grid import (
    GRID_POINTS,
    LONG_FACTOR,
    PRESETS,
    TARGET_RATIO,
    StudyConfig,
    method_catalog,
    run_study,
)

#: the checkout's modules of the study's two protocols
GRID_PROTOCOL = "cokit.bench.study.presets"
TRANSFER_PROTOCOL = "cokit.bench.study.transfer"
DECOMPOSE_PROTOCOL = "cokit.bench.study.decompose"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The study's command-line options (shared by ``cokit bench validate`` and the script)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs, 6 methods, 1 seed (5 methods took < 10 minutes on 2 CPU cores; dense Muon "
        "and the points past winning grid edges add runs); same as --preset quick",
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
        help=f"phase 3: AdamW, Muon and the best >= {TARGET_RATIO:g}x-compressed method at {LONG_FACTOR}x the "
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
        "selection workloads, report them on held-out ones (cokit.bench.study.transfer; a checkout's)",
    )
    p.add_argument("--select", default=None, help="transfer: comma list of selection workloads")
    p.add_argument("--heldout", default=None, help="transfer: comma list of held-out workloads")
    p.add_argument("--candidates", default=None, help="transfer: comma list of candidate method labels")
    p.add_argument(
        "--decompose",
        default=None,
        metavar="SETTING",
        help="take a SparseLoCo setting of the held-out protocol apart on --workloads (default prose): "
        "the dense run of its inner optimizer, then sparsification, value quantization, error "
        "feedback, sync interval and outer step each alone and together (cokit.bench.study.decompose)",
    )
    p.add_argument(
        "--ingredients", default=None, help="--decompose: comma list of ingredients (default: all)"
    )
    p.add_argument(
        "--horizon",
        type=int,
        default=None,
        help="--decompose: this many times the workload's steps (default 1)",
    )
    p.add_argument(
        "--lr-rule",
        choices=("dense", "own"),
        default=None,
        help="--decompose: every row at the lr of the dense run of the same inner optimizer (dense, "
        "default) or the SparseLoCo rows at the setting's own lr (own)",
    )
    p.add_argument(
        "--lrs",
        default=None,
        metavar="LABEL=LR,...",
        help="--decompose: lrs to use instead of choosing them on the workload (the dense baselines' "
        "and, with --lr-rule own, the setting's label), e.g. adamw=0.003,muon=0.03",
    )
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
    :class:`cokit.bench.study.transfer.TransferConfig`); ValueError with a one-line message on
    bad arguments."""
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick conflicts with --preset {args.preset}")
    preset = "quick" if args.quick else (args.preset or "full")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a folder")
    transfer_only = {"--select": args.select, "--heldout": args.heldout, "--candidates": args.candidates}
    decompose_only = {
        "--ingredients": getattr(args, "ingredients", None),
        "--horizon": getattr(args, "horizon", None),
        "--lr-rule": getattr(args, "lr_rule", None),
        "--lrs": getattr(args, "lrs", None),
    }
    if getattr(args, "decompose", None) is not None:
        return _decompose_config(args, preset, transfer_only)
    given = [k for k, v in decompose_only.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} belong to --decompose")
    if args.protocol == "transfer":
        transfer = checkout_module(TRANSFER_PROTOCOL, "cokit bench validate --protocol transfer")
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
    telemetry = not getattr(args, "no_telemetry", False)
    if on is not None:
        return calibration_config(
            on,
            out_dir=args.out,
            world_size=args.world_size,
            methods=_split(args.methods),
            lr_points=args.lr_points,
            steps=args.steps,
            verbose=args.verbose,
            telemetry=telemetry,
        )
    presets = checkout_module(GRID_PROTOCOL, "cokit bench validate without --on (the validation study)")
    return presets.make_config(
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
        telemetry=telemetry,
    )


def _decompose_config(args: argparse.Namespace, preset: str, transfer_only: dict[str, Any]) -> Any:
    """``--decompose``'s configuration (:func:`cokit.bench.study.decompose.make_config`)."""
    decompose = checkout_module(DECOMPOSE_PROTOCOL, "cokit bench validate --decompose")
    others = {
        **transfer_only,
        "--on": args.on,
        "--methods": args.methods,
        "--lr-points": args.lr_points,
        "--steps": args.steps,
        "--long-horizon": args.long_horizon,
        "--protocol transfer": "transfer" if args.protocol == "transfer" else None,
    }
    given = [k for k, v in others.items() if v is not None]
    if given:
        raise ValueError(
            f"--decompose uses the held-out protocol's workloads and rules; drop {', '.join(given)}"
        )
    return decompose.make_config(
        args.decompose,
        preset,
        out_dir=args.out,
        world_size=args.world_size,
        workloads=_split(args.workloads),
        ingredients=_split(args.ingredients),
        seeds=args.seeds,
        horizon=1 if args.horizon is None else args.horizon,
        lr_rule=args.lr_rule or "dense",
        lrs=decompose.parse_lrs(args.lrs),
        verbose=args.verbose,
    )


def _run_decomposition(args: argparse.Namespace, cfg: Any) -> int:
    """Run a ``--decompose`` configuration and print its tables."""
    run = checkout_module(DECOMPOSE_PROTOCOL, "--decompose").run_decomposition
    print(
        f"decomposition of {cfg.setting}, preset {cfg.preset}: {len(cfg.ingredients)} rows + the other dense "
        f"baseline on {', '.join(w.name for w in cfg.workloads)} at {cfg.horizon}x the steps; "
        f"{cfg.world_size} gloo ranks; {cfg.seeds} seed(s); lr rule {cfg.lr_rule}; out {cfg.out_dir}",
        flush=True,
    )
    doc = run(cfg, report_only=args.report_only)
    print()
    print(doc["markdown"])
    print(f"wrote {', '.join(doc['files'])} in {cfg.out_dir}")
    if doc["plots_skipped"]:
        print(f"plots not drawn: {doc['plots_skipped']}")
    return 0


def run_from_args(args: argparse.Namespace, cfg: StudyConfig | None = None) -> int:
    """Run the study the arguments describe (``cfg``: their configuration, when already built);
    print the table; return an exit code."""
    if args.list_methods:
        for label, m in method_catalog().items():
            print(f"{label:28s} {m.about}")
        return 0
    cfg = config_from_args(args) if cfg is None else cfg
    if getattr(args, "decompose", None) is not None:
        return _run_decomposition(args, cfg)
    if not isinstance(cfg, StudyConfig):
        run_transfer = checkout_module(TRANSFER_PROTOCOL, "--protocol transfer").run_transfer
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
    if doc["plots_skipped"]:
        print(f"plots not drawn: {doc['plots_skipped']}")
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
