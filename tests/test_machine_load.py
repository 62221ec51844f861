"""The load gate of the speed benchmarks (cokit.bench.machine_load), with injected load readings:
a busy machine is refused before any work (saying why) unless allowed, and then the results
say they are no headline. No timing is measured or asserted here."""

from __future__ import annotations

import json

import pytest

from cokit.bench import linear_cpu_overhead, machine_load, step_regression
from cokit.bench.machine_load import LoadGate, LoadReading, busy_reason, read_load


def _reader(*loads: float, cores: int = 2):
    """A reader returning ``loads`` (1-minute) one after the other, on ``cores`` cores."""
    it = iter(loads)

    def read(own: int) -> LoadReading:
        load = next(it)
        return LoadReading(load, load, load, cores, own)

    return read


def test_busy_above_the_fraction_of_the_cores_less_the_benchmarks_own_processes():
    assert busy_reason(LoadReading(1.0, 0, 0, 2)) is None  # at the limit: quiet
    reason = busy_reason(LoadReading(1.01, 0, 0, 2))
    assert reason is not None and "1.01" in reason and "2 cores" in reason and "1.00" in reason
    assert busy_reason(LoadReading(1.9, 0, 0, 2, own=1)) is None  # 0.9 of it is other work
    assert "less 1 busy process" in (busy_reason(LoadReading(2.5, 0, 0, 2, own=1)) or "")
    assert busy_reason(LoadReading(3.0, 0, 0, 8)) is None
    assert busy_reason(LoadReading(3.0, 0, 0, 8), max_fraction=0.25) is not None


def test_read_load_takes_injected_readings():
    r = read_load(1, getloadavg=lambda: (0.5, 0.25, 0.125), cpu_count=lambda: None)
    assert r == LoadReading(0.5, 0.25, 0.125, 1, 1)
    assert r.to_dict() == {"load1": 0.5, "load5": 0.25, "load15": 0.125, "cores": 1, "own": 1}


def test_gate_refuses_a_busy_start_unless_allowed(capsys):
    gate = LoadGate("bench", reader=_reader(3.0))
    assert gate.start() is False
    err = capsys.readouterr().err
    assert "bench: refusing to measure speed ratios" in err and "3.00" in err and "--allow-busy" in err

    allowed = LoadGate("bench", allow_busy=True, reader=_reader(3.0, 0.5))
    assert allowed.start() is True
    allowed.finish()
    assert not allowed.headline and allowed.banner().startswith("NOT A HEADLINE (busy machine): start:")
    record = allowed.record()
    assert record["headline"] is False and len(record["not_headline_because"]) == 1
    assert record["readings"]["end"]["own"] == 1 and record["readings"]["start"]["load1"] == 3.0


def test_gate_quiet_start_but_busy_end_is_no_headline():
    gate = LoadGate("bench", reader=_reader(0.2, 2.6))
    assert gate.start()
    assert gate.headline and gate.banner() is None
    gate.finish(own=1)  # 2.6 - 1 = 1.6 > 1.0
    assert not gate.headline and "end:" in gate.banner()
    quiet = LoadGate("bench", max_fraction=1.0, reader=_reader(1.5, 2.9))
    assert quiet.start()
    quiet.finish(own=1)
    assert quiet.headline and quiet.record()["not_headline_because"] == []
    with pytest.raises(ValueError, match="--max-load must be > 0"):
        LoadGate("bench", max_fraction=0.0)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "x"])
@pytest.mark.parametrize("bench", [step_regression, linear_cpu_overhead])
def test_benchmarks_refuse_a_max_load_that_is_not_above_zero(bench, value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--baseline-ref", "HEAD", "--max-load", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-load:" in err and ("must be > 0" in err or "invalid float value" in err)


@pytest.fixture
def busy(monkeypatch):
    """The machine looks busy (load 9 on 2 cores); no benchmark work may start."""
    monkeypatch.setattr(machine_load.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)

    def no_work(*args, **kwargs):
        raise AssertionError("the benchmark started work on a busy machine")

    for module in (step_regression, linear_cpu_overhead):
        monkeypatch.setattr(module, "export", no_work)
        monkeypatch.setattr(module, "run", no_work)


def test_benchmarks_refuse_a_busy_machine_before_any_work(busy, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert step_regression.main(["--baseline-ref", "HEAD", "--out", str(out)]) == 3
    assert linear_cpu_overhead.main(["--baseline-ref", "HEAD", "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert err.count("refusing to measure speed ratios: the 1-minute load average is 9.00 on 2 cores") == 2
    assert not out.exists()


def test_allowed_busy_run_writes_results_marked_no_headline(busy, monkeypatch, tmp_path, capsys):
    times = {
        (case, tree, variant): [1.0 if variant == "torch" else 1.02 if tree == "after" else 2.0]
        for case in linear_cpu_overhead.CASES
        for tree in linear_cpu_overhead.TREES
        for variant in linear_cpu_overhead.VARIANTS
    }
    result = {
        "rows": [linear_cpu_overhead.summarize(case, times) for case in linear_cpu_overhead.CASES],
        "control": {"what": "copy", "ms": {"before": 1.0, "after": 1.1}, "after / before": 1.1},
        "loops": {},
    }
    monkeypatch.setattr(linear_cpu_overhead, "run", lambda *a, **k: result)
    out = tmp_path / "lco.json"
    argv = ["--baseline-tree", str(tmp_path), "--out", str(out), "--allow-busy", "--rounds", "1"]
    assert linear_cpu_overhead.main(argv) == 0
    printed = capsys.readouterr().out
    assert "NOT A HEADLINE (busy machine)" in printed and "control: copy: after/before 1.100" in printed
    doc = json.loads(out.read_text())
    assert doc["headline"] is False and doc["load"]["readings"]["start"]["load1"] == 9.0
    row = doc["rows"][0]
    assert row["cokit / torch"] == {"before": 2.0, "after": 1.02} and row["met"] is True
    assert row["after / before"]["torch"] == 1.0

    monkeypatch.setattr(step_regression, "run", lambda *a, **k: [])
    out2 = tmp_path / "sr.json"
    assert step_regression.main(["--baseline-tree", str(tmp_path), "--out", str(out2), "--allow-busy"]) == 0
    doc2 = json.loads(out2.read_text())
    assert doc2["headline"] is False and doc2["load"]["not_headline_because"][0].startswith("start:")
