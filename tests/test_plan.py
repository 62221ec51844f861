"""``cokit plan``: the bytes it plans are the bytes the optimizers send (real gloo groups, world
2 and 3), its step/epoch/cost arithmetic, its errors, the CLI's files, and the validation
benchmark's run on a shaped link (its table; the 20% target is the benchmark's, not a test's)."""

from __future__ import annotations

import json
import math
import re
import textwrap

import pytest
import torch
from distributed import run_gloo
from helpers import SmallNet, regression_data

from cokit.cli import main as cli
from cokit.compress import DeMo, SparseLoCo
from cokit.compress.stats import ring_allreduce_bytes
from cokit.model_shapes import Model, counted_model, parse_count
from cokit.plan import GPUS, LIMITS, Link, Methods, PlanInputError, Workload, parse_rate, plan

SHAPES = tuple(tuple(p.shape) for p in SmallNet().parameters())
MODEL = Model("small", "SmallNet", SHAPES)


def _steady_bytes(rank: int, world: int, which: str, period: int) -> float:
    """Bytes this rank's optimizer counted per step over steps 2*period .. 4*period."""
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    if which == "demo":
        opt = DeMo(model.parameters(), lr=1e-2, timeout=120)
    else:
        opt = SparseLoCo(
            model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_every=period, timeout=120
        )
    marks = {}
    for step in range(4 * period):
        if step == 2 * period:
            marks["start"] = opt.comm_stats.total_sent_bytes
        torch.nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        opt.step()
        opt.zero_grad()
    return (opt.comm_stats.total_sent_bytes - marks["start"]) / (2 * period)


def _both(rank: int, world: int) -> dict[str, float]:
    return {"demo": _steady_bytes(rank, world, "demo", 3), "sparseloco": _steady_bytes(rank, world, "sl", 3)}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_planned_bytes_are_what_demo_and_sparseloco_send(world):
    measured = run_gloo(world, _both)
    p = plan(MODEL, world, Workload(8, 1000, compute_ms=10.0), Link(1e9), methods=Methods(sync_every=3))
    for method in ("demo", "sparseloco"):
        for rank_bytes in measured:
            assert rank_bytes[method] == pytest.approx(p.row(method)["sent_bytes"], rel=0, abs=1e-9)
    # DDP's ring all-reduce of the fp32 gradients
    n = sum(math.prod(s) for s in SHAPES)
    assert p.row("adamw-ddp")["sent_bytes"] == ring_allreduce_bytes(4 * n, world)


def test_step_epoch_and_cost_follow_from_the_link_and_the_compute():
    link = Link(8e6, latency_s=0.001, efficiency=1.0)  # 1 MB/s
    p = plan(
        MODEL,
        2,
        Workload(samples_per_step=10, dataset_samples=1001, compute_ms=50.0),
        link,
        price_per_hour=3.6,
        methods=Methods(sync_every=4),
    )
    ddp = p.row("adamw-ddp")
    comm = 2 * 0.001 + ddp["sent_bytes"] / 1e6  # one bucket: 2 (W-1) hops, then the bytes
    assert ddp["comm_ms"] == pytest.approx(comm * 1e3)
    assert ddp["exposed_share"] == 1.0  # one bucket: it waits for backward's end
    assert ddp["step_ms"] == pytest.approx(50.0 + comm * 1e3)
    assert ddp["steps_per_epoch"] == 51  # ceil(1001 / (10 * 2))
    assert ddp["epoch_s"] == pytest.approx(51 * ddp["step_ms"] / 1e3)
    assert ddp["cost_per_epoch"] == pytest.approx(ddp["epoch_s"] / 3600 * 2 * 3.6)
    demo, sl = p.row("demo"), p.row("sparseloco")
    assert sl["sent_bytes"] * 4 == pytest.approx(
        plan(MODEL, 2, Workload(10, 1001, compute_ms=50.0), link, methods=Methods(sync_every=1)).row(
            "sparseloco"
        )["sent_bytes"]
    )  # one sync's bytes, spread over the period
    assert demo["sent_bytes"] < ddp["sent_bytes"] and demo["speedup_vs_adamw_ddp"] > 1
    assert [r["method"] for r in p.rows] == ["adamw-ddp", "demo", "sparseloco"]  # one node: no two-level


def test_a_shapers_burst_passes_at_once_when_the_link_idled_long_enough():
    link = Link(8e6, efficiency=1.0, burst_bytes=100_000)  # 1 MB/s
    assert link.seconds(150_000, 0, idle_s=1.0) == pytest.approx(0.05)  # 100 kB free, 50 kB at rate
    assert link.seconds(150_000, 0, idle_s=0.02) == pytest.approx(0.13)  # only 20 kB refilled
    assert link.seconds(50_000, 0, idle_s=1.0) == 0.0


def test_ddp_hides_all_but_its_last_bucket_behind_backward_and_two_level_needs_nodes():
    model = counted_model(parse_count("100M"))  # 400 MB of fp32 gradients: 16 buckets
    work = Workload(8, 10**6, compute_ms=300.0)
    p = plan(model, 16, work, Link(parse_rate("100gbit")), ranks_per_node=8, intra=Link(3.6e12, 0, 1.0))
    ddp = p.row("adamw-ddp")
    hidden = ddp["comm_ms"] - ddp["exposed_ms"]
    assert 0 < hidden <= 2 / 3 * 300.0 + 1e-9
    assert ddp["comm_ms"] * (1 - 25 * 2**20 / 4e8) >= hidden - 1e-9
    two = p.row("two-level")
    assert two["sent_bytes"] > p.row("demo")["sent_bytes"]  # the intra-node dense part is counted
    assert two["step_ms"] < p.row("demo")["step_ms"]  # but it crosses the slow link far less
    given = plan(model, 16, work, Link(1e11), ranks_per_node=8, exposed={"adamw-ddp": 0.5})
    assert given.row("adamw-ddp")["exposed_ms"] == pytest.approx(0.5 * given.row("adamw-ddp")["comm_ms"])


def test_compute_from_flops_uses_6n_per_token_at_the_mfu_of_the_gpus_peak():
    n = 10**9
    p = plan(counted_model(n), 8, Workload(4, 10**5, tokens_per_step=4096, gpu="h100", mfu=0.5), Link(1e11))
    gpu = GPUS["h100"]
    expect = 6 * n * 4096 / (gpu.bf16_tflops * 1e12 * 0.5) + 28 * n / (gpu.hbm_gbs * 1e9)
    assert p.row("adamw-ddp")["compute_ms"] == pytest.approx(expect * 1e3)
    assert p.row("adamw-ddp")["compute_from"] == "FLOPs estimate"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan(MODEL, 1, Workload(1, 1, compute_ms=1.0), Link(1e9)), "world must be"),
        (lambda: plan(MODEL, 6, Workload(1, 1, compute_ms=1.0), Link(1e9), ranks_per_node=4), "multiple"),
        (lambda: plan(MODEL, 2, Workload(1, 1, compute_ms=1.0), Link(1e9), which=["sgd"]), "methods must"),
        (lambda: plan(MODEL, 2, Workload(1, 1, compute_ms=1.0), Link(1e9), price_per_hour=-1), "price"),
        (lambda: plan(MODEL, 2, Workload(1, 1, compute_ms=1.0), Link(1e9), exposed={"demo": 2}), "exposed"),
        (lambda: Workload(1, 1), "give compute_ms"),
        (lambda: Workload(0, 1, compute_ms=1.0), "samples_per_step"),
        (lambda: Workload(1, 1, compute_ms={"sgd": 1.0}), "unknown method"),
        (lambda: Workload(1, 1, compute_ms=float("nan")), "finite"),
        (lambda: Workload(1, 1, tokens_per_step=8, gpu="tpu"), "unknown gpu"),
        (lambda: Link(0), "bits_per_s"),
        (lambda: Link(1e9, efficiency=1.5), "efficiency"),
        (lambda: Link(1e9, burst_bytes=-1), "burst_bytes"),
        (lambda: parse_rate("fast"), "not a positive rate"),
        (lambda: parse_count("7X"), "not a number"),
        (lambda: counted_model(0), "params must be an integer from 1 to"),
    ],
)
def test_bad_input_is_refused_with_what_to_give(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _api_call(name: str, value):
    """Build what takes input ``name`` with ``value`` (everything else valid)."""
    work = {"compute_ms": 10.0}
    if name in ("samples_per_step", "dataset_samples", "mfu", "tokens_per_step", "compute_ms"):
        kw = {"samples_per_step": 1, "dataset_samples": 1, **work, name: value}
        if name == "tokens_per_step":
            kw.update(compute_ms=None, gpu="h100")
        return lambda: Workload(**kw)
    if name in ("bits_per_s", "latency_s", "efficiency", "burst_bytes"):
        return lambda: Link(**{"bits_per_s": 1e9, name: value})
    if name in ("world", "ranks_per_node", "price_per_hour"):
        kw = {"world": 2048 if name == "ranks_per_node" else 2, name: value}
        return lambda: plan(MODEL, kw.pop("world"), Workload(1, 1, compute_ms=1.0), Link(1e9), **kw)
    if name == "exposed":
        return lambda: plan(MODEL, 2, Workload(1, 1, compute_ms=1.0), Link(1e9), exposed={"demo": value})
    if name == "params":
        return lambda: counted_model(value)
    if name.endswith("_chunk"):  # a chunk of 1 holds one coefficient: top-k 1
        return lambda: Methods(**{name: value, name.replace("chunk", "topk"): 1})
    return lambda: Methods(**{name: value})


def _outside(name: str) -> list:
    limit = LIMITS[name]
    high = 64**2 if name.endswith("topk") else limit.high
    bad = [float("nan"), "1", True]
    if limit.choices:
        return [*bad, 3, 16, 0]
    below = limit.low if limit.low_open else limit.low - (1 if limit.integer else 1e-9 * max(1, limit.low))
    above = int(high) + 1 if limit.integer else high * 1.000001
    bad += [below, above, -(10**400), 10**400]
    if limit.integer:
        bad.append(limit.low + 0.5)
    else:
        bad += [float("inf"), -float("inf")]
    return bad


@pytest.mark.parametrize("name", sorted(set(LIMITS) - {"tokens_per_sample"}))  # that one: the CLI's own
def test_every_plan_input_is_range_checked_with_its_range_and_what_to_give(name):
    """Each input of LIMITS, just outside its range, at +-10**400, NaN, inf, a bool or text, is
    refused with a PlanInputError naming it, the range and advice; its bounds are accepted."""
    for value in _outside(name):
        with pytest.raises(PlanInputError) as caught:
            _api_call(name, value)()
        message = str(caught.value)
        assert f"{name}" in message and " must be " in message and "; give " in message, message
        assert caught.value.name == name
    limit = LIMITS[name]
    for ok in ([*limit.choices] or [limit.high if not name.endswith("topk") else 64**2]) + (
        [] if limit.low_open or limit.choices else [limit.low]
    ):
        _api_call(name, int(ok) if limit.integer else ok)()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--params", "1e30"], "--params must be an integer from 1 to 10,000,000,000,000, got 1e+30"),
        (["--params", "7B", "--tokens-per-sample", "-1"], "--tokens-per-sample must be an integer from 1 to"),
        (
            ["--params", "7B", "--tokens-per-sample", "1000000000", "--batch", "10000000"],
            "--tokens-per-sample x --batch",
        ),
        (
            ["--params", "7B", "--latency-ms", "-5"],
            "--latency-ms must be a finite number from 0 to 10,000, got -5",
        ),
        (["--params", "7B", "--latency-ms", "nan"], "--latency-ms must be a finite number"),
        (["--params", "7B", "--bandwidth", "0.5bit"], "--bandwidth must be a rate from 1kbit to 1000tbit"),
        (["--params", "7B", "--intra-bandwidth", "1e20gbit"], "--intra-bandwidth must be a rate from 1kbit"),
        (
            ["--params", "7B", "--efficiency", "0"],
            "--efficiency must be a finite number above 0 and at most 1",
        ),
        (["--params", "7B", "--burst-bytes", "-1"], "--burst-bytes must be an integer from 0"),
        (["--params", "7B", "--world", "1"], "--world must be an integer from 2 to 1,048,576, got 1"),
        (
            ["--params", "7B", "--world", "1" + "0" * 400],
            "--world must be an integer from 2 to 1,048,576, got about 10**400",
        ),
        (["--params", "7B", "--world", "4096", "--ranks-per-node", "4096"], "--ranks-per-node must be"),
        (["--params", "7B", "--batch", "0"], "--batch must be an integer from 1 to"),
        (["--params", "7B", "--dataset-size", str(10**16)], "--dataset-size must be an integer from 1 to"),
        (["--params", "7B", "--mfu", "1.5"], "--mfu must be"),
        (["--params", "7B", "--compute-ms", "-1"], "--compute-ms must be a finite number from 0"),
        (["--params", "7B", "--compute-ms", "demo=inf"], "--compute-ms (demo) must be"),
        (["--params", "7B", "--exposed", "demo=2"], "--exposed (demo) must be a finite number from 0 to 1"),
        (["--params", "7B", "--price-per-hour", "-1"], "--price-per-hour must be"),
        (["--params", "7B", "--demo-topk", "5000"], "--demo-topk must be an integer from 1 to 4,096"),
        (["--params", "7B", "--sparseloco-topk", "0"], "--sparseloco-topk must be"),
        (["--params", "7B", "--sync-every", "0"], "--sync-every must be an integer from 1 to"),
        (["--model", "gpt2-124m", "--sync-every", "10000000"], "--sync-every must be"),
    ],
)
def test_the_cli_range_checks_every_number_with_its_option_and_range(extra, message, capsys):
    """--params 1e30 ended in OverflowError and --tokens-per-sample -1 planned from negative
    FLOPs; every number is checked against the same LIMITS as the API, before planning."""
    base = ["plan", "--world", "16", "--bandwidth", "25gbit", "--gpu", "h100", "--tokens-per-sample"]
    base += ["1024", "--batch", "8", "--dataset-size", "1000000"]
    assert cli([*base, *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and "; give " in err and len(err.splitlines()) == 1, err
    assert captured.out == ""


def test_docs_plan_lists_every_input_range():
    """docs/plan.md's range table says what LIMITS enforces, input by input."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text()
    rows = {m.group(1): m.group(3) for m in re.finditer(r"^\| `(\w+)` \| (.*?) \| (.*) \|$", text, re.M)}
    assert set(rows) == set(LIMITS)
    for name, limit in LIMITS.items():
        assert rows[name].startswith(limit.describe()), (name, rows[name])


def test_rates_and_counts_parse_in_decimal_units():
    assert parse_rate("10mbit") == 1e7 and parse_rate("2.5gbit") == 2.5e9
    assert parse_count("124M") == 124_000_000 and parse_count("7b") == 7 * 10**9
    assert parse_count("1.8T") == 1_800_000_000_000
    m = counted_model(2 * 4096 * 4096 + 5 * 4096 + 7)
    assert (
        m.shapes == ((4096, 4096), (4096, 4096), (5, 4096), (7,)) and m.params == 2 * 4096**2 + 5 * 4096 + 7
    )


def test_the_cli_plans_a_factory_model_and_writes_json_csv_and_markdown(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_factory.py").write_text(
        textwrap.dedent(
            """
            import torch

            def make():
                return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10)), None, None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan"
    args = ["plan", "--model", "my_factory:make", "--world", "4", "--bandwidth", "1gbit", "--batch", "8"]
    args += ["--dataset-size", "6400", "--compute-ms", "adamw-ddp=20,demo=25,sparseloco=21"]
    assert cli([*args, "--price-per-hour", "2", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "| adamw-ddp |" in shown and "cost/epoch" in shown
    report = json.loads((out / "plan.json").read_text())
    assert report["inputs"]["model"]["params"] == 300 * 200 + 200 + 200 * 10 + 10
    assert [r["method"] for r in report["rows"]] == ["adamw-ddp", "demo", "sparseloco"]
    assert report["rows"][1]["compute_ms"] == 25.0 and report["rows"][0]["steps_per_epoch"] == 200
    csv_lines = (out / "plan.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,sent_bytes,") and len(csv_lines) == 4
    assert (out / "plan.md").read_text().startswith("| method |")
    assert cli([*args, "--out", str(out)]) == 2  # the files exist: --overwrite replaces them
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "nowhere_module:make"], "cannot import"),
        (["--model", "gpt-7"], "unknown model"),
        (["--params", "1M", "--compute-ms", "demo:3"], "method=number"),
        (["--params", "1M"], "give compute_ms"),
        (["--params", "1M", "--compute-ms", "5", "--sync-every", "0"], "--sync-every"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(extra, message, capsys):
    base = ["plan", "--world", "2", "--bandwidth", "1gbit", "--batch", "1", "--dataset-size", "10"]
    assert cli([*base, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.distributed
def test_the_validation_benchmark_runs_on_a_shaped_link(tmp_path, capsys):
    from cokit.bench.netbed import available

    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces are not available here: {why}")
    from cokit.bench import plan_validation

    argv = ["--profiles", "10mbit", "--model", "toy", "--batch", "4", "--seq-len", "16"]
    argv += ["--sync-every", "2", "--warmup", "2", "--steps", "2", "--out", str(tmp_path)]
    assert plan_validation.main(argv) == 0
    report = json.loads((tmp_path / "plan_validation.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"adamw-ddp", "demo", "sparseloco"}
    assert rows["demo"]["measured_sent_bytes"] == rows["demo"]["sent_bytes"]  # the planned bytes are sent
    for r in rows.values():
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["wire_bytes"] > 0
    assert "| 10mbit | demo |" in (tmp_path / "plan_validation.md").read_text()
