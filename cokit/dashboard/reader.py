"""Read telemetry JSONL (schema ``cokit.telemetry/1``) into per-run, per-rank records.

A RUN_DIR may be a results folder holding ``telemetry/<run>/rank<r>.jsonl``, the
``telemetry`` folder itself, or one ``<run>`` folder. Lines that are not JSON objects of this
schema (a truncated last line of a killed run, a corrupt byte, JSON nested deeper than
:data:`~cokit.telemetry.schema.MAX_DEPTH` levels) are skipped and counted per file, with their
line numbers, so a damaged file still shows what it holds. So are records whose numbers a page cannot
hold (an integer beyond float64's range; a step or slowest rank outside 0..2**53-1, a world
size outside 1..2**53-1; an end record's wall time that is not a finite number). Unknown
kinds and keys are ignored (forward compatible).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cokit.telemetry.export import run_files
from cokit.telemetry.schema import BadLine, Skipped, decode_line

SCHEMA_PREFIX = "cokit.telemetry/"


class TelemetryError(ValueError):
    """No usable telemetry: the message says where it looked and what it found."""


@dataclass
class RankLog:
    """One rank's records of one run, in file order (steps sorted, last one wins on repeats)."""

    path: Path
    rank: int
    world_size: int | None = None
    meta: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None


@dataclass
class RunLog:
    """One run (a ``telemetry/<run>`` folder): its ranks, and a label unique on the page."""

    name: str
    folder: Path
    label: str = ""
    ranks: dict[int, RankLog] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        """The lowest rank's meta record (all ranks of a run share the settings)."""
        for rank in sorted(self.ranks):
            if self.ranks[rank].meta is not None:
                return self.ranks[rank].meta or {}
        return {}

    @property
    def step_count(self) -> int:
        return len({s["step"] for r in self.ranks.values() for s in r.steps})


@dataclass
class Telemetry:
    """Everything read from the RUN_DIRs: the runs with at least one record, and what was skipped."""

    runs: list[RunLog]
    skipped: list[Skipped]
    files: list[Path]

    @property
    def skipped_count(self) -> int:
        return sum(s.count for s in self.skipped)


def _no_constant(name: str) -> None:
    """NaN / Infinity literals (a foreign writer's; the Monitor writes null) read as None."""
    return None


BEYOND_FLOAT64 = "a number beyond float64's range"


def _bounded_int(text: str) -> int:
    """JSON integers beyond float64's range make the line unreadable (the arrays are float64)."""
    if len(text) > 320:  # also spares int() its 4300-digit limit
        raise BadLine(BEYOND_FLOAT64)
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise BadLine(BEYOND_FLOAT64)
    return value


#: one decoder for every line (json.loads with options builds a new one per call)
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_int=_bounded_int)
#: steps, slowest ranks and world sizes are integers below this (exact in float64; int64 arrays hold them)
MAX_INDEX = 2**53


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_index(v: Any, low: int = 0) -> bool:
    """An integer from ``low`` to ``MAX_INDEX - 1``: a step, a rank, a world size."""
    return _is_int(v) and low <= v < MAX_INDEX


def _out_of_range(rec: dict[str, Any]) -> str | None:
    """Why a record's step, world size, slowest rank or wall time cannot be shown (None: it can)."""
    if _is_int(rec.get("world_size")) and not _is_index(rec["world_size"], 1):
        return "world_size out of range (1 to 2**53 - 1)"
    kind = rec["kind"]
    if kind in ("step", "summary") and _is_int(rec.get("step")) and not _is_index(rec["step"]):
        return f"{kind} record with a step out of range (0 to 2**53 - 1)"
    if kind == "summary" and _is_int(rec.get("slowest_rank")) and not _is_index(rec["slowest_rank"]):
        return "summary record with a slowest_rank out of range (0 to 2**53 - 1)"
    if kind == "end":
        wall = rec.get("wall_s")
        if wall is not None and (
            isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall)
        ):
            return "end record whose wall_s is not a finite number"
    return None


def read_rank_file(path: Path, rank: int, skipped: Skipped) -> RankLog:
    """Parse one rank file; bad lines go to ``skipped``."""
    log = RankLog(path=path, rank=rank)
    steps: dict[int, dict[str, Any]] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = decode_line(raw, _DECODER)
            except BadLine as exc:
                skipped.add(lineno, str(exc))
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
                skipped.add(lineno, "not a telemetry record")
                continue
            schema = rec.get("schema")
            if not (isinstance(schema, str) and schema.startswith(SCHEMA_PREFIX)):
                skipped.add(lineno, f"schema {schema!r}, not {SCHEMA_PREFIX}*")
                continue
            why = _out_of_range(rec)
            if why is not None:
                skipped.add(lineno, why)
                continue
            if _is_int(rec.get("world_size")):
                log.world_size = rec["world_size"]
            kind = rec["kind"]
            if kind == "meta":
                log.meta = rec
            elif kind == "step":
                if not _is_int(rec.get("step")):
                    skipped.add(lineno, "step record without an integer step")
                    continue
                steps[rec["step"]] = rec
            elif kind == "summary":
                if _is_int(rec.get("step")):
                    log.summaries.append(rec)
            elif kind == "end":
                log.end = rec
            # other kinds: written by a newer Monitor, ignored here
    log.steps = [steps[k] for k in sorted(steps)]
    log.summaries.sort(key=lambda r: r["step"])
    return log


def check_run_dirs(run_dirs: Sequence[str | os.PathLike]) -> None:
    """Raise :class:`TelemetryError` unless every RUN_DIR is an existing folder."""
    if not run_dirs:
        raise TelemetryError("no RUN_DIR given")
    for run_dir in run_dirs:
        if not Path(run_dir).is_dir():
            what = "does not exist" if not Path(run_dir).exists() else "is a file"
            raise TelemetryError(
                f"RUN_DIR {run_dir} {what}; give a results folder holding telemetry/<run>/rank<r>.jsonl"
            )


def load_telemetry(run_dirs: Sequence[str | os.PathLike] | str | os.PathLike) -> Telemetry:
    """Read every rank file under ``run_dirs``; raise :class:`TelemetryError` when a folder is
    missing or nothing readable is left (the message lists what was skipped)."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    check_run_dirs(run_dirs)
    runs: list[RunLog] = []
    skipped: list[Skipped] = []
    files: list[Path] = []
    empty: list[str] = []
    for run_dir in run_dirs:
        found = run_files(run_dir)
        if not found:
            empty.append(str(run_dir))
            continue
        by_run: dict[str, RunLog] = {}
        for name, path, rank in found:
            files.append(path)
            skip = Skipped(path)
            log = read_rank_file(path, rank, skip)
            if skip.count:
                skipped.append(skip)
            if log.meta is None and not log.steps and not log.summaries and log.end is None:
                continue
            run = by_run.setdefault(name, RunLog(name=name, folder=path.parent))
            run.ranks[rank] = log
        runs.extend(by_run.values())
    if not runs:
        where = []
        if empty:
            where.append(
                "no telemetry/<run>/rank<r>.jsonl files in " + ", ".join(empty) + " (was telemetry written?)"
            )
        if skipped:
            where.append(
                f"every line of {len(files)} file(s) was unreadable: "
                + "; ".join(s.describe() for s in skipped)
            )
        elif files:
            where.append(f"{len(files)} rank file(s) hold no records")
        raise TelemetryError("nothing to show: " + "; ".join(where))
    _label(runs)
    return Telemetry(runs=runs, skipped=skipped, files=files)


def _label(runs: Iterable[RunLog]) -> None:
    """Labels unique on the page: the run name, prefixed by its results folder when two
    RUN_DIRs hold runs of the same name."""
    runs = list(runs)
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    seen: dict[str, int] = {}
    for r in runs:
        label = r.name
        if counts[r.name] > 1:
            parent = (
                r.folder.parent.parent.name if r.folder.parent.name == "telemetry" else r.folder.parent.name
            )
            label = f"{parent}/{r.name}"
        n = seen.get(label, 0)
        seen[label] = n + 1
        r.label = label if n == 0 else f"{label} ({n + 1})"
