"""Where telemetry records go: one small interface, :class:`Sink`, and five implementations.

* :class:`JsonlSink` (the default): one JSON object per line, each line handed to the OS in one
  ``write`` as soon as it is written, so a crash leaves whole lines; a write the filesystem
  refuses (full disk) is undone (the file is cut back to its last whole line) and raises
  :class:`cokit.files.WriteError`.
* :class:`CsvSink` and :class:`ParquetSink`: flat tables for BI tools (nested objects as
  ``comm.exposed_s`` columns, lists as JSON strings, ``time_iso`` beside ``time``), written
  as the run goes, so a killed run leaves its rows:

  - CSV appends each row (one ``write``, like a JSONL line) under a header fixed by the first
    row: its columns plus every column the schema fixes for the kinds kept
    (:func:`~cokit.telemetry.schema.column_types`). A key no column holds (e.g. a metric first
    given at step 5) stays in the JSONL only; ``cokit telemetry export`` rebuilds the table
    with every column.
  - Parquet writes complete part files ``rank<r>.part-00000.parquet``, ... (each written
    atomically, every ``rows_per_part`` rows and at :meth:`~Sink.flush`), all with one schema
    fixed by the first part; :meth:`~Sink.close` merges them into ``rank<r>.parquet``. A
    killed run leaves the parts: every one readable (a ParquetWriter killed mid-file leaves
    no footer, hence no readable data). Needs ``pyarrow``.
* :class:`TensorBoardSink`: scalars (loss, step time, ``comm/*``...) through
  ``torch.utils.tensorboard.SummaryWriter``; needs ``tensorboard``.
* :class:`PrometheusSink`: the last step's gauges on an HTTP endpoint for Prometheus (or any
  OpenMetrics scraper); needs ``prometheus_client``.

A sink of your own subclasses :class:`Sink` (or just has the three methods) and is passed in
``Monitor(sinks=[...])``. Records reach sinks already cleaned (:func:`cokit.telemetry.schema.clean`).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import json
import math
import os
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cokit.files import atomic_write_bytes, storage_errors
from cokit.telemetry.schema import column_types, order_columns, table_row

__all__ = [
    "SINK_NAMES",
    "CsvSink",
    "JsonlSink",
    "ParquetSink",
    "PrometheusSink",
    "Sink",
    "TableWarning",
    "TensorBoardSink",
    "make_sink",
    "require",
]

#: the sinks :func:`make_sink` builds by name, with their file name under a run's folder
SINK_NAMES = ("jsonl", "csv", "parquet", "tensorboard", "prometheus")
#: kinds the table sinks keep by default (``kinds=None`` keeps every kind)
TABLE_KINDS = ("step", "summary")


class TableWarning(UserWarning):
    """A Parquet table wrote some values as null: its column's type cannot hold them (an
    integer beyond int64 in an integer column). The message names the columns and counts."""


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


class _AppendFile:
    """A file (replaced when it exists) that only ever grows by whole chunks: each
    :meth:`append` is one ``write`` to an append-only descriptor, so a killed process leaves
    whole lines. A failed write cuts the file back to its length before the chunk and raises
    :class:`~cokit.files.WriteError` (storage failures) or the OSError."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        with storage_errors(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd: int | None = os.open(self.path, flags, 0o666)

    def append(self, data: bytes, owner: str) -> None:
        """Write ``data`` whole (``owner`` names the sink in the error of a closed file)."""
        if self.fd is None:
            raise ValueError(f"{owner}({self.path}) is closed")
        fd = self.fd
        with storage_errors(self.path):
            before = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # a regular file writes short only when full: the next write says why
                    view = view[os.write(fd, view) :]
            except BaseException:  # also an interrupt between two parts of the line
                self._cut(fd, before)
                raise

    @staticmethod
    def _cut(fd: int, length: int) -> None:
        """Remove a partly written chunk (best effort: a file that cannot be cut, e.g.
        /dev/full, keeps what it has, and readers skip a partial line)."""
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size > length:
                os.ftruncate(fd, length)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with storage_errors(self.path):
                os.close(fd)

    def __del__(self) -> None:  # dropped without close(): the descriptor does not leak
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class JsonlSink(Sink):
    """One JSON object per line in ``path`` (replaced when it exists), each line one complete
    ``write`` to an append-only descriptor: the file only ever grows by whole lines. A failed
    write cuts the file back to its length before the line and raises
    :class:`~cokit.files.WriteError` (storage failures) or the OSError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = _AppendFile(self.path)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        self._file.append(line.encode("utf-8"), "JsonlSink")

    def close(self) -> None:
        self._file.close()


def csv_text(columns: Sequence[str], rows: Iterable[Mapping[str, Any]], header: bool = True) -> str:
    """``rows`` as CSV lines of ``columns`` (null and missing values as empty cells; keys
    outside ``columns`` left out), with the header line first when ``header``."""
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=list(columns), restval="", extrasaction="ignore", lineterminator="\n"
    )
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


class _TableSink(Sink):
    """Flat rows of the chosen kinds, under a column set fixed by the first row: its columns
    plus those the schema fixes for the kinds kept. Keys outside it are counted in
    :attr:`dropped` (they stay in the JSONL)."""

    def __init__(self, path: str | os.PathLike, kinds: Iterable[str] | None = TABLE_KINDS) -> None:
        if isinstance(kinds, str):
            raise TypeError(
                f"kinds must be a list of record kinds such as ['step'], not the string {kinds!r}"
            )
        self.path = Path(path)
        self.kinds = None if kinds is None else frozenset(kinds)
        self.columns: list[str] | None = None
        self._known: frozenset[str] = frozenset()
        #: keys of later rows that no column holds (written to the JSONL only)
        self.dropped: set[str] = set()
        self.rows_written = 0
        self._closed = False

    def write(self, record: dict[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"{type(self).__name__}({self.path}) is closed")
        if self.kinds is not None and record.get("kind") not in self.kinds:
            return
        row = table_row(record)
        first = self.columns is None
        if self.columns is None:
            columns = order_columns([*row, *column_types(self.kinds)])
            nested = {c.split(".", 1)[0] for c in columns if "." in c}
            # a null object (``comm`` of a plain optimizer) is left to its schema columns
            self.columns = [c for c in columns if not (row.get(c) is None and c in nested)]
            self._known = frozenset(self.columns)
        else:
            self.dropped.update(k for k, v in row.items() if v is not None and k not in self._known)
        self._add(row, first)
        self.rows_written += 1

    def close(self) -> None:
        if not self._closed:
            try:
                self.flush()
                self._finish()
            finally:
                self._closed = True

    @abstractmethod
    def _add(self, row: dict[str, Any], first: bool) -> None:
        """Take one row (``first``: the one that fixed :attr:`columns`)."""

    def _finish(self) -> None:
        """Release the output (after the last flush)."""


class CsvSink(_TableSink):
    """A CSV table of the records of ``kinds`` (default step and summary), one row each,
    flattened (``comm.exposed_s``; lists as JSON strings; null as an empty cell), each row
    appended as written: a crash leaves every row but at most a partial last one (which CSV
    readers see as a short row). The header is written with the first row."""

    def __init__(self, path: str | os.PathLike, kinds: Iterable[str] | None = TABLE_KINDS) -> None:
        super().__init__(path, kinds)
        self._file = _AppendFile(self.path)

    def _add(self, row: dict[str, Any], first: bool) -> None:
        assert self.columns is not None
        self._file.append(csv_text(self.columns, [row], header=first).encode("utf-8"), "CsvSink")

    def _finish(self) -> None:
        self._file.close()


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


def arrow_table(
    columns: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    schema: Any = None,
    *,
    nulled: dict[str, int] | None = None,
) -> Any:
    """A ``pyarrow.Table`` of ``rows`` with ``columns``. With ``schema`` (a ``pyarrow.Schema``
    of those columns) each column gets its type; without it, types are the schema's for the
    columns it fixes (``metrics.*``: float), inferred for the others (text when a column mixes
    types, holds integers beyond int64, or holds only nulls). A value its column's type cannot
    hold (an integer beyond int64 in an integer column, text in a number column) becomes null,
    and ``nulled`` (when given) counts it under its column; a float column takes a large
    integer as the nearest float."""
    pa = _pyarrow()
    fixed = column_types()
    arrow_type = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    arrays = []
    for i, col in enumerate(columns):
        values = [row.get(col) for row in rows]
        if schema is not None:
            typ = schema.field(i).type
        elif col in fixed or col.startswith("metrics."):
            typ = arrow_type[fixed.get(col, "float")]
        else:
            typ = None
        try:
            array = pa.array(values, type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            if typ is None or pa.types.is_string(typ):  # mixed types: as text
                array = pa.array([None if v is None else str(v) for v in values], type=pa.string())
            else:
                fitted = [_fit(pa, v, typ) for v in values]
                lost = sum(v is not None and f is None for v, f in zip(values, fitted, strict=True))
                if lost and nulled is not None:
                    nulled[col] = nulled.get(col, 0) + lost
                array = pa.array(fitted, type=typ)
        if typ is None and pa.types.is_null(array.type):
            array = array.cast(pa.string())
        arrays.append(array)
    return pa.table(arrays, names=list(columns))


def _fit(pa: Any, value: Any, typ: Any) -> Any:
    """``value`` as a column of ``typ`` holds it (an integer as a float in a float column),
    else None."""
    if pa.types.is_floating(typ) and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond float64
            return None
    try:
        pa.scalar(value, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None
    return value


def nulled_text(nulled: Mapping[str, int]) -> str:
    """``{"step": 2}`` as ``"step (2 values)"``, column by column, for a warning."""
    return ", ".join(f"{col} ({n} value{'s' if n != 1 else ''})" for col, n in nulled.items())


def parquet_bytes(table: Any) -> bytes:
    """``table`` as the bytes of one Parquet file."""
    pa = _pyarrow()
    out = pa.BufferOutputStream()
    pa.parquet.write_table(table, out)
    return bytes(out.getvalue().to_pybytes())


def part_paths(path: str | os.PathLike) -> list[Path]:
    """The part files of the Parquet table ``path`` (``rank0.parquet`` ->
    ``rank0.part-00000.parquet``, ...) on disk, in order."""
    path = Path(path)
    pattern = re.compile(re.escape(path.stem) + r"\.part-(\d+)" + re.escape(path.suffix))
    if not path.parent.is_dir():
        return []
    found = [
        (int(m.group(1)), Path(e.path)) for e in os.scandir(path.parent) if (m := pattern.fullmatch(e.name))
    ]
    return [p for _, p in sorted(found)]


class ParquetSink(_TableSink):
    """A Parquet table of the records of ``kinds`` (default step and summary), flattened like
    :class:`CsvSink`, written as complete part files ``<stem>.part-<n>.parquet`` beside
    ``path`` every ``rows_per_part`` rows and at :meth:`flush`, merged into ``path`` at
    :meth:`close` (see the module docstring). Every part has the first part's schema: a later
    value its column cannot hold (say a float in a column of integers, or an integer beyond
    int64) is null in the table (the JSONL keeps it; ``cokit telemetry export`` types columns
    from every row); :attr:`nulled` counts them per column, and :meth:`close` warns
    (:class:`TableWarning`) when there are any. An earlier
    run's ``path`` and parts are removed at construction. Needs ``pyarrow`` (checked at
    construction)."""

    def __init__(
        self, path: str | os.PathLike, kinds: Iterable[str] | None = TABLE_KINDS, *, rows_per_part: int = 100
    ) -> None:
        if isinstance(rows_per_part, bool) or not isinstance(rows_per_part, int) or rows_per_part < 1:
            raise ValueError(f"rows_per_part must be an integer >= 1, got {rows_per_part!r}")
        self._pa = _pyarrow()
        super().__init__(path, kinds)
        self.rows_per_part = rows_per_part
        self._rows: list[dict[str, Any]] = []
        self._schema: Any = None
        self.parts: list[Path] = []
        #: values written as null because their column's type cannot hold them, per column
        self.nulled: dict[str, int] = {}
        with storage_errors(self.path):
            for stale in [self.path, *part_paths(self.path)]:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()

    def _add(self, row: dict[str, Any], first: bool) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.rows_per_part:
            self.flush()

    def flush(self) -> None:
        """Write the rows since the last part as one more part file (atomically)."""
        if not self._rows or self.columns is None:
            return
        table = arrow_table(self.columns, self._rows, self._schema, nulled=self.nulled)
        part = self.path.with_name(f"{self.path.stem}.part-{len(self.parts):05d}{self.path.suffix}")
        atomic_write_bytes(part, parquet_bytes(table))  # a failed write raises WriteError, keeps the rows
        self._schema = table.schema
        self.parts.append(part)
        self._rows = []

    def _finish(self) -> None:
        """Merge the parts into ``path`` (atomically), then remove them; warn of nulled values."""
        if self.nulled:
            warnings.warn(
                f"{self.path}: values their column's type cannot hold (an integer beyond int64, "
                f"a later row's other type) were written as null: {nulled_text(self.nulled)}; "
                "the JSONL keeps them",
                TableWarning,
                stacklevel=2,
            )
        if not self.parts:
            return
        pq = self._pa.parquet
        table = self._pa.concat_tables([pq.read_table(p) for p in self.parts])
        atomic_write_bytes(self.path, parquet_bytes(table))
        for part in self.parts:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()


def _tensorboard() -> Any:
    try:
        tensorboard = importlib.import_module("torch.utils.tensorboard")
    except ImportError as exc:
        raise ImportError(
            f"TensorBoardSink needs tensorboard ({exc}); install it with `pip install tensorboard` "
            "(or `pip install cokit[telemetry]`)"
        ) from None
    return tensorboard


def _summary_writer(log_dir: Path) -> Any:
    return _tensorboard().SummaryWriter(log_dir=str(log_dir))


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


#: environment variable with the port :class:`PrometheusSink` serves on (rank r: port + r)
PROMETHEUS_PORT_ENV = "COKIT_PROMETHEUS_PORT"
#: the port when neither the sink nor the environment names one (OpenTelemetry's exporter port)
PROMETHEUS_DEFAULT_PORT = 9464


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            f"PrometheusSink needs prometheus_client ({exc}); install it with `pip install prometheus_client` "
            "(or `pip install cokit[telemetry]`)"
        ) from None
    return prometheus_client


def prometheus_port(rank: int = 0) -> int:
    """The port rank ``rank`` serves on: ``$COKIT_PROMETHEUS_PORT`` (else 9464) plus the rank,
    so the ranks of one host do not collide; 0 (any free port) stays 0."""
    text = os.environ.get(PROMETHEUS_PORT_ENV, "").strip()
    try:
        base = int(text) if text else PROMETHEUS_DEFAULT_PORT
        if not 0 <= base <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"{PROMETHEUS_PORT_ENV}={text!r} is not a port number (0 to 65535)") from None
    return base + rank if base else 0


def _step_value(record: Mapping[str, Any], path: str) -> Any:
    value: Any = record
    for key in path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


class PrometheusSink(Sink):
    """The last step's values as Prometheus gauges (labels ``run`` and ``rank``) on
    ``http://<addr>:<port>/metrics``, served from a thread until :meth:`close`.

    Gauges (:attr:`GAUGES`): ``cokit_step``, ``cokit_step_seconds``, ``cokit_loss``,
    ``cokit_held_out_loss``, ``cokit_lr``, the step's communication (``cokit_comm_*_bytes``,
    ``cokit_comm_*_seconds``, ``cokit_compression_ratio``) and ``cokit_max_memory_bytes``. A
    null value (no held-out loss this step) leaves its gauge at its last value; a gauge never
    set is not exported. ``port``: default :func:`prometheus_port` (``$COKIT_PROMETHEUS_PORT``
    or 9464; 0: any free one, see :attr:`port`); ``addr``: default loopback only, pass
    ``"0.0.0.0"`` to let another host scrape. Each sink has its own registry. Needs
    ``prometheus_client``."""

    #: (gauge name, help, the record's key; ``a.b``: key b of object a)
    GAUGES = (
        ("cokit_step", "last step recorded", "step"),
        ("cokit_step_seconds", "time of the last step", "step_s"),
        ("cokit_compute_seconds", "step time less encode, decode and exposed communication", "compute_s"),
        ("cokit_loss", "training loss of the last step", "loss"),
        ("cokit_held_out_loss", "last held-out loss", "held_out_loss"),
        ("cokit_lr", "learning rate of the last step", "lr"),
        ("cokit_comm_sent_bytes", "bytes sent in the last step", "comm.sent_bytes"),
        ("cokit_comm_received_bytes", "bytes received in the last step", "comm.received_bytes"),
        ("cokit_comm_dense_bytes", "bytes a dense all-reduce would have sent", "comm.dense_bytes"),
        ("cokit_comm_encode_seconds", "compression time of the last step", "comm.encode_s"),
        ("cokit_comm_decode_seconds", "decompression time of the last step", "comm.decode_s"),
        ("cokit_comm_exposed_seconds", "communication time not hidden behind compute", "comm.exposed_s"),
        ("cokit_comm_seconds", "total communication time of the last step", "comm.comm_s"),
        ("cokit_compression_ratio", "dense bytes over bytes sent, so far", "comm.ratio"),
        ("cokit_max_memory_bytes", "the process's memory high-water mark", "process.max_memory_bytes"),
    )

    def __init__(self, port: int | None = None, addr: str = "127.0.0.1") -> None:
        client = _prometheus()
        if port is None:
            port = prometheus_port()
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer from 0 to 65535, got {port!r}")
        self.registry = client.CollectorRegistry()
        self._gauges = [
            (client.Gauge(name, doc, ("run", "rank"), registry=self.registry), key)
            for name, doc, key in self.GAUGES
        ]
        try:
            self._server, self._thread = client.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve Prometheus metrics on {addr}:{port}: {exc.strerror or exc}; "
                f"pick another port ({PROMETHEUS_PORT_ENV} or PrometheusSink(port=...))",
            ) from None
        self.addr = addr
        #: the port served (the one chosen when ``port`` was 0)
        self.port: int = self._server.server_address[1]

    @property
    def url(self) -> str:
        """Where the metrics are: ``http://<addr>:<port>/metrics``."""
        return f"http://{self.addr}:{self.port}/metrics"

    def write(self, record: dict[str, Any]) -> None:
        if self._server is None:
            raise ValueError(f"PrometheusSink({self.url}) is closed")
        if record.get("kind") != "step":
            return
        labels = {"run": str(record.get("run")), "rank": str(record.get("rank"))}
        for gauge, key in self._gauges:
            value = _step_value(record, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                gauge.labels(**labels).set(value)

    def close(self) -> None:
        """Stop serving (the port is free again)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()
            self._thread.join()


def require(name: str) -> None:
    """Raise ImportError (naming the ``pip install``) when the sink called ``name`` needs a
    package that is not installed, ValueError when no sink has that name; checks before a run."""
    if name not in SINK_NAMES:
        raise ValueError(f"unknown sink {name!r}; known: {', '.join(SINK_NAMES)}")
    if name == "parquet":
        _pyarrow()
    elif name == "prometheus":
        _prometheus()
    elif name == "tensorboard":
        _tensorboard()


def make_sink(name: str, folder: str | os.PathLike, rank: int) -> Sink:
    """The sink called ``name`` (one of :data:`SINK_NAMES`) writing rank ``rank``'s file in a
    run's ``folder``: ``rank<r>.jsonl``, ``rank<r>.csv``, ``rank<r>.parquet`` (parts while
    running), ``tensorboard/rank<r>/``; ``prometheus`` serves on :func:`prometheus_port`."""
    folder = Path(folder)
    if name == "jsonl":
        return JsonlSink(folder / f"rank{rank}.jsonl")
    if name == "csv":
        return CsvSink(folder / f"rank{rank}.csv")
    if name == "parquet":
        return ParquetSink(folder / f"rank{rank}.parquet")
    if name == "tensorboard":
        return TensorBoardSink(folder / "tensorboard" / f"rank{rank}")
    if name == "prometheus":
        return PrometheusSink(prometheus_port(rank))
    raise ValueError(f"unknown sink {name!r}; known: {', '.join(SINK_NAMES)} (or pass a Sink object)")
