"""cokit.telemetry: the record schema, exact times from a fake clock, the sinks' round trips,
real gloo runs (one file per rank, summaries on rank 0, bytes equal to comm_stats), the wiring
into ``cokit demo`` / ``cokit bench validate``, and bad input."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch
from distributed import run_gloo

from cokit.telemetry import (
    SCHEMA,
    CsvSink,
    JsonlSink,
    Monitor,
    ParquetSink,
    Sink,
    TelemetryError,
    TensorBoardSink,
    check_record,
    read_jsonl,
)
from cokit.telemetry.schema import COMM_FIELDS, KIND_FIELDS
from cokit.triton_kernels.gemm_config import GemmConfig


class FakeClock:
    """Returns the given readings in order (one per call)."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


class FakeStats:
    """``CommStats.as_dict()`` with the contract's fields, driven by hand."""

    def __init__(self) -> None:
        self.steps = 0
        self.step: dict = {}
        self.total = {k: 0 for k in ("sent_bytes", "received_bytes", "dense_bytes")}
        self.total.update({k: 0.0 for k in ("encode_s", "decode_s", "exposed_s", "comm_s")})

    def record(self, sent: int, encode: float, decode: float, exposed: float, comm: float) -> None:
        self.steps += 1
        self.step = {
            "sent_bytes": sent,
            "received_bytes": sent,
            "dense_bytes": 4 * sent,
            "encode_s": encode,
            "decode_s": decode,
            "exposed_s": exposed,
            "comm_s": comm,
        }
        for k, v in self.step.items():
            self.total[k] += v

    def as_dict(self) -> dict:
        d = {"steps": self.steps, "world_size": 2, "group_size": 2}
        d.update({f"step_{k}": v for k, v in self.step.items()})
        d.update({f"total_{k}": v for k, v in self.total.items()})
        d["step_collectives"] = [
            {"what": "all-gather", "sent_bytes": self.step.get("sent_bytes", 0), "received_bytes": 0}
        ]
        d["ratio"] = (
            self.total["dense_bytes"] / self.total["sent_bytes"] if self.total["sent_bytes"] else math.inf
        )
        return d


class FakeOptimizer:
    def __init__(self) -> None:
        self.comm_stats = FakeStats()


class ListSink(Sink):
    """A user's own sink: keeps the records."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def _lines(tmp_path, run="r", rank=0):
    records, skipped = read_jsonl(tmp_path / "telemetry" / run / f"rank{rank}.jsonl")
    assert skipped == 0
    return records


# ----------------------------------------------------------------------------- schema and times


def test_every_kind_follows_the_schema_and_times_come_from_the_clock(tmp_path):
    from cokit.overlap.tuner import OnlineTuner

    opt = FakeOptimizer()
    tuner = OnlineTuner([GemmConfig(), GemmConfig(num_warps=8)], trials=1)
    own = ListSink()
    # readings: start, step 1, paused enter/exit, step 2, step 3, close
    clock = FakeClock(10.0, 11.0, 11.5, 12.0, 13.5, 14.0, 20.0)
    mon = Monitor(
        tmp_path, "r", optimizer=opt, sinks=["jsonl", own], config={"lr": 0.1}, method="DeMo", clock=clock
    )
    mon.add_kernel("gemm", GemmConfig(persistent=True, num_sms=120, smem_bytes=100_000), target="sm_90")
    opt.comm_stats.record(1000, 0.1, 0.2, 0.3, 0.4)
    mon.step(1, loss=2.5, lr=0.1, acc=0.5)
    tuner.record(tuner.choose(), 3.0)
    with mon.paused():  # 0.5 s left out of step 2
        pass
    opt.comm_stats.record(2000, 0.05, 0.05, 0.1, 0.2)
    mon.attach_tuner(tuner)
    mon.step(2, loss=float("nan"), held_out_loss=2.0)
    mon.step(3, loss=torch.tensor(1.5))  # no optimizer step in between
    mon.close()
    mon.close()  # a second close does nothing

    records = _lines(tmp_path)
    assert records == own.records and own.closed
    assert [r["kind"] for r in records] == ["meta", "step", "step", "step", "end"]
    for r in records:
        check_record(r)
        assert set(r) >= {"schema", "kind", "run", "rank", "world_size", "time", *KIND_FIELDS[r["kind"]]}
        assert r["schema"] == SCHEMA and r["run"] == "r" and (r["rank"], r["world_size"]) == (0, 1)
    meta, s1, s2, s3, end = records
    assert meta["method"] == "DeMo" and meta["config"] == {"lr": 0.1} and meta["device"] == "cpu"
    assert meta["torch"] == torch.__version__ and meta["pid"] > 0
    # exact times from the fake clock
    assert (s1["step"], s1["wall_s"], s1["step_s"]) == (1, 1.0, 1.0)
    assert (s2["wall_s"], s2["step_s"]) == (3.5, 2.0)  # 2.5 s since step 1, less 0.5 s paused
    assert (s3["wall_s"], s3["step_s"]) == (4.0, 0.5)
    assert s1["compute_s"] == pytest.approx(1.0 - 0.1 - 0.2 - 0.3)
    assert s2["compute_s"] == pytest.approx(2.0 - 0.05 - 0.05 - 0.1)
    assert s3["compute_s"] == 0.5  # nothing communicated since step 2
    assert (end["steps"], end["wall_s"]) == (3, 10.0)
    # values
    assert (s1["loss"], s1["lr"], s1["held_out_loss"], s1["metrics"]) == (2.5, 0.1, None, {"acc": 0.5})
    assert s2["loss"] is None and s2["held_out_loss"] == 2.0  # NaN is written as null
    assert s3["loss"] == 1.5
    assert set(s1["comm"]) >= set(COMM_FIELDS)
    assert s1["comm"]["sent_bytes"] == 1000 and s1["comm"]["dense_bytes"] == 4000
    assert s1["comm"]["exposed_s"] == 0.3 and s1["comm"]["collectives"][0]["what"] == "all-gather"
    assert (s1["comm"]["world_size"], s1["comm"]["group_size"]) == (2, 2)
    assert s2["comm"]["ratio"] == 4.0
    assert s3["comm"]["sent_bytes"] == 0 and s3["comm"]["exposed_s"] == 0.0 and s3["comm"]["steps"] == 0
    # kernels: the GemmConfig and its occupancy on sm_90 (smem 100000 B: 2 blocks per SM)
    (k,) = s1["kernels"]
    assert k["name"] == "gemm" and k["config"]["num_sms"] == 120 and k["config"]["smem_bytes"] == 100_000
    assert (k["blocks_per_sm"], k["limiter"], k["smem_per_block"], k["reserved_sms"]) == (
        2,
        "shared memory",
        100_000,
        12,
    )
    assert s3["kernels"] == s1["kernels"]
    # the tuner: its decisions so far at the first step after attaching, then only new ones
    assert [d["event"] for d in s2["tuner"]] == ["explore", "trial"] and s1["tuner"] == []
    assert s3["tuner"] == []
    assert s1["process"]["max_memory_bytes"] > 0 and s1["process"]["device"] == "cpu"


def test_several_optimizer_steps_per_monitor_step_add_up(tmp_path):
    opt = FakeOptimizer()
    mon = Monitor(tmp_path, "r", optimizer=opt, clock=FakeClock(0.0, 4.0, 5.0))
    opt.comm_stats.record(100, 0.1, 0.1, 0.5, 1.0)
    opt.comm_stats.record(300, 0.2, 0.1, 0.5, 1.0)
    rec = mon.step(2, loss=1.0)
    mon.close()
    c = rec["comm"]
    assert (c["steps"], c["sent_bytes"], c["dense_bytes"]) == (2, 400, 1600)
    assert (c["encode_s"], c["exposed_s"]) == (pytest.approx(0.3), pytest.approx(1.0))
    assert rec["compute_s"] == pytest.approx(4.0 - 0.3 - 0.2 - 1.0)


def test_plain_torch_optimizer_gives_null_comm_and_its_lr(tmp_path):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.25)
    with Monitor(tmp_path, "plain", optimizer=opt, clock=FakeClock(0.0, 1.0, 2.0)) as mon:
        rec = mon.step(1, loss=0.5)
    assert rec["comm"] is None and rec["compute_s"] is None and rec["lr"] == 0.25
    assert rec["kernels"] == [] and rec["tuner"] == []


def test_current_comm_stats_of_demo_are_read(tmp_path):
    from cokit.compress import DeMo

    model = torch.nn.Linear(8, 4)
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=4)
    with Monitor(tmp_path, "single", optimizer=opt) as mon:
        for step in (1, 2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            rec = mon.step(step)
            assert rec["comm"]["sent_bytes"] == opt.comm_stats.step_sent_bytes == 0  # one process
            check_record(rec)


def test_a_crash_leaves_whole_lines_and_readers_skip_a_partial_one(tmp_path):
    mon = Monitor(tmp_path, "r", clock=FakeClock(0.0, 1.0, 2.0))
    mon.step(1, loss=1.0)
    path = tmp_path / "telemetry" / "r" / "rank0.jsonl"
    assert len(path.read_text().splitlines()) == 2  # on disk before close: flushed every line
    mon.step(2, loss=1.0)
    mon.sinks[0].close()  # the process "dies" mid-write of the next line
    with path.open("a") as f:
        f.write('{"schema": "cokit.telemetry/1", "kind": "st')
    records, skipped = read_jsonl(path)
    assert [r["kind"] for r in records] == ["meta", "step", "step"] and skipped == 1


def test_exception_in_the_with_block_is_recorded_in_the_end_line(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), Monitor(tmp_path, "r") as mon:
        mon.step(1, loss=1.0)
        raise RuntimeError("boom")
    end = _lines(tmp_path)[-1]
    assert end["kind"] == "end" and end["steps"] == 1 and end["error"] == "RuntimeError: boom"


# ----------------------------------------------------------------------------- sinks


def _run_with(tmp_path, sinks):
    opt = FakeOptimizer()
    clock = FakeClock(0.0, 1.0, 3.0, 4.0)
    with Monitor(tmp_path, "r", optimizer=opt, sinks=sinks, clock=clock) as mon:
        mon.add_kernel("gemm", GemmConfig())
        opt.comm_stats.record(1000, 0.1, 0.2, 0.3, 0.4)
        first = mon.step(1, loss=2.0, lr=0.1, acc=0.25)
        opt.comm_stats.record(500, 0.1, 0.1, 0.1, 0.1)
        second = mon.step(2, loss=float("inf"), lr=0.1, acc=0.5)
    return first, second


def test_jsonl_and_csv_round_trip(tmp_path):
    first, second = _run_with(tmp_path, ["jsonl", "csv", CsvSink(tmp_path / "all.csv", kinds=None)])
    records = _lines(tmp_path)
    assert records[1] == first and records[2] == second
    with (tmp_path / "telemetry" / "r" / "rank0.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["kind"] for r in rows] == ["step", "step"]
    assert float(rows[0]["comm.exposed_s"]) == 0.3 and int(rows[1]["comm.sent_bytes"]) == 500
    assert float(rows[0]["step_s"]) == 1.0 and float(rows[1]["step_s"]) == 2.0
    assert rows[1]["loss"] == "" and float(rows[1]["metrics.acc"]) == 0.5  # inf -> null -> empty
    assert json.loads(rows[0]["kernels"])[0]["config"] == first["kernels"][0]["config"]
    assert json.loads(rows[0]["comm.collectives"]) == first["comm"]["collectives"]
    assert list(rows[0])[:6] == ["schema", "kind", "run", "rank", "world_size", "time"]
    with (tmp_path / "all.csv").open() as f:
        assert [r["kind"] for r in csv.DictReader(f)] == ["meta", "step", "step", "end"]


def test_parquet_round_trip(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    first, _ = _run_with(tmp_path, ["parquet"])
    table = pq.read_table(tmp_path / "telemetry" / "r" / "rank0.parquet").to_pylist()
    assert [r["step"] for r in table] == [1, 2]
    assert table[0]["comm.exposed_s"] == 0.3 and table[1]["comm.sent_bytes"] == 500
    assert table[0]["loss"] == 2.0 and table[1]["loss"] is None
    assert json.loads(table[0]["kernels"]) == first["kernels"]
    # atomic: no temporary file is left beside it
    assert sorted(p.name for p in (tmp_path / "telemetry" / "r").iterdir()) == ["rank0.parquet"]


def test_tensorboard_round_trip(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run_with(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "telemetry" / "r" / "tensorboard" / "rank0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "step_s", "lr", "comm/exposed_s", "comm/sent_bytes", "metrics/acc"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.0)]  # inf is not a scalar
    assert [(e.step, e.value) for e in acc.Scalars("step_s")] == [(1, 1.0), (2, 2.0)]
    assert [e.value for e in acc.Scalars("comm/sent_bytes")] == [1000, 500]


def test_missing_optional_packages_name_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install pyarrow"):
        ParquetSink(tmp_path / "x.parquet")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install tensorboard"):
        TensorBoardSink(tmp_path / "tb")


def test_jsonl_sink_replaces_an_earlier_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("old\n")
    sink = JsonlSink(path)
    sink.write({"a": 1})
    sink.close()
    assert path.read_text() == '{"a":1}\n'
    with pytest.raises(ValueError, match="closed"):
        sink.write({"a": 2})


# ----------------------------------------------------------------------------- real gloo runs


def _demo_worker(rank: int, world: int, out: str):
    import os

    from cokit.compress import DeMo

    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: fast
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    stats = []
    with Monitor(out, "gloo-demo", optimizer=opt, config={"world": world}, method="DeMo") as mon:
        g = torch.Generator().manual_seed(rank)
        for step in range(1, 4):
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(step, loss=float(loss.detach()))
            stats.append(opt.comm_stats.as_dict())
    return stats


def test_gloo_demo_run_writes_one_file_per_rank_and_rank0_summaries(tmp_path):
    results = run_gloo(2, _demo_worker, str(tmp_path))
    folder = tmp_path / "telemetry" / "gloo-demo"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    by_rank = {}
    for rank in (0, 1):
        records, skipped = read_jsonl(folder / f"rank{rank}.jsonl")
        assert skipped == 0
        for r in records:
            check_record(r)
            assert (r["rank"], r["world_size"], r["run"]) == (rank, 2, "gloo-demo")
        by_rank[rank] = records
        kinds = [r["kind"] for r in records]
        assert kinds[0] == "meta" and kinds[-1] == "end"
        assert kinds.count("step") == 3
        assert kinds.count("summary") == (3 if rank == 0 else 0)
        steps = [r for r in records if r["kind"] == "step"]
        for rec, stats in zip(steps, results[rank], strict=True):
            comm = rec["comm"]
            assert comm["sent_bytes"] == stats["step_sent_bytes"] > 0
            assert comm["received_bytes"] == stats["step_received_bytes"]
            assert comm["dense_bytes"] == stats["step_dense_bytes"]
            assert comm["ratio"] == pytest.approx(stats["ratio"])
            assert (comm["world_size"], comm["group_size"]) == (2, 2)
            for key in ("encode_s", "decode_s", "exposed_s", "comm_s"):
                if f"step_{key}" in stats:  # CommStats with timing
                    assert comm[key] == pytest.approx(stats[f"step_{key}"])
            if isinstance(comm["exposed_s"], float):
                assert 0.0 <= comm["exposed_s"] <= rec["step_s"]
        assert sum(r["comm"]["sent_bytes"] for r in steps) == results[rank][-1]["total_sent_bytes"]
    summaries = [r for r in by_rank[0] if r["kind"] == "summary"]
    steps0 = [r for r in by_rank[0] if r["kind"] == "step"]
    steps1 = [r for r in by_rank[1] if r["kind"] == "step"]
    for s, a, b in zip(summaries, steps0, steps1, strict=True):
        assert s["step"] == a["step"] == b["step"] and s["ranks"] == 2
        assert s["step_s_max"] == max(a["step_s"], b["step_s"])
        assert s["step_s_min"] == min(a["step_s"], b["step_s"])
        assert s["slowest_rank"] == (0 if a["step_s"] >= b["step_s"] else 1)
        exposed = [x["comm"]["exposed_s"] for x in (a, b) if x["comm"]["exposed_s"] is not None]
        assert s["exposed_s_max"] == (max(exposed) if exposed else None)


def _train_worker(rank: int, world: int, out: str):
    from cokit.bench.study.digits import DigitsWorkloadConfig
    from cokit.train import MethodSpec, run_methods

    specs = [MethodSpec("adamw", 1e-3, label="adamw"), MethodSpec("demo", 1e-3, label="demo")]
    factory = DigitsWorkloadConfig(hidden=(16,), batch_size=8)
    results = run_methods(rank, world, specs, factory, 3, 0, 2, "cpu", False, out, ["t-AdamW", "t-DeMo"])
    return [(r.bytes_sent, r.evals) for r in results]


def test_training_runner_writes_telemetry_per_method(tmp_path):
    results = run_gloo(2, _train_worker, str(tmp_path))
    for run, (bytes_sent, evals) in zip(("t-AdamW", "t-DeMo"), results[0], strict=True):
        records = _lines(tmp_path, run, 0)
        assert records[0]["method"] == run.split("-")[1].lower()
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert [r["comm"]["sent_bytes"] for r in steps] == bytes_sent  # what the runner reports
        held_out = {r["step"]: r["held_out_loss"] for r in steps}
        assert held_out[1] is None and held_out[2] == pytest.approx(dict(evals)[2])
        assert all(r["metrics"]["opt_s"] <= r["step_s"] for r in steps)
        assert len([r for r in records if r["kind"] == "summary"]) == 3
        assert len(_lines(tmp_path, run, 1)) == 1 + 3 + 1  # meta, steps, end


# ----------------------------------------------------------------------------- wiring


def test_demo_writes_telemetry_by_default_and_not_with_no_telemetry(tmp_path, monkeypatch):
    import cokit.train
    from cokit.cli import main

    seen = []

    def fake_run(fn, *args, **kw):
        seen.append(args)
        raise KeyboardInterrupt  # stop before training

    monkeypatch.setattr(cokit.train, "run_distributed", fake_run)
    base = ["demo", "--ranks", "2", "--steps", "2", "--model", "toy", "--max-chars", "60000", "--quiet"]
    for extra in ([], ["--no-telemetry"]):
        with pytest.raises(KeyboardInterrupt):
            main([*base, "--out", str(tmp_path / "o"), *extra])
    (*_, tel, runs, _overlap, sinks), (*_, tel_off, _, _, _) = seen
    assert (
        tel == str(tmp_path / "o")
        and runs == ["demo-DeMo", "demo-SparseLoCo", "demo-AdamW"]
        and tel_off is None
        and sinks == ["jsonl"]
    )


def test_validation_study_jobs_carry_telemetry(tmp_path):
    from cokit.bench.study.presets import make_config
    from cokit.validation.grid import make_job

    cfg = make_config("toy", out_dir=str(tmp_path))
    wl = cfg.workloads[0]
    job = make_job(cfg, wl, "adamw", 1e-3, 0)
    assert job.telemetry_dir == str(tmp_path) and job.telemetry_run == f"{wl.name}-adamw-lr0.001-s0"
    off = make_job(make_config("toy", out_dir=str(tmp_path), telemetry=False), wl, "adamw", 1e-3, 0)
    assert off.telemetry_dir is None and off.key == job.key  # telemetry does not change the run


# ----------------------------------------------------------------------------- bad input


def test_unwritable_out_dir_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TelemetryError, match="cannot write telemetry"):
        Monitor(blocker, "r")
    with pytest.raises(TelemetryError, match="cannot write telemetry"):
        Monitor(blocker / "below", "r")


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"run": "../escape"}, ValueError, "run name"),
        ({"run": ""}, ValueError, "run name"),
        ({"sinks": [object()]}, TypeError, "write"),
        ({"sinks": ["excel"]}, ValueError, "unknown sink"),
        ({"gather": True}, ValueError, "process group"),
        ({"rank": 2, "world_size": 2}, ValueError, "outside"),
        ({"config": [1, 2]}, TypeError, "config"),
        ({"optimizer": object()}, TypeError, "comm_stats"),
        ({"clock": 3.0}, TypeError, "clock"),
    ],
)
def test_bad_arguments_are_clear_errors_and_write_nothing(tmp_path, kwargs, error, needle):
    kwargs = {"run": "r", **kwargs}
    with pytest.raises(error, match=needle):
        Monitor(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_bad_steps_and_values_are_clear_errors(tmp_path):
    mon = Monitor(tmp_path, "r")
    mon.step(5, loss=1.0)
    with pytest.raises(ValueError, match="step 5 after step 5"):
        mon.step(5)
    with pytest.raises(ValueError, match="step 3 after step 5"):
        mon.step(3)
    with pytest.raises(TypeError, match="step must be an integer"):
        mon.step(6.0)
    with pytest.raises(TypeError, match="loss must be a number"):
        mon.step(6, loss="low")
    with pytest.raises(TypeError, match="metric 'acc'"):
        mon.step(6, acc=[1.0])
    with pytest.raises(TypeError, match="one-element tensor"):
        mon.step(6, loss=torch.ones(3))
    with pytest.raises(TypeError, match="GemmConfig"):
        mon.add_kernel("gemm", {"BLOCK_M": 64})
    with pytest.raises(TypeError, match="OnlineTuner"):
        mon.attach_tuner(object())
    rec = mon.step(6, loss=float("-inf"), lr=math.nan)  # non-finite values are null, not errors
    assert rec["loss"] is None and rec["lr"] is None
    mon.close()
    with pytest.raises(ValueError, match="closed"):
        mon.step(7)
    steps = [r["step"] for r in _lines(tmp_path) if r["kind"] == "step"]
    assert steps == [5, 6]  # refused steps wrote nothing


def test_metrics_as_a_mapping_and_as_keywords(tmp_path):
    """``metrics={...}`` (what a dict of metrics reads like) and keywords both land in
    ``metrics``; a name given both ways, or metrics that are not a mapping, are refused and
    write nothing."""
    mon = Monitor(tmp_path, "r")
    rec = mon.step(1, loss=1.0, metrics={"grad_norm": 1.5, "tokens": torch.tensor(64)}, acc=0.5)
    assert rec["metrics"] == {"grad_norm": 1.5, "tokens": 64.0, "acc": 0.5}
    with pytest.raises(ValueError, match="'acc' given both in metrics= and as keywords"):
        mon.step(2, metrics={"acc": 0.1}, acc=0.2)
    with pytest.raises(TypeError, match="metrics must be a mapping"):
        mon.step(2, metrics=[("acc", 0.1)])
    with pytest.raises(TypeError, match="metric 'grad_norm'"):
        mon.step(2, metrics={"grad_norm": "big"})
    mon.close()
    steps = [r for r in _lines(tmp_path) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1] and steps[0]["metrics"]["tokens"] == 64.0


def test_check_record_names_the_problem():
    with pytest.raises(ValueError, match="misses step_s"):
        check_record(
            {
                "schema": SCHEMA,
                "kind": "step",
                "run": "r",
                "rank": 0,
                "world_size": 1,
                "time": 0.0,
                **{k: None for k in KIND_FIELDS["step"] if k != "step_s"},
            }
        )
    check_record({"schema": SCHEMA, "kind": "future", "run": "r", "rank": 0, "world_size": 1, "time": 0})
