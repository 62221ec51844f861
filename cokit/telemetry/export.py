"""Rebuild a run's tables from its JSONL: what ``cokit telemetry export`` does.

The JSONL stream is the source of truth (every sink gets the same records, and it survives a
kill line by line); :func:`export_table` turns one rank's file into one CSV or Parquet table
(records of ``kinds``, flattened like the table sinks, with every column any record has and
``time_iso``), written atomically. A partial last line (a killed run) and other unreadable
lines (not JSON, nested too deep) are skipped and counted by line number. Parquet types the
fixed columns (``step``, ``rank``... int64; ``metrics.*`` float64): an integer beyond int64
in an integer column, which CSV keeps, is written as null there, with a
:class:`~cokit.telemetry.sinks.TableWarning` naming the column and the count. Exporting Parquet into the sink's own path also removes the
part files a killed :class:`~cokit.telemetry.sinks.ParquetSink` left there (the export holds
their rows and more).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cokit.files import atomic_write_bytes, atomic_write_text, storage_errors
from cokit.telemetry.schema import Skipped, order_columns, read_records, table_row
from cokit.telemetry.sinks import (
    TABLE_KINDS,
    TableWarning,
    arrow_table,
    csv_text,
    nulled_text,
    parquet_bytes,
    part_paths,
)

__all__ = ["FORMATS", "Exported", "export_table", "run_files"]

#: the table formats :func:`export_table` writes
FORMATS = ("csv", "parquet")
_RANK_JSONL = re.compile(r"rank(\d+)\.jsonl")


def run_files(run_dir: str | os.PathLike) -> list[tuple[str, Path, int]]:
    """(run name, file, rank) of every ``rank<r>.jsonl`` under ``run_dir``: a results folder
    holding ``telemetry/<run>/``, the ``telemetry`` folder, or one run's folder; sorted by run
    then rank, empty when there are none. (The layouts ``cokit dashboard`` reads; kept here
    so that exporting needs no plotly; the dashboard reads with it too.)"""
    root = Path(run_dir)

    def ranks(folder: Path) -> list[tuple[Path, int]]:
        found = [
            (Path(e.path), m)
            for e in os.scandir(folder)
            if (m := _RANK_JSONL.fullmatch(e.name)) and e.is_file()
        ]
        return [(path, int(m.group(1))) for path, m in found]

    if root.is_dir() and ranks(root):
        return sorted((root.resolve().name, p, r) for p, r in ranks(root))
    for base in (root / "telemetry", root):
        if base.is_dir():
            found = [(sub.name, p, r) for sub in base.iterdir() if sub.is_dir() for p, r in ranks(sub)]
            if found:
                return sorted(found, key=lambda t: (t[0], t[2]))
    return []


@dataclass(frozen=True)
class Exported:
    """One table written: where, how many rows, how many JSONL lines were skipped, and which
    (``lines.describe()`` names the file, the first line numbers and the reasons); ``nulled``:
    per column, the values a Parquet column's type could not hold, written as null."""

    path: Path
    rows: int
    skipped: int
    lines: Skipped | None = None
    nulled: dict[str, int] = field(default_factory=dict)


def export_table(
    jsonl: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str,
    kinds: Iterable[str] | None = TABLE_KINDS,
) -> Exported:
    """Write the records of ``kinds`` (None: all) in the telemetry file ``jsonl`` as one table
    ``out`` in format ``fmt`` (``csv`` or ``parquet``), atomically. Parquet values a column's
    type cannot hold (an integer beyond int64) are null, counted in ``Exported.nulled`` and
    warned of (:class:`~cokit.telemetry.sinks.TableWarning`). Raises ValueError for an
    unknown format, ImportError (naming the install) when Parquet lacks ``pyarrow``, and
    :class:`~cokit.files.WriteError` when the filesystem refuses the file."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    wanted = None if kinds is None else frozenset(kinds)
    skipped = Skipped(Path(jsonl))
    records = read_records(jsonl, skipped)
    rows = [table_row(r) for r in records if wanted is None or r.get("kind") in wanted]
    columns = order_columns(key for row in rows for key in row)
    out = Path(out)
    nulled: dict[str, int] = {}
    if fmt == "csv":
        atomic_write_text(out, csv_text(columns, rows))
    else:
        atomic_write_bytes(out, parquet_bytes(arrow_table(columns, rows, nulled=nulled)))
        with storage_errors(out):
            for part in part_paths(out):
                with contextlib.suppress(FileNotFoundError):
                    part.unlink()
    if nulled:
        warnings.warn(
            f"{out}: values their Parquet column's type cannot hold (an integer beyond int64, text "
            f"in a number column) were written as null: {nulled_text(nulled)}; the JSONL keeps "
            "them, and so does a CSV export (--format csv)",
            TableWarning,
            stacklevel=2,
        )
    return Exported(out, len(rows), skipped.count, skipped, nulled)
