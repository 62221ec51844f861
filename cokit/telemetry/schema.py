"""The telemetry record schema ``cokit.telemetry/1``: record kinds, JSON-safe values, checks.

One JSON object per line. Every record has ``schema``, ``kind``, ``run``, ``rank``,
``world_size`` and ``time`` (unix seconds), and records written by this version also
``time_iso`` (the same instant as ISO-8601 UTC text, :func:`iso_time`; optional, so older
files stay valid); the kinds add:

* ``meta`` (the first line): ``started``, ``host``, ``pid``, ``torch``, ``triton``,
  ``device``, ``method``, ``config``;
* ``step`` (one per :meth:`cokit.telemetry.Monitor.step`): ``step``, ``wall_s``, ``step_s``,
  ``loss``, ``held_out_loss``, ``lr``, ``comm`` (or null), ``compute_s``, ``kernels``,
  ``tuner``, ``process``, ``metrics``;
* ``summary`` (rank 0 only, when gathering): ``step``, ``step_s_max``, ``step_s_min``,
  ``slowest_rank``, ``exposed_s_max``, ``ranks``;
* ``end`` (on close): ``steps``, ``wall_s``.

Readers ignore unknown kinds and keys (forward compatible); a partial last line (a crash
mid-write) is skipped, and so is any other line that is not JSON, or is JSON nested deeper than
:data:`MAX_DEPTH` arrays and objects (every reader decodes lines with :func:`decode_line`,
which counts them in a :class:`Skipped` by file and line). Floats that are NaN or infinite are
written as null.
"""

from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMMON_FIELDS",
    "COMM_FIELDS",
    "KIND_FIELDS",
    "MAX_DEPTH",
    "SCHEMA",
    "BadLine",
    "Skipped",
    "check_record",
    "clean",
    "column_types",
    "decode_line",
    "flatten",
    "iso_time",
    "order_columns",
    "read_jsonl",
    "read_records",
    "table_row",
]

SCHEMA = "cokit.telemetry/1"
#: keys of every record
COMMON_FIELDS = ("schema", "kind", "run", "rank", "world_size", "time")
#: keys each kind adds to COMMON_FIELDS
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "meta": ("started", "host", "pid", "torch", "triton", "device", "method", "config"),
    "step": (
        "step",
        "wall_s",
        "step_s",
        "loss",
        "held_out_loss",
        "lr",
        "comm",
        "compute_s",
        "kernels",
        "tuner",
        "process",
        "metrics",
    ),
    "summary": ("step", "step_s_max", "step_s_min", "slowest_rank", "exposed_s_max", "ranks"),
    "end": ("steps", "wall_s"),
}
#: keys of a step's ``comm`` object
COMM_FIELDS = (
    "encode_s",
    "decode_s",
    "exposed_s",
    "comm_s",
    "sent_bytes",
    "received_bytes",
    "dense_bytes",
    "ratio",
    "collectives",
    "world_size",
    "group_size",
)
KERNEL_FIELDS = ("name", "config", "blocks_per_sm", "limiter", "smem_per_block", "reserved_sms")

_NUMBER = (int, float)

#: the type of each table column whose name the schema fixes (``int``, ``float``, ``bool`` or
#: ``str``; lists are JSON text); ``metrics.*`` columns are floats. Column names are
#: :func:`flatten`'s: nested objects as ``comm.exposed_s``.
_COLUMN_TYPES: dict[str, dict[str, str]] = {
    "": {
        "schema": "str",
        "kind": "str",
        "run": "str",
        "rank": "int",
        "world_size": "int",
        "time": "float",
        "time_iso": "str",
    },
    "meta": {
        "started": "str",
        "host": "str",
        "pid": "int",
        "torch": "str",
        "triton": "str",
        "device": "str",
        "method": "str",
        "gather": "bool",
    },
    "step": {
        "step": "int",
        "wall_s": "float",
        "step_s": "float",
        "loss": "float",
        "held_out_loss": "float",
        "lr": "float",
        **{
            f"comm.{f}": "int" if f.endswith("_bytes") or f.endswith("_size") else "float"
            for f in COMM_FIELDS
            if f != "collectives"
        },
        "comm.collectives": "str",
        "compute_s": "float",
        "kernels": "str",
        "tuner": "str",
        "process.max_memory_bytes": "int",
        "process.device": "str",
    },
    "summary": {
        "step": "int",
        "step_s_max": "float",
        "step_s_min": "float",
        "slowest_rank": "int",
        "exposed_s_max": "float",
        "ranks": "int",
        "step_s_by_rank": "str",
    },
    "end": {"steps": "int", "wall_s": "float", "error": "str"},
}


def clean(value: Any) -> Any:
    """``value`` as plain JSON data: NaN/inf floats become None, numpy/torch scalars and
    one-element tensors become Python numbers, tuples and sets lists, mapping keys strings,
    anything else its ``str``."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [clean(v) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return clean(float(value))
    item = getattr(value, "item", None)  # numpy scalars, one-element tensors
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            return clean(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """One flat row for tables (CSV, Parquet): nested objects become ``a.b`` columns (e.g.
    ``comm.exposed_s``), lists JSON strings; scalars stay as they are."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                row.update(flatten(value, name + "."))
            else:
                row[name] = None
        elif isinstance(value, (list, tuple)):
            row[name] = json.dumps(value, separators=(",", ":"), allow_nan=False)
        else:
            row[name] = value
    return row


def iso_time(t: float) -> str:
    """Unix seconds ``t`` as ISO-8601 UTC text with microseconds, e.g.
    ``2026-12-06T10:15:03.123456+00:00`` (what BI tools and spreadsheets parse as a time)."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="microseconds")


def table_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` as one flat table row (:func:`flatten`), with ``time_iso`` right after
    ``time`` (computed from ``time`` for records written before it existed)."""
    row = flatten(record)
    if "time_iso" not in row and isinstance(row.get("time"), _NUMBER):
        out: dict[str, Any] = {}
        for key, value in row.items():
            out[key] = value
            if key == "time":
                out["time_iso"] = iso_time(value)
        row = out
    return row


def column_types(kinds: Iterable[str] | None = None) -> dict[str, str]:
    """The columns the schema fixes for records of ``kinds`` (None: every kind), name to type
    (``int``, ``float``, ``bool``, ``str``), common columns first."""
    out = dict(_COLUMN_TYPES[""])
    for kind in KIND_FIELDS if kinds is None else kinds:
        for name, typ in _COLUMN_TYPES.get(kind, {}).items():
            out.setdefault(name, typ)
    return out


def order_columns(names: Iterable[str]) -> list[str]:
    """``names`` (flat columns, no repeats) in a stable order: the schema's common and
    per-kind keys first (in schema order; ``a.b`` columns at ``a``'s place), then the others
    in the order given."""
    seen = list(dict.fromkeys(names))
    order = [*COMMON_FIELDS, "time_iso"]
    for fields in KIND_FIELDS.values():
        order += [f for f in fields if f not in order]
    rank = {name: i for i, name in enumerate(order)}
    first = {name: i for i, name in enumerate(seen)}

    def key(col: str) -> tuple[int, int]:
        return (rank.get(col.split(".", 1)[0], len(order)), first[col])

    return sorted(seen, key=key)


def _problem(record: Mapping[str, Any]) -> str | None:
    missing = [k for k in COMMON_FIELDS if k not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    if record["schema"] != SCHEMA:
        return f"schema is {record['schema']!r}, expected {SCHEMA!r}"
    kind = record["kind"]
    if kind not in KIND_FIELDS:
        return None  # unknown kinds are allowed (and ignored by readers)
    missing = [k for k in KIND_FIELDS[kind] if k not in record]
    if missing:
        return f"{kind} record misses {', '.join(missing)}"
    if not isinstance(record["rank"], int) or not isinstance(record["world_size"], int):
        return "rank and world_size must be integers"
    if not 0 <= record["rank"] < record["world_size"]:
        return f"rank {record['rank']} is outside world_size {record['world_size']}"
    if not isinstance(record["time"], _NUMBER):
        return "time must be a number"
    if kind == "step":
        if not isinstance(record["step"], int) or isinstance(record["step"], bool):
            return "step must be an integer"
        for key in ("wall_s", "step_s", "loss", "held_out_loss", "lr", "compute_s"):
            v = record[key]
            if v is not None and not isinstance(v, _NUMBER):
                return f"{key} must be a number or null"
        comm = record["comm"]
        if comm is not None:
            if not isinstance(comm, Mapping):
                return "comm must be an object or null"
            missing = [k for k in COMM_FIELDS if k not in comm]
            if missing:
                return f"comm misses {', '.join(missing)}"
        for key in ("kernels", "tuner"):
            if not isinstance(record[key], list):
                return f"{key} must be a list"
        for k in record["kernels"]:
            missing = [f for f in KERNEL_FIELDS if f not in k]
            if missing:
                return f"kernel entry misses {', '.join(missing)}"
        process = record["process"]
        if not isinstance(process, Mapping) or not {"max_memory_bytes", "device"} <= set(process):
            return "process must hold max_memory_bytes and device"
        if not isinstance(record["metrics"], Mapping):
            return "metrics must be an object"
    return None


def check_record(record: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming what makes ``record`` break the schema (its known kinds'
    required keys and their types); unknown kinds and extra keys pass."""
    if not isinstance(record, Mapping):
        raise ValueError(f"a telemetry record is a JSON object, got {type(record).__name__}")
    problem = _problem(record)
    if problem is not None:
        raise ValueError(f"not a {SCHEMA} record: {problem}")


#: the deepest nesting of arrays and objects a telemetry line may have (the Monitor's records
#: have 3: a step's ``kernels`` entries; a user's ``config`` adds its own). A deeper line is
#: malformed, like a truncated one: Python's JSON decoder recurses per level and would end in
#: RecursionError near 1,000 levels, and the readers and table builders recurse too.
MAX_DEPTH = 100
NOT_JSON = "not JSON (truncated or corrupt)"
TOO_DEEP = f"nested deeper than {MAX_DEPTH} arrays/objects"
#: a JSON string (an unterminated one runs to the end of the line) or one bracket
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


class BadLine(ValueError):
    """A line no telemetry reader takes; its message is the reason :class:`Skipped` counts."""


@dataclass
class Skipped:
    """Lines of one file that could not be read: how many, the first few line numbers, why."""

    path: Path
    count: int = 0
    lines: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, lineno: int, reason: str) -> None:
        self.count += 1
        if len(self.lines) < 5:
            self.lines.append(lineno)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def describe(self) -> str:
        more = ", ..." if self.count > len(self.lines) else ""
        why = "; ".join(f"{n} {r}" for r, n in self.reasons.items())
        return (
            f"{self.path}: {self.count} line(s) skipped (line {', '.join(map(str, self.lines))}{more}: {why})"
        )


def _too_deep(text: str) -> bool:
    """Whether ``text`` nests arrays and objects deeper than :data:`MAX_DEPTH` (brackets inside
    strings do not count). Linear in the line's length; lines with few brackets are not scanned."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif c in "]}":
            depth -= 1
    return False


_PLAIN = json.JSONDecoder()


def decode_line(raw: bytes | str, decoder: json.JSONDecoder = _PLAIN) -> Any:
    """One JSONL line as JSON data (with ``decoder``). Raises :class:`BadLine` when the bytes
    are not UTF-8, the line nests deeper than :data:`MAX_DEPTH` (checked before decoding), or
    it is not JSON; a :class:`BadLine` the decoder's hooks raise passes through."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadLine(NOT_JSON) from None
    if _too_deep(raw):
        raise BadLine(TOO_DEEP)
    try:
        return decoder.decode(raw)
    except BadLine:
        raise
    except (ValueError, RecursionError):  # RecursionError: a deep line under a deep call stack
        raise BadLine(NOT_JSON) from None


def read_records(path: str | os.PathLike, skipped: Skipped | None = None) -> list[dict[str, Any]]:
    """The ``cokit.telemetry/1`` records of one telemetry file, in file order. Other lines
    (not JSON, nested too deep, not a record of this schema) are counted in ``skipped`` with
    their line numbers and reasons."""
    skipped = Skipped(Path(path)) if skipped is None else skipped
    records: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = decode_line(line)
            except BadLine as exc:
                skipped.add(lineno, str(exc))
                continue
            if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
                records.append(rec)
            else:
                skipped.add(lineno, f"not a {SCHEMA} record")
    return records


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """The records of one telemetry file and the number of lines skipped (not JSON objects of
    this schema: corrupt lines, a truncated last line, lines nested too deep):
    :func:`read_records` without the line numbers."""
    skipped = Skipped(Path(path))
    records = read_records(path, skipped)
    return records, skipped.count
