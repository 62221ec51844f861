"""The time-to-target benchmark (cokit.bench.time_to_target): its bookkeeping on made-up runs and
one short real run on loopback and the simulated 50 ms latency."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cokit.bench import time_to_target as ttt


def _record(evals: list[tuple[int, float]], step_s: list[float], bytes_per_step: float = 10.0) -> dict:
    return {
        "evals": [{"step": s, "heldout_loss": v} for s, v in evals],
        "series": {"step_s": step_s},
        "summary": {"final_heldout_loss": evals[-1][1], "bytes_per_step": bytes_per_step},
    }


def test_steps_to_target_is_the_first_evaluation_after_step_0_at_or_below_it() -> None:
    rec = _record([(0, 1.0), (5, 3.0), (10, 2.0), (15, 2.5)], [0.1] * 15)
    assert ttt.steps_to_target(rec, 2.0) == 10
    assert ttt.steps_to_target(rec, 1.5) is None  # step 0 never counts


def test_seconds_per_step_is_the_mean_over_whole_periods_after_the_window() -> None:
    period = [0.1, 0.1, 0.1, 0.1, 0.6]  # the sync step of each period is slower
    rec = _record([(0, 4.0)], [9.0, 9.0] + period * 3 + [0.1, 0.1])
    assert ttt.seconds_per_step(rec, 2) == pytest.approx(0.2)  # the 2 steps of a cut period left out
    with pytest.raises(ValueError, match="no whole period"):
        ttt.seconds_per_step(_record([(0, 4.0)], [0.1] * 6), 3)
    assert ttt.measured_time(rec, 4) == pytest.approx(18.2)
    assert ttt.measured_time(rec, 30) is None and ttt.measured_time(rec, None) is None


def test_a_link_run_must_compute_what_loopback_computed() -> None:
    loop = _record([(0, 4.0), (5, 3.0), (10, 2.0)], [0.1] * 10)
    assert ttt.same_numbers(loop, _record([(0, 4.0), (5, 3.0)], [0.5] * 5))
    assert not ttt.same_numbers(loop, _record([(0, 4.0), (5, 3.1)], [0.5] * 5))


def test_summary_times_each_method_against_the_faster_dense_method_on_each_link() -> None:
    steps = [0.1] * 20
    loop = {
        "adamw": {0: _record([(0, 4.0), (10, 2.5), (20, 2.0)], steps)},
        "muon": {0: _record([(0, 4.0), (10, 2.0), (20, 1.5)], steps)},  # the best dense: target 1.5
        "sparseloco-muon": {0: _record([(0, 4.0), (10, 1.8), (20, 1.5)], steps)},
    }
    slow = {"adamw": [1.0] * 20, "muon": [1.0] * 20, "sparseloco-muon": [0.2] * 20}
    links = {
        "10mbit": {m: {"record": _record([(0, 4.0)], s), "same_numbers": True} for m, s in slow.items()},
    }
    report = {
        "target": 1.5,
        "loopback": loop,
        "links": links,
        "predicted": {"10mbit": {"adamw": 0.9, "muon": 0.9, "sparseloco-muon": 0.1}},
        "settings": {"window": 0, "seeds": [0]},
    }
    rows = {r["method"]: r for r in ttt.summarize(report)}
    assert rows["adamw"]["steps_to_target"] is None and rows["adamw"]["seeds_reached"] == "0/1"
    assert rows["muon"]["extrapolated_s"] == pytest.approx(20.0)
    assert rows["muon"]["measured_s"] == pytest.approx(20.0) and rows["muon"]["predicted_s"] == pytest.approx(
        18.0
    )
    assert rows["sparseloco-muon"]["extrapolated_s"] == pytest.approx(4.0)
    assert rows["sparseloco-muon"]["speedup_vs_best_dense"] == pytest.approx(5.0)
    assert "| 10mbit | sparseloco-muon | 20 | 1/1 | 0.200 | 4.0 | 4.0 | 2.0 | 5.00x |" in ttt.markdown(
        list(rows.values())
    )


@pytest.mark.parametrize(
    "argv, message",
    [(["--steps", "5"], "--steps must be >= 10"), (["--budget-s", "0"], "--budget-s and --timeout")],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        ttt.main(argv)
    assert message in capsys.readouterr().err


def test_the_planner_predicts_every_method_on_every_profile() -> None:
    args = argparse.Namespace(model="toy", batch_size=4)
    compute = {m: 5.0 for m in ttt.METHODS}
    fast, slow = ttt.predicted_step_s(args, "100mbit", compute), ttt.predicted_step_s(args, "10mbit", compute)
    assert set(fast) == set(ttt.METHODS)
    assert slow["adamw"] > fast["adamw"] > 0.005 and slow["sparseloco-muon"] < slow["adamw"]
    latency = ttt.predicted_step_s(args, "latency-50ms-sim", compute)
    assert latency["adamw"] >= 0.05 + 0.005


@pytest.mark.slow
@pytest.mark.distributed
def test_a_short_real_run(tmp_path: Path) -> None:
    out = tmp_path / "ttt"
    argv = ["--methods", "adamw", "sparseloco-adamw", "--seeds", "0", "--steps", "10", "--window", "0"]
    argv += ["--eval-every", "5", "--profiles", "latency-50ms-sim", "--budget-s", "60", "--model", "toy"]
    assert ttt.main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "time_to_target.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"adamw", "sparseloco-adamw"} and report["best_dense"] == "adamw"
    assert all(r["same_numbers_as_loopback"] for r in rows.values())  # the link changes time only
    # every collective waits 50 ± 20 ms: a dense step at least 30 ms, a SparseLoCo one every 5 steps
    assert rows["adamw"]["seconds_per_step"] >= 0.03
    assert rows["sparseloco-adamw"]["seconds_per_step"] < rows["adamw"]["seconds_per_step"]
    assert rows["adamw"]["steps_to_target"] == 10  # its own final loss is the target
    assert (out / "time_to_target.csv").read_text().startswith("profile,method,steps_to_target")
