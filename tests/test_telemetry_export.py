"""Telemetry for BI tools and live monitoring: incremental CSV/Parquet sinks that survive a
SIGKILL, ``cokit telemetry export`` (JSONL -> tables, after a crash too), the ``time_iso``
column, ``cokit demo --sinks`` and the Prometheus endpoint (scraped over loopback)."""

from __future__ import annotations

import csv
import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from cokit.cli import main
from cokit.telemetry import CsvSink, Monitor, ParquetSink, read_jsonl, table_row
from cokit.telemetry.export import export_table, run_files
from cokit.telemetry.sinks import part_paths, prometheus_port

ROOT = Path(__file__).resolve().parents[1]


def _ticks():
    """A fake clock: 0, 1, 2, ... seconds."""
    counter = iter(range(10**6))
    return lambda: float(next(counter))


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _as_csv(value):
    """What a JSON value looks like in a CSV cell written by csv.DictWriter."""
    return "" if value is None else str(value)


def _run_folder(tmp_path: Path, run: str = "r") -> Path:
    return tmp_path / "telemetry" / run


# ----------------------------------------------------------------------------- incremental sinks


def test_csv_rows_are_on_disk_before_close_and_new_keys_stay_in_the_jsonl(tmp_path):
    with Monitor(tmp_path, "r", sinks=["jsonl", "csv"], clock=_ticks()) as mon:
        mon.step(1, loss=2.0, acc=0.5)
        mon.step(2, loss=1.5, acc=0.25)
        rows = _csv_rows(_run_folder(tmp_path) / "rank0.csv")  # before close: appended as written
        assert [r["step"] for r in rows] == ["1", "2"] and rows[1]["metrics.acc"] == "0.25"
        mon.step(3, loss=1.0, grad_norm=3.0)  # a metric the header does not have
        csv_sink = mon.sinks[1]
    rows = _csv_rows(_run_folder(tmp_path) / "rank0.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"] and "metrics.grad_norm" not in rows[0]
    assert rows[2]["metrics.acc"] == "" and csv_sink.dropped == {"metrics.grad_norm"}
    # the schema's columns are there from the first row on (summary ones too), in schema order
    assert list(rows[0])[:7] == ["schema", "kind", "run", "rank", "world_size", "time", "time_iso"]
    assert {"comm.sent_bytes", "comm.exposed_s", "step_s_max", "slowest_rank"} <= set(rows[0])
    steps = [r for r in read_jsonl(_run_folder(tmp_path) / "rank0.jsonl")[0] if r["kind"] == "step"]
    assert steps[2]["metrics"] == {"grad_norm": 3.0}  # kept in full in the JSONL


def test_parquet_parts_every_n_rows_and_at_flush_merged_at_close(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    sink = ParquetSink(path, rows_per_part=2)
    with Monitor(tmp_path, "r", sinks=[sink], clock=_ticks()) as mon:
        for step in (1, 2, 3):
            mon.step(step, loss=1.0 / step)
        assert [p.name for p in part_paths(path)] == ["t.part-00000.parquet"]  # rows 1-2; row 3 buffered
        mon.flush()
        parts = part_paths(path)
        assert [p.name for p in parts] == ["t.part-00000.parquet", "t.part-00001.parquet"]
        assert [r["step"] for p in parts for r in pq.read_table(p).to_pylist()] == [1, 2, 3]
        mon.step(4, loss=None)  # a null loss keeps the part schema's float type
    assert part_paths(path) == [] and not list(tmp_path.glob(".*.tmp"))  # merged, atomically
    table = pq.read_table(path)
    assert [r["step"] for r in table.to_pylist()] == [1, 2, 3, 4]
    assert str(table.schema.field("loss").type) == "double" and table.column("loss").to_pylist()[3] is None
    # a new run in the same place starts clean: the old table and parts are removed
    (tmp_path / "t.part-00007.parquet").write_bytes(b"stale")
    ParquetSink(path).close()
    assert not path.exists() and part_paths(path) == []


KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from cokit.telemetry import Monitor, ParquetSink
    out = sys.argv[1]
    ticks = iter(range(10**6))
    mon = Monitor(out, "killed", clock=lambda: float(next(ticks)),
                  sinks=["jsonl", "csv", ParquetSink(out + "/telemetry/killed/rank0.parquet", rows_per_part=2)])
    for step in range(1, 6):
        mon.step(step, loss=1.0 / step, lr=0.1)
    print("ready", flush=True)
    sys.stdin.read()  # wait to be killed: no close(), no end line
    """
)


def test_a_sigkilled_run_leaves_readable_csv_and_parquet_parts_and_export_recovers_all(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # no sleep: it says when
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    folder = _run_folder(tmp_path, "killed")
    records, skipped = read_jsonl(folder / "rank0.jsonl")
    assert [r["kind"] for r in records] == ["meta"] + ["step"] * 5 and skipped == 0  # no end line
    assert [r["step"] for r in _csv_rows(folder / "rank0.csv")] == ["1", "2", "3", "4", "5"]
    parts = part_paths(folder / "rank0.parquet")
    assert len(parts) == 2 and not (folder / "rank0.parquet").exists()
    assert [r["step"] for p in parts for r in pq.read_table(p).to_pylist()] == [1, 2, 3, 4]  # 5 was buffered
    # a partial last line, as a kill mid-write would leave
    with (folder / "rank0.jsonl").open("a") as f:
        f.write('{"schema": "cokit.telemetry/1", "kind": "st')
    assert main(["telemetry", "export", str(tmp_path), "--format", "parquet"]) == 0
    assert [r["step"] for r in pq.read_table(folder / "rank0.parquet").to_pylist()] == [1, 2, 3, 4, 5]
    assert part_paths(folder / "rank0.parquet") == []  # the export replaces the parts


# ----------------------------------------------------------------------------- export


def _recorded_run(tmp_path: Path, world: int = 2) -> list[list[dict]]:
    """A run of ``world`` ranks (no process group) with a user metric that appears late."""
    out = []
    for rank in range(world):
        with Monitor(
            tmp_path, "r", rank=rank, world_size=world, config={"lr": 0.1}, clock=_ticks(), method="X"
        ) as mon:
            mon.step(1, loss=2.0, lr=0.1)
            mon.step(2, loss=float("nan"), held_out_loss=1.5, acc=0.5)
        out.append(read_jsonl(_run_folder(tmp_path) / f"rank{rank}.jsonl")[0])
    return out


def test_export_csv_round_trip_equals_the_jsonl(tmp_path, capsys):
    per_rank = _recorded_run(tmp_path)
    with (_run_folder(tmp_path) / "rank1.jsonl").open("a") as f:
        f.write('{"schema": "cokit.telemetry/1", "ki')  # a killed run's partial last line
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv", "--kinds", "all"]) == 0
    out = capsys.readouterr().out
    assert "rank0.csv (4 rows)" in out and "rank1.csv (4 rows; 1 unreadable line(s) skipped)" in out
    for rank, records in enumerate(per_rank):
        rows = _csv_rows(_run_folder(tmp_path) / f"rank{rank}.csv")
        assert [r["kind"] for r in rows] == ["meta", "step", "step", "end"]
        for row, record in zip(rows, records, strict=True):
            flat = table_row(record)
            assert {k: v for k, v in row.items() if v != ""} == {
                k: _as_csv(v) for k, v in flat.items() if v is not None
            }
        assert rows[2]["metrics.acc"] == "0.5" and rows[0]["config.lr"] == "0.1"


def test_export_parquet_round_trip_equals_the_jsonl_and_out_dir(tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    per_rank = _recorded_run(tmp_path)
    out = tmp_path / "tables"
    assert (
        main(["telemetry", "export", str(tmp_path / "telemetry"), "--format", "parquet", "--out", str(out)])
        == 0
    )
    assert sorted(p.name for p in (out / "r").iterdir()) == ["rank0.parquet", "rank1.parquet"]
    for rank, records in enumerate(per_rank):
        table = pq.read_table(out / "r" / f"rank{rank}.parquet").to_pylist()
        steps = [table_row(r) for r in records if r["kind"] == "step"]
        assert [{k: v for k, v in row.items() if v is not None} for row in table] == [
            {k: v for k, v in flat.items() if v is not None} for flat in steps
        ]
    assert "rank1.parquet (2 rows)" in capsys.readouterr().out
    # the API, on one run's folder
    done = export_table(_run_folder(tmp_path) / "rank0.jsonl", tmp_path / "x.csv", "csv", kinds=["end"])
    assert done.rows == 1 and done.skipped == 0 and _csv_rows(done.path)[0]["kind"] == "end"
    assert [(run, p.name, r) for run, p, r in run_files(_run_folder(tmp_path))] == [
        ("r", "rank0.jsonl", 0),
        ("r", "rank1.jsonl", 1),
    ]


def test_export_skips_a_line_nested_too_deep_and_names_its_file_and_line(tmp_path, capsys):
    """A line nested 1,100 deep ended `cokit telemetry export` in RecursionError; it is skipped
    like a truncated line, and stderr names the file and line."""
    _recorded_run(tmp_path, world=1)
    path = _run_folder(tmp_path) / "rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(2, '{"schema": "cokit.telemetry/1", "x": ' + "[" * 1100 + "]" * 1100 + "}\n")
    path.write_text("".join(lines))
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv", "--kinds", "all"]) == 0
    captured = capsys.readouterr()
    assert "rank0.csv (4 rows; 1 unreadable line(s) skipped)" in captured.out
    assert f"{path}: 1 line(s) skipped (line 3: 1 nested deeper than 100 arrays/objects)" in captured.err
    assert "Traceback" not in captured.err
    assert [r["kind"] for r in _csv_rows(_run_folder(tmp_path) / "rank0.csv")] == [
        "meta",
        "step",
        "step",
        "end",
    ]
    assert read_jsonl(path)[1] == 1


def test_parquet_export_warns_of_integers_beyond_int64_that_it_writes_as_null(tmp_path, capsys):
    """CSV keeps an integer beyond int64; Parquet's int64 columns cannot, and used to write null
    without a word. The export names the column and the count; a float column (metrics.*)
    keeps the value as its nearest float."""
    pq = pytest.importorskip("pyarrow.parquet")
    _recorded_run(tmp_path, world=1)
    path = _run_folder(tmp_path) / "rank0.jsonl"
    records = read_jsonl(path)[0]
    big = dict(records[1], step=2**70, process={"max_memory_bytes": 2**64, "device": "cpu"})
    big["metrics"] = {"tokens": 2**70}
    path.write_text("".join(json.dumps(r) + "\n" for r in [*records[:2], big, *records[2:]]))
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv"]) == 0
    assert [r["step"] for r in _csv_rows(_run_folder(tmp_path) / "rank0.csv")] == ["1", str(2**70), "2"]
    capsys.readouterr()
    assert main(["telemetry", "export", str(tmp_path), "--format", "parquet"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "rank0.parquet" in err and "beyond int64" in err, err
    assert "step (1 value), process.max_memory_bytes (1 value)" in err, err
    table = pq.read_table(_run_folder(tmp_path) / "rank0.parquet").to_pylist()
    assert [r["step"] for r in table] == [1, None, 2] and table[1]["metrics.tokens"] == float(2**70)
    # the API: a TableWarning, and the counts on the result
    from cokit.telemetry.sinks import TableWarning

    with pytest.warns(TableWarning, match=r"step \(1 value\)"):
        done = export_table(path, tmp_path / "x.parquet", "parquet")
    assert done.nulled == {"step": 1, "process.max_memory_bytes": 1}
    # the sink, whose first part fixed the columns' types, counts and warns at close too
    sink = ParquetSink(tmp_path / "s.parquet", rows_per_part=1)
    for record in [*records[:2], big]:
        sink.write(record)
    with pytest.warns(TableWarning, match="s.parquet"):
        sink.close()
    assert sink.nulled == {"step": 1, "process.max_memory_bytes": 1}


# ----------------------------------------------------------------------------- time_iso


def test_time_iso_parses_and_matches_time_in_jsonl_csv_and_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    with Monitor(tmp_path, "r", sinks=["jsonl", "csv", "parquet"], clock=_ticks()) as mon:
        mon.step(1, loss=1.0)
        mon.step(2, loss=0.5)
    folder = _run_folder(tmp_path)
    records = read_jsonl(folder / "rank0.jsonl")[0]
    rows = _csv_rows(folder / "rank0.csv")
    table = pq.read_table(folder / "rank0.parquet").to_pylist()
    for got in [*records, *rows, *table]:
        parsed = datetime.datetime.fromisoformat(got["time_iso"])
        assert parsed.utcoffset() == datetime.timedelta(0) and got["time_iso"].endswith("+00:00")
        assert abs(parsed.timestamp() - float(got["time"])) < 1e-6
    assert list(records[1])[:7] == ["schema", "kind", "run", "rank", "world_size", "time", "time_iso"]


def test_export_adds_time_iso_to_records_written_before_it(tmp_path):
    old = {"schema": "cokit.telemetry/1", "kind": "step", "run": "old", "rank": 0, "world_size": 1}
    folder = _run_folder(tmp_path, "old")
    folder.mkdir(parents=True)
    (folder / "rank0.jsonl").write_text(json.dumps({**old, "time": 0.5, "step": 1}) + "\n")
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv"]) == 0
    (row,) = _csv_rows(folder / "rank0.csv")
    assert row["time_iso"] == "1970-01-01T00:00:00.500000+00:00" and list(row)[6] == "time_iso"


# ----------------------------------------------------------------------------- cokit demo --sinks


def test_demo_sinks_write_every_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("tensorboard")
    from cokit.launch import free_port

    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ["demo", "--steps", "2", "--methods", "adamw", "--model", "toy", "--max-chars", "100000"]
    argv += [
        "--batch-size",
        "4",
        "--quiet",
        "--out",
        str(tmp_path),
        "--sinks",
        "jsonl,csv,parquet,tensorboard",
    ]
    assert main(argv) == 0
    folder = _run_folder(tmp_path, "demo-AdamW")
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["rank0.csv", "rank0.jsonl", "rank0.parquet", "tensorboard"]
    rows = _csv_rows(folder / "rank0.csv")  # steps, then the summary each step's gather gives
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("step", "1"),
        ("step", "2"),
        ("summary", "1"),
        ("summary", "2"),
    ]
    assert "jsonl, csv, parquet, tensorboard per rank" in capsys.readouterr().out
    # what the sink streamed is what the export rebuilds from the JSONL (cell by cell)
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv", "--out", str(tmp_path / "t")]) == 0
    exported = _csv_rows(tmp_path / "t" / "demo-AdamW" / "rank0.csv")
    assert [{k: v for k, v in r.items() if v} for r in rows] == [
        {k: v for k, v in r.items() if v} for r in exported
    ]


# ----------------------------------------------------------------------------- Prometheus


def _scrape(url: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of every sample on the page."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_prometheus_serves_the_last_steps_gauges_over_loopback(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    from test_telemetry import FakeOptimizer

    from cokit.telemetry import PrometheusSink

    monkeypatch.setenv("COKIT_PROMETHEUS_PORT", "0")  # any free port
    opt = FakeOptimizer()
    with Monitor(tmp_path, "p-run", optimizer=opt, sinks=["prometheus"], clock=_ticks()) as mon:
        sink = mon.sinks[0]
        assert isinstance(sink, PrometheusSink) and sink.addr == "127.0.0.1" and sink.port > 0
        assert not any(k.startswith("cokit_step{") for k in _scrape(sink.url))  # nothing recorded yet
        opt.comm_stats.record(1000, 0.1, 0.2, 0.3, 0.4)
        mon.step(1, loss=2.0, lr=0.1, held_out_loss=3.0)
        first = _scrape(sink.url)
        opt.comm_stats.record(500, 0.1, 0.1, 0.1, 0.1)
        mon.step(2, loss=1.5, lr=0.05)  # no held-out loss: its gauge keeps the last one
        second = _scrape(sink.url)
    labels = '{rank="0",run="p-run"}'
    assert first[f"cokit_step{labels}"] == 1 and first[f"cokit_comm_sent_bytes{labels}"] == 1000
    assert second[f"cokit_step{labels}"] == 2 and second[f"cokit_loss{labels}"] == 1.5
    assert second[f"cokit_lr{labels}"] == 0.05 and second[f"cokit_held_out_loss{labels}"] == 3.0
    assert (
        second[f"cokit_step_seconds{labels}"] == 1.0 and second[f"cokit_comm_exposed_seconds{labels}"] == 0.1
    )
    assert second[f"cokit_compression_ratio{labels}"] == 4.0
    assert f"cokit_max_memory_bytes{labels}" in second
    with pytest.raises(OSError):  # closed with the Monitor: the port is free, nothing answers
        urllib.request.urlopen(sink.url, timeout=30)


def test_prometheus_port_comes_from_the_environment_plus_the_rank(monkeypatch):
    monkeypatch.delenv("COKIT_PROMETHEUS_PORT", raising=False)
    assert (prometheus_port(), prometheus_port(3)) == (9464, 9467)
    monkeypatch.setenv("COKIT_PROMETHEUS_PORT", "9100")
    assert prometheus_port(2) == 9102
    monkeypatch.setenv("COKIT_PROMETHEUS_PORT", "0")
    assert prometheus_port(5) == 0
    monkeypatch.setenv("COKIT_PROMETHEUS_PORT", "http")
    with pytest.raises(ValueError, match="COKIT_PROMETHEUS_PORT='http' is not a port number"):
        prometheus_port()


def test_a_taken_port_is_a_clear_error():
    pytest.importorskip("prometheus_client")
    from cokit.telemetry import PrometheusSink

    first = PrometheusSink(port=0)
    try:
        with pytest.raises(OSError, match=rf"cannot serve Prometheus metrics on 127.0.0.1:{first.port}"):
            PrometheusSink(port=first.port)
    finally:
        first.close()


def test_missing_prometheus_client_names_the_install(tmp_path, monkeypatch, capsys):
    from cokit.telemetry import PrometheusSink

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install prometheus_client"):
        PrometheusSink(port=0)
    assert main(["demo", "--sinks", "jsonl,prometheus", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install prometheus_client" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- bad input


def test_unknown_sink_names_are_refused(tmp_path, capsys):
    assert main(["demo", "--sinks", "jsonl,excel", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--sinks: unknown sink 'excel'; known: jsonl, csv, parquet, tensorboard, prometheus" in err
    assert main(["demo", "--sinks", " , ", "--out", str(tmp_path / "o")]) == 2
    assert "--sinks names no sink" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown sink 'excel'"):
        Monitor(tmp_path, "r", sinks=["excel"])


def test_export_bad_inputs_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["telemetry", "export", str(tmp_path), "--format", "xlsx"])
    assert info.value.code == 2 and "invalid choice: 'xlsx'" in capsys.readouterr().err
    assert main(["telemetry", "export", str(tmp_path / "nope"), "--format", "csv"]) == 2
    err = capsys.readouterr().err
    assert "RUN_DIR" in err and "does not exist" in err
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv"]) == 2
    assert "no telemetry under" in capsys.readouterr().err
    _recorded_run(tmp_path, world=1)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv", "--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["telemetry", "export", str(tmp_path), "--format", "csv", "--kinds", ","]) == 2
    assert "--kinds names no record kind" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown format 'xlsx'"):
        export_table(_run_folder(tmp_path) / "rank0.jsonl", tmp_path / "x", "xlsx")
    with pytest.raises(ValueError, match="rows_per_part"):
        ParquetSink(tmp_path / "x.parquet", rows_per_part=0)
    with pytest.raises(TypeError, match="kinds"):
        CsvSink(tmp_path / "x.csv", kinds="step")
    assert not os.path.exists(tmp_path / "x.csv")
