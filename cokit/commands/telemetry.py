"""``cokit telemetry export``: rebuild CSV or Parquet tables from a run's telemetry JSONL.

    cokit telemetry export demo_out --format parquet          # beside each rank<r>.jsonl
    cokit telemetry export demo_out --format csv --out tables # tables/<run>/rank<r>.csv

A RUN_DIR is a results folder holding telemetry/<run>/rank<r>.jsonl, the telemetry folder
itself, or one run's folder (as for `cokit dashboard`). One table per rank file, like the
sinks write: <run>/rank<r>.csv or .parquet (every row carries its run and rank, so tables
concatenate). Rows: the step and summary records (--kinds all: every record), flattened
(comm.exposed_s columns; lists as JSON text), with every column any record has and time_iso
(ISO-8601 UTC) beside time. Each table is written atomically; a killed run's partial last
line, and any other line that is not JSON (or is nested deeper than 100 levels), is skipped
and counted, and stderr names its file and line. Exporting Parquet beside the JSONL replaces the part files a
killed run's Parquet sink left (rank<r>.part-NNNNN.parquet). Parquet columns are typed
(step, rank... int64): an integer beyond int64 there is written as null, and a warning names
the column and the count (CSV keeps such integers).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from cokit.cli import CliError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cokit telemetry`` and its ``export`` subcommand."""
    from cokit.telemetry.export import FORMATS

    p = subparsers.add_parser(
        "telemetry",
        help="work with telemetry files: export CSV/Parquet tables from the JSONL",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = sub.add_parser(
        "export",
        help="rebuild CSV or Parquet tables (one per rank) from the JSONL, e.g. after a crash",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("run_dir", metavar="RUN_DIR", help="results folder holding telemetry/ (or a run's folder)")
    e.add_argument("--format", required=True, choices=FORMATS, help="table format")
    e.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write DIR/<run>/rank<r>.<format> (default: beside each rank<r>.jsonl)",
    )
    e.add_argument(
        "--kinds",
        default="step,summary",
        help="record kinds to keep, comma-separated (default step,summary; 'all': every record)",
    )
    e.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Find the rank files, check --out, write one table per rank, print each path."""
    from cokit.files import OutputError, WriteError, prepare_out_dir
    from cokit.telemetry.export import export_table, run_files
    from cokit.telemetry.sinks import TableWarning

    if not Path(args.run_dir).is_dir():
        what = "does not exist" if not Path(args.run_dir).exists() else "is a file"
        raise CliError(
            f"RUN_DIR {args.run_dir} {what}; give a results folder holding telemetry/<run>/rank<r>.jsonl"
        )
    files = run_files(args.run_dir)
    if not files:
        raise CliError(f"no telemetry under {args.run_dir}: no telemetry/<run>/rank<r>.jsonl files")
    kinds = None if args.kinds.strip() == "all" else [k.strip() for k in args.kinds.split(",") if k.strip()]
    if kinds is not None and not kinds:
        raise CliError("--kinds names no record kind; give e.g. step,summary or all")
    targets = []
    for run_name, path, rank in files:
        folder = Path(args.out) / run_name if args.out is not None else path.parent
        targets.append((path, folder / f"rank{rank}.{args.format}"))
    try:
        for folder in dict.fromkeys(t.parent for _, t in targets):
            prepare_out_dir(folder, (), overwrite=True, flag="--out")
        for path, target in targets:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TableWarning)
                done = export_table(path, target, args.format, kinds)
            note = f"; {done.skipped} unreadable line(s) skipped" if done.skipped else ""
            print(f"wrote {done.path} ({done.rows} rows{note})")
            if done.skipped and done.lines is not None:
                print(f"cokit telemetry export: {done.lines.describe()}", file=sys.stderr)
            for w in caught:
                if issubclass(w.category, TableWarning):
                    print(f"cokit telemetry export: warning: {w.message}", file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    except (ImportError, OutputError, WriteError) as exc:
        raise CliError(str(exc)) from None
    return 0
