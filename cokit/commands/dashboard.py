"""``cokit dashboard``: one offline HTML page from the telemetry of one or more runs.

    cokit dashboard demo_out                      # writes demo_out/dashboard.html
    cokit dashboard runs/a runs/b --out cmp.html  # overlays every run of both folders

A RUN_DIR is a results folder holding telemetry/<run>/rank<r>.jsonl (what `cokit demo`,
`cokit sweep` and `cokit bench validate` write), the telemetry folder itself, or one run's
folder. Every run found is overlaid in its own color. Panels: loss against step, wall time
and bytes sent; the step time split into compute, encode/decode and exposed communication
(hidden communication hatched); bytes per step and compression ratio; kernel configs and
blocks per SM beside the exposed-communication fraction; per-rank step time (stragglers);
tuner decisions. The page embeds plotly.js: it opens from disk with no network.

Unreadable lines (a truncated last line, corrupt bytes) are skipped and counted on stderr;
exit 2 when nothing readable is left. --out is checked before anything is read, and an
existing file is kept unless --overwrite.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cokit.cli import CliError

OUT_NAME = "dashboard.html"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit dashboard``."""
    p = subparsers.add_parser(
        "dashboard",
        help="one offline HTML page of telemetry: loss, step-time split, bytes, occupancy, ranks, tuner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="results folder(s) holding telemetry/")
    p.add_argument(
        "--out",
        default=None,
        help=f"HTML file to write (default: the first RUN_DIR/{OUT_NAME}); checked for writing before "
        "anything is read, and refused when it exists unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--max-points",
        type=int,
        default=None,
        metavar="N",
        help="points per line before long runs are averaged over consecutive steps (default 2000; 0: never)",
    )
    p.add_argument("--title", default="cokit dashboard", help="page title (default 'cokit dashboard')")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the RUN_DIRs and --out, read the telemetry, write the page, print its path."""
    try:
        from cokit.dashboard import DEFAULT_MAX_POINTS, TelemetryError, build_dashboard
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "plotly":
            raise
        raise CliError(
            "cokit dashboard draws with plotly, an optional extra that is not installed: "
            "pip install 'cokit[dashboard]' (or pip install plotly)"
        ) from None
    from cokit.files import OutputError

    max_points = DEFAULT_MAX_POINTS if args.max_points is None else args.max_points
    if max_points < 0:
        raise CliError(f"--max-points {max_points} is invalid; allowed: 0 (never average) or more")
    out = args.out if args.out is not None else os.path.join(args.run_dirs[0], OUT_NAME)
    t0 = time.perf_counter()
    try:
        path = build_dashboard(
            args.run_dirs,
            out,
            overwrite=args.overwrite,
            max_points=max_points,
            title=args.title,
            log=lambda msg: print(f"cokit dashboard: {msg}", file=sys.stderr, flush=True),
        )
    except (TelemetryError, OutputError) as exc:
        raise CliError(str(exc)) from None
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s); open it in a browser")
    return 0
