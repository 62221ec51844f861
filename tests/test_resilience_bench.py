"""The resilience benchmark's bookkeeping (time to target, ratios, verdict) and one real run."""

from __future__ import annotations

import json

import pytest

from cokit.bench import resilience


def _record(
    profile: str, method: str, seed: int, evals: list[tuple[int, float]], step_s: float, exposed: float = 0.0
) -> dict:
    steps = evals[-1][0]
    return {
        "profile": profile,
        "method": method,
        "seed": seed,
        "evals": [{"step": s, "heldout_loss": v} for s, v in evals],
        "series": {"wall_s": [step_s * (i + 1) for i in range(steps)]},
        "summary": {
            "final_heldout_loss": evals[-1][1],
            "total_time_s": step_s * steps,
            "steps": steps,
            "bytes_per_step": 100.0,
        },
        "policy_log": [],
        "skipped_syncs": 0,
        "exposed_s": exposed * step_s * steps,
    }


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    rec = _record("p", "demo-static", 0, [(0, 5.0), (10, 3.0), (20, 2.5), (30, 2.6)], step_s=0.5)
    assert resilience.time_to_target(rec, 2.6) == 10.0  # step 20 at 0.5 s per step
    assert resilience.time_to_target(rec, 2.0) is None
    assert resilience.time_to_target(rec, 9.0) == 5.0  # step 0 (the initial model) never counts


def test_ratios_are_per_seed_against_each_methods_own_static_baseline():
    runs = []
    for seed, fast in ((0, 0.2), (1, 0.3)):
        runs.append(_record("10mbit-drops", "demo-static", seed, [(0, 5.0), (10, 3.0), (20, 2.0)], 1.0, 0.4))
        runs.append(
            _record("10mbit-drops", "demo-adaptive", seed, [(0, 5.0), (10, 2.0), (20, 1.9)], fast * 2)
        )
        runs.append(_record("10mbit-drops", "adamw", seed, [(0, 5.0), (10, 4.0)], 3.0))
        # SparseLoCo's target is its own static run's final loss (3.0), not DeMo's (2.0)
        runs.append(_record("10mbit-drops", "sparseloco-static", seed, [(0, 5.0), (10, 3.5), (20, 3.0)], 1.0))
        runs.append(
            _record("10mbit-drops", "sparseloco-interval", seed, [(0, 5.0), (10, 3.0), (20, 2.9)], 1.0)
        )
    rows = {r["method"]: r for r in resilience.summarize(runs)}
    # static reaches its own final loss (2.0) at step 20 = 20 s; adaptive at step 10 = 4 s / 6 s
    assert rows["demo-static"]["ratio_median"] == 1.0
    assert rows["demo-static"]["exposed_share"] == pytest.approx(0.4)
    assert rows["demo-adaptive"]["ratio_min"] == pytest.approx(0.2)
    assert rows["demo-adaptive"]["ratio_max"] == pytest.approx(0.3)
    assert rows["adamw"]["reached"] == 0 and rows["adamw"]["ratio_median"] is None
    assert rows["sparseloco-interval"]["baseline"] == "sparseloco-static"
    assert rows["sparseloco-interval"]["ratio_median"] == pytest.approx(0.5)  # step 10 of static's 20
    table = resilience.markdown_table(list(rows.values()))
    assert "| 10mbit-drops | demo-adaptive | 2/2 |" in table and "| 40% |" in table


def test_the_verdicts_judge_every_adaptive_method_on_every_profile_with_the_bound():
    runs = []
    for profile in ("loopback", "10mbit-drops"):
        fine = [(i, 5.0 - 0.15 * i) for i in range(21)]  # one evaluation per step: ties resolved to 5%
        runs.append(_record(profile, "demo-static", 0, fine, 1.0, 0.5))
        runs.append(_record(profile, "demo-adaptive", 0, fine, 0.9))
        runs.append(_record(profile, "sparseloco-static", 0, [(0, 5.0), (10, 3.0)], 1.0, 0.1))
        runs.append(_record(profile, "sparseloco-interval", 0, [(0, 5.0), (10, 3.5)], 1.0))
    lines = resilience.verdicts(resilience.summarize(runs))
    assert len(lines) == 4
    # 0.9x meets "no later than static" on loopback and misses the 0.7x of a lossy profile
    assert lines[0].startswith("loopback: demo-adaptive vs demo-static, target <= 1x: met, median 0.90x")
    assert "bound 0.50x (static exposed 50%)" in lines[0]
    assert lines[2].startswith("10mbit-drops: demo-adaptive vs demo-static, target <= 0.7x: MISSED by 0.20x")
    assert lines[3] == (
        "10mbit-drops: sparseloco-interval vs sparseloco-static, target <= 0.7x: MISSED, reached the "
        "target loss in 0/1 runs; bound 0.90x (static exposed 10%)"
    )


def test_the_target_is_static_loss_at_the_budget_and_the_overrun_measures_a_slower_method():
    static = _record("latency-50ms-sim", "demo-static", 0, [(0, 5.0), (10, 3.0), (20, 2.0), (25, 1.9)], 1.0)
    static["budget_s"] = 20.0  # the run went on for 25% past its budget
    slower = _record(
        "latency-50ms-sim", "demo-adaptive", 0, [(0, 5.0), (10, 3.0), (20, 2.0), (24, 1.95)], 1.1
    )
    slower["budget_s"] = 20.0
    assert resilience.static_target(static) == 2.0  # at its last evaluation within the budget
    rows = {r["method"]: r for r in resilience.summarize([static, slower])}
    assert rows["demo-adaptive"]["ratio_median"] == pytest.approx(1.1)  # 22 s against 20 s
    assert rows["demo-static"]["ratio_median"] == 1.0


def test_a_tie_within_one_evaluation_interval_is_reported_as_such():
    runs = [
        _record("100mbit", "demo-static", 0, [(0, 5.0), (10, 3.0), (20, 2.0)], 1.0),
        _record("100mbit", "demo-adaptive", 0, [(0, 5.0), (10, 3.0), (20, 2.0)], 1.04),
    ]
    rows = resilience.summarize(runs)
    assert rows[1]["ratio_median"] == pytest.approx(1.04) and rows[1]["resolution"] == pytest.approx(0.5)
    (line,) = resilience.verdicts(rows)
    assert "met within one evaluation interval (0.50x), median 1.04x" in line
    late = [dict(r, resolution=0.01) for r in rows]
    assert "MISSED by 0.04x" in resilience.verdicts(late)[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_loopback_run_writes_its_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "res"
    code = resilience.main(
        [
            "--profiles",
            "loopback",
            "--methods",
            "demo-adaptive,sparseloco-interval",  # their static baselines run first, unasked
            "--seeds",
            "0",
            "--budget-s",
            "2",
            "--model",
            "toy",
            "--max-chars",
            "20000",
            "--eval-every",
            "5",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "resilience.json").read_text())
    assert [r["method"] for r in report["runs"]] == [
        "demo-static",
        "sparseloco-static",
        "demo-adaptive",
        "sparseloco-interval",
    ]
    assert all(r["summary"]["steps"] >= 5 and r["exposed_s"] >= 0 for r in report["runs"])
    assert all(r["budget_s"] == 2 and r["summary"]["total_time_s"] > 2 for r in report["runs"])
    adaptive = next(r for r in report["runs"] if r["method"] == "demo-adaptive")
    assert adaptive["policy_log"][0]["decision"] == "k x1"
    interval = next(r for r in report["runs"] if r["method"] == "sparseloco-interval")
    assert interval["policy_log"][0]["sync_scale"] == 1
    assert len(report["verdicts"]) == 2
    assert (out / "resilience.png").stat().st_size > 0
    assert "| loopback | demo-static |" in capsys.readouterr().out
    # a second run into the same folder is refused before anything runs
    with pytest.raises(SystemExit, match="already holds results"):
        resilience.main(["--profiles", "loopback", "--out", str(out)])
