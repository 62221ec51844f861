"""``cokit.telemetry``: a per-step telemetry stream for training runs.

:class:`Monitor` writes one record per step per rank (schema ``cokit.telemetry/1``,
:mod:`cokit.telemetry.schema`) to ``<out_dir>/telemetry/<run>/rank<r>.jsonl``: step time,
loss, learning rate, the optimizer's communication (bytes; encode, decode, exposed and total
communication time), kernel configs with their occupancy, tuner decisions, memory
high-water mark; rank 0 adds a per-step summary across ranks. Other sinks (CSV, Parquet,
TensorBoard, Prometheus, your own :class:`Sink`) take the same records;
:func:`export_table` (``cokit telemetry export``) rebuilds the tables from the JSONL. ``cokit demo`` and
``cokit bench validate`` write it by default (``--no-telemetry`` turns it off);
``cokit dashboard`` draws it.
"""

from cokit.telemetry.export import export_table
from cokit.telemetry.monitor import Monitor, TelemetryError, telemetry_dir
from cokit.telemetry.schema import SCHEMA, check_record, clean, flatten, iso_time, read_jsonl, table_row
from cokit.telemetry.sinks import (
    SINK_NAMES,
    CsvSink,
    JsonlSink,
    ParquetSink,
    PrometheusSink,
    Sink,
    TensorBoardSink,
    make_sink,
)

__all__ = [
    "SCHEMA",
    "SINK_NAMES",
    "CsvSink",
    "JsonlSink",
    "Monitor",
    "ParquetSink",
    "PrometheusSink",
    "Sink",
    "TelemetryError",
    "TensorBoardSink",
    "check_record",
    "clean",
    "export_table",
    "flatten",
    "iso_time",
    "make_sink",
    "read_jsonl",
    "table_row",
    "telemetry_dir",
]
