"""Where telemetry records go: one small interface, :class:`Sink`, and four implementations.

* :class:`JsonlSink` (the default): one JSON object per line, each line handed to the OS in one
  ``write`` as soon as it is written, so a crash leaves whole lines; a write the filesystem
  refuses (full disk) is undone (the file is cut back to its last whole line) and raises
  :class:`cokit.files.WriteError`.
* :class:`CsvSink` and :class:`ParquetSink`: flat tables for BI tools (nested objects as
  ``comm.exposed_s`` columns, lists as JSON strings). They buffer the rows and write the whole
  file atomically (temporary file, then rename) on :meth:`~Sink.flush` and :meth:`~Sink.close`,
  so a reader never sees half a table. Parquet needs ``pyarrow``.
* :class:`TensorBoardSink`: scalars (loss, step time, ``comm/*``...) through
  ``torch.utils.tensorboard.SummaryWriter``; needs ``tensorboard``.

A sink of your own subclasses :class:`Sink` (or just has the three methods) and is passed in
``Monitor(sinks=[...])``. Records reach sinks already cleaned (:func:`cokit.telemetry.schema.clean`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cokit.files import atomic_write_bytes, atomic_write_text, storage_errors
from cokit.telemetry.schema import COMMON_FIELDS, KIND_FIELDS, flatten

__all__ = ["SINK_NAMES", "CsvSink", "JsonlSink", "ParquetSink", "Sink", "TensorBoardSink", "make_sink"]

#: the sinks :func:`make_sink` builds by name, with their file name under a run's folder
SINK_NAMES = ("jsonl", "csv", "parquet", "tensorboard")
#: kinds the table sinks keep by default (``kinds=None`` keeps every kind)
TABLE_KINDS = ("step", "summary")


class Sink(ABC):
    """Receives telemetry records (plain JSON-ready dicts), one call per record."""

    @abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """Take one record."""

    def flush(self) -> None:  # noqa: B027 - optional: a sink may have nothing to flush
        """Make what was written so far durable (or visible to readers)."""

    def close(self) -> None:
        """Flush and release resources; the sink takes no more records."""
        self.flush()


class JsonlSink(Sink):
    """One JSON object per line in ``path`` (replaced when it exists), each line one complete
    ``write`` to an append-only descriptor: the file only ever grows by whole lines. A failed
    write cuts the file back to its length before the line and raises
    :class:`~cokit.files.WriteError` (storage failures) or the OSError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        with storage_errors(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, flags, 0o666)

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"JsonlSink({self.path}) is closed")
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        fd = self._fd
        with storage_errors(self.path):
            before = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:  # a regular file writes short only when full: the next write says why
                    view = view[os.write(fd, view) :]
            except BaseException:  # also an interrupt between two parts of the line
                self._cut(fd, before)
                raise

    @staticmethod
    def _cut(fd: int, length: int) -> None:
        """Remove a partly written line (best effort: a file that cannot be cut, e.g.
        /dev/full, keeps what it has, and readers skip a partial line)."""
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size > length:
                os.ftruncate(fd, length)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with storage_errors(self.path):
                os.close(fd)

    def __del__(self) -> None:  # a sink dropped without close() does not leak its descriptor
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class _TableSink(Sink):
    """Buffers flattened rows of the chosen kinds; writes the whole table atomically."""

    def __init__(self, path: str | os.PathLike, kinds: Iterable[str] | None = TABLE_KINDS) -> None:
        if isinstance(kinds, str):
            raise TypeError(
                f"kinds must be a list of record kinds such as ['step'], not the string {kinds!r}"
            )
        self.path = Path(path)
        self.kinds = None if kinds is None else frozenset(kinds)
        self.rows: list[dict[str, Any]] = []
        self._dirty = False
        self._closed = False

    def write(self, record: dict[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"{type(self).__name__}({self.path}) is closed")
        if self.kinds is None or record.get("kind") in self.kinds:
            self.rows.append(flatten(record))
            self._dirty = True

    def columns(self) -> list[str]:
        """Every column of the buffered rows: the schema's common and per-kind keys first (in
        schema order), then the others in order of appearance."""
        seen: dict[str, None] = {}
        for row in self.rows:
            seen.update(dict.fromkeys(row))
        order = list(COMMON_FIELDS)
        for fields in KIND_FIELDS.values():
            order += [f for f in fields if f not in order]
        rank = {name: i for i, name in enumerate(order)}
        first = {name: i for i, name in enumerate(seen)}

        def key(col: str) -> tuple[int, int]:
            head = col.split(".", 1)[0]
            return (rank.get(head, len(order)), first[col])

        return sorted(seen, key=key)

    def flush(self) -> None:
        if self._dirty:
            self._write_table()  # atomic: a failed write (WriteError) keeps the previous table
            self._dirty = False

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True

    @abstractmethod
    def _write_table(self) -> None: ...


class CsvSink(_TableSink):
    """A CSV table of the records of ``kinds`` (default step and summary), one row each,
    flattened (``comm.exposed_s``; lists as JSON strings; null as an empty cell)."""

    def _write_table(self) -> None:
        cols = self.columns()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, restval="", lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        atomic_write_text(self.path, buf.getvalue())


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError(
            f"ParquetSink needs pyarrow ({exc}); install it with `pip install pyarrow` "
            "(or `pip install cokit[telemetry]`), or use CsvSink"
        ) from None
    return pyarrow


class ParquetSink(_TableSink):
    """A Parquet table of the records of ``kinds`` (default step and summary), flattened like
    :class:`CsvSink`. Needs ``pyarrow`` (checked at construction)."""

    def __init__(self, path: str | os.PathLike, kinds: Iterable[str] | None = TABLE_KINDS) -> None:
        self._pa = _pyarrow()
        super().__init__(path, kinds)

    def _write_table(self) -> None:
        pa = self._pa
        cols = self.columns()
        arrays = {}
        for col in cols:
            values = [row.get(col) for row in self.rows]
            try:
                arrays[col] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types in one column: as text
                arrays[col] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        table = pa.table(arrays) if arrays else pa.table({})
        sink = pa.BufferOutputStream()
        pa.parquet.write_table(table, sink)
        atomic_write_bytes(self.path, sink.getvalue().to_pybytes())


def _summary_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"TensorBoardSink needs tensorboard ({exc}); install it with `pip install tensorboard` "
            "(or `pip install cokit[telemetry]`)"
        ) from None
    return SummaryWriter(log_dir=str(log_dir))


class TensorBoardSink(Sink):
    """Scalars for TensorBoard in ``log_dir``: ``loss``, ``held_out_loss``, ``lr``,
    ``step_s``, ``compute_s``, ``comm/<field>`` (times, bytes, ratio), ``memory/max_bytes``,
    ``metrics/<name>`` and, from summaries, ``summary/<field>``; x is the step number."""

    STEP_SCALARS = ("loss", "held_out_loss", "lr", "step_s", "compute_s", "wall_s")
    SUMMARY_SCALARS = ("step_s_max", "step_s_min", "exposed_s_max", "slowest_rank")

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = _summary_writer(self.log_dir)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._writer.add_scalar(tag, value, step)

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            raise ValueError(f"TensorBoardSink({self.log_dir}) is closed")
        kind, step = record.get("kind"), record.get("step")
        if not isinstance(step, int):
            return
        if kind == "step":
            for key in self.STEP_SCALARS:
                self._scalar(key, record.get(key), step)
            comm = record.get("comm")
            if isinstance(comm, Mapping):
                for key, value in comm.items():
                    if key not in ("world_size", "group_size"):
                        self._scalar(f"comm/{key}", value, step)
            process = record.get("process")
            if isinstance(process, Mapping):
                self._scalar("memory/max_bytes", process.get("max_memory_bytes"), step)
            for key, value in (record.get("metrics") or {}).items():
                self._scalar(f"metrics/{key}", value, step)
        elif kind == "summary":
            for key in self.SUMMARY_SCALARS:
                self._scalar(f"summary/{key}", record.get(key), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def make_sink(name: str, folder: str | os.PathLike, rank: int) -> Sink:
    """The sink called ``name`` (one of :data:`SINK_NAMES`) writing rank ``rank``'s file in a
    run's ``folder``: ``rank<r>.jsonl``, ``rank<r>.csv``, ``rank<r>.parquet`` or
    ``tensorboard/rank<r>/``."""
    folder = Path(folder)
    if name == "jsonl":
        return JsonlSink(folder / f"rank{rank}.jsonl")
    if name == "csv":
        return CsvSink(folder / f"rank{rank}.csv")
    if name == "parquet":
        return ParquetSink(folder / f"rank{rank}.parquet")
    if name == "tensorboard":
        return TensorBoardSink(folder / "tensorboard" / f"rank{rank}")
    raise ValueError(f"unknown sink {name!r}; known: {', '.join(SINK_NAMES)} (or pass a Sink object)")
