"""The resilience benchmark's bookkeeping (time to target, ratios, verdict) and one real run."""

from __future__ import annotations

import json

import pytest

from cokit.bench import resilience


def _record(profile: str, method: str, seed: int, evals: list[tuple[int, float]], step_s: float) -> dict:
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
    }


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    rec = _record("p", "demo-static", 0, [(0, 5.0), (10, 3.0), (20, 2.5), (30, 2.6)], step_s=0.5)
    assert resilience.time_to_target(rec, 2.6) == 10.0  # step 20 at 0.5 s per step
    assert resilience.time_to_target(rec, 2.0) is None
    assert resilience.time_to_target(rec, 9.0) == 5.0  # step 0 (the initial model) never counts


def test_ratios_are_per_seed_against_static_and_the_verdict_says_by_how_much():
    runs = []
    for seed, fast in ((0, 0.2), (1, 0.3)):
        runs.append(_record("10mbit-drops", "demo-static", seed, [(0, 5.0), (10, 3.0), (20, 2.0)], 1.0))
        runs.append(
            _record("10mbit-drops", "demo-adaptive", seed, [(0, 5.0), (10, 2.0), (20, 1.9)], fast * 2)
        )
        runs.append(_record("10mbit-drops", "adamw", seed, [(0, 5.0), (10, 4.0)], 3.0))
    rows = {r["method"]: r for r in resilience.summarize(runs)}
    # static reaches its own final loss (2.0) at step 20 = 20 s; adaptive at step 10 = 4 s / 6 s
    assert rows["demo-static"]["ratio_median"] == 1.0
    assert rows["demo-adaptive"]["ratio_min"] == pytest.approx(0.2)
    assert rows["demo-adaptive"]["ratio_max"] == pytest.approx(0.3)
    assert rows["adamw"]["reached"] == 0 and rows["adamw"]["ratio_median"] is None
    assert resilience.verdict(list(rows.values())).startswith("target (0.7x")
    assert "met" in resilience.verdict(list(rows.values()))
    slow = [dict(r, ratio_median=0.9, ratio_min=0.8, ratio_max=1.0) for r in rows.values()]
    assert "MISSED by 0.20x" in resilience.verdict(slow)
    table = resilience.markdown_table(list(rows.values()))
    assert "| 10mbit-drops | demo-adaptive | 2/2 |" in table


@pytest.mark.distributed
@pytest.mark.slow
def test_a_loopback_run_writes_its_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "res"
    code = resilience.main(
        [
            "--profiles",
            "loopback",
            "--methods",
            "demo-static,demo-adaptive",
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
    assert {r["method"] for r in report["runs"]} == {"demo-static", "demo-adaptive"}
    assert all(r["summary"]["steps"] >= 5 for r in report["runs"])
    adaptive = next(r for r in report["runs"] if r["method"] == "demo-adaptive")
    assert adaptive["policy_log"][0]["decision"] == "k x1"
    assert (out / "resilience.png").stat().st_size > 0
    assert "| loopback | demo-static |" in capsys.readouterr().out
    # a second run into the same folder is refused before anything runs
    with pytest.raises(SystemExit, match="already holds results"):
        resilience.main(["--profiles", "loopback", "--out", str(out)])
