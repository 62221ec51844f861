"""cokit.overlap.tuner.OnlineTuner on fake configs with known costs."""

import json

import pytest

from cokit.overlap.guard import StarvationGuard
from cokit.overlap.tuner import OnlineTuner
from cokit.triton_kernels.backend import arch_limits
from cokit.triton_kernels.gemm_config import GemmConfig

CONFIGS = [GemmConfig(num_warps=w, num_stages=s) for w, s in ((4, 3), (8, 3), (4, 4), (8, 4))]


def drive(tuner, cost, calls):
    """Run ``calls`` steps where the time of a call is ``cost(config)``; return the choices."""
    chosen = []
    for _ in range(calls):
        c = tuner.choose()
        tuner.record(c, cost(c))
        chosen.append(c)
    return chosen


def test_converges_to_the_cheapest_and_reexplores_on_drift(tmp_path):
    costs = {CONFIGS[0]: 5.0, CONFIGS[1]: 3.0, CONFIGS[2]: 4.0, CONFIGS[3]: 6.0}
    log = tmp_path / "tuner.jsonl"
    tuner = OnlineTuner(CONFIGS, trials=2, drift_threshold=0.2, window=3, cooldown=3, log_path=log)
    explored = drive(tuner, costs.get, 8)  # 4 candidates x 2 trials, round-robin
    assert explored == CONFIGS * 2
    assert tuner.state == "locked" and tuner.locked == CONFIGS[1] and tuner.locked_time == 3.0
    assert drive(tuner, costs.get, 20) == [CONFIGS[1]] * 20  # stays locked while nothing drifts

    # the machine changes: the locked config becomes 2x slower, config 2 is now the best
    costs[CONFIGS[1]] = 6.0
    drive(tuner, costs.get, 1)
    assert tuner.state == "locked"  # one slow call: the median of the window is still 3
    drive(tuner, costs.get, 1)  # two of three slow: the median moved +100% -> drift
    assert tuner.state == "exploring" and tuner.explorations == 2
    drive(tuner, costs.get, 8)
    assert tuner.locked == CONFIGS[2] and tuner.locked_time == 4.0

    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("explore") == 2 and kinds.count("lock") == 2 and kinds.count("drift") == 1
    lock = next(e for e in events if e["event"] == "lock")
    assert lock["candidate"]["num_warps"] == 8 and "lowest median" in lock["reason"]
    drift = next(e for e in events if e["event"] == "drift")
    assert "+100.0%" in drift["reason"] and drift["recent_ms"] == [3.0, 6.0, 6.0]
    assert tuner.log == events


def test_small_noise_does_not_reexplore():
    costs = {c: float(i + 1) for i, c in enumerate(CONFIGS)}
    tuner = OnlineTuner(CONFIGS, trials=1, drift_threshold=0.25, window=4, cooldown=0)
    drive(tuner, costs.get, 4)
    noisy = iter([1.1, 0.9, 1.2, 1.05] * 10)
    drive(tuner, lambda c: next(noisy), 40)
    assert tuner.explorations == 1 and tuner.locked == CONFIGS[0]


def test_guard_rejects_up_front_and_on_measured_slowdown():
    limits = arch_limits("sm_90")
    carve = GemmConfig(persistent=True, num_sms=66)  # leaves 66 of 132 SMs: above a 25% guard
    fat = GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_stages=2, smem_bytes=200_000)  # >> 4x its need
    ok_a, ok_b = GemmConfig(num_warps=4), GemmConfig(num_warps=8)
    guard = StarvationGuard(max_reserved_fraction=0.25, max_footprint_inflation=4.0, max_compute_slowdown=0.5)
    import torch

    tuner = OnlineTuner(
        [carve, fat, ok_a, ok_b],
        guard=guard,
        guard_kwargs={"limits": limits, "dtype": torch.bfloat16},
        trials=1,
    )
    rejected = [e for e in tuner.log if e["event"] == "reject"]
    assert (
        len(rejected) == 2
        and "66 of 132" in rejected[0]["reason"]
        and "max_footprint_inflation" in rejected[1]["reason"]
    )
    assert tuner.candidates == [ok_a, ok_b]
    # ok_a slows compute down by 80% under overlap: dropped, re-explore with ok_b only
    tuner.record(tuner.choose(), 1.0, compute_slowdown=0.8)
    assert tuner.candidates == [ok_b] and tuner.log[-1]["event"] == "explore"
    tuner.record(tuner.choose(), 2.0, compute_slowdown=0.1)
    assert tuner.locked == ok_b
    with pytest.raises(ValueError, match="rejects every candidate"):
        OnlineTuner([carve], guard=guard, guard_kwargs={"limits": limits})


def test_step_times_with_the_clock():
    costs = {CONFIGS[0]: 3, CONFIGS[1]: 1}
    now = [0.0]

    def clock():
        return now[0]

    def fn(c):
        now[0] += costs[c]
        return c.num_warps

    tuner = OnlineTuner(CONFIGS[:2], trials=2, clock=clock)
    outs = [tuner.step(fn) for _ in range(5)]
    assert outs[:4] == [4, 8, 4, 8] and tuner.locked == CONFIGS[1] and outs[4] == 8


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"candidates": []}, "non-empty"),
        ({"trials": 0}, "trials"),
        ({"drift_threshold": 0}, "drift_threshold"),
        ({"window": 0}, "window"),
        ({"cooldown": -1}, "cooldown"),
    ],
)
def test_bad_arguments(kw, match):
    args = {"candidates": CONFIGS, **kw}
    with pytest.raises(ValueError, match=match):
        OnlineTuner(**args)


def test_record_checks_input():
    tuner = OnlineTuner(CONFIGS, trials=1)
    with pytest.raises(ValueError, match="elapsed_ms"):
        tuner.record(tuner.choose(), float("nan"))
    with pytest.raises(ValueError, match="different candidate"):
        tuner.record(CONFIGS[3], 1.0)
