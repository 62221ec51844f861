"""cokit.overlap.metrics formulas and cokit.overlap.measure on a virtual clock (known times -> exact metrics)."""

import math

import pytest
import torch

from cokit.overlap.measure import NULL_PROBE, OverlapResult, measure
from cokit.overlap.metrics import compute_metrics, summarize


def test_formulas_exact():
    # T_comp 6, T_comm 2, T_ovl 7: T_seq 8, ideal 6; every value is a dyadic fraction or 8/7.
    m = compute_metrics(6.0, 2.0, 7.0, t_comp_under_overlap=7.5, t_seq_measured=8.75)
    assert m.t_seq == 8.0 and m.ideal == 6.0
    assert m.speedup == 8.0 / 7.0
    assert m.reduction == 1.0 - 7.0 / 8.0 == 0.125
    assert m.fraction_of_ideal_gain == 0.5  # (8 - 7) / min(6, 2)
    assert m.comm_hidden == 0.5  # (8 - 7) / 2
    assert m.compute_slowdown == 0.25  # 7.5 / 6 - 1
    assert m.speedup_vs_measured_seq == 1.25  # 8.75 / 7


def test_perfect_and_no_overlap():
    perfect = compute_metrics(4.0, 1.0, 4.0)
    assert perfect.fraction_of_ideal_gain == 1.0 and perfect.comm_hidden == 1.0 and perfect.speedup == 1.25
    assert perfect.compute_slowdown is None
    none = compute_metrics(4.0, 1.0, 5.0)
    assert none.speedup == 1.0 and none.reduction == 0.0 and none.fraction_of_ideal_gain == 0.0
    worse = compute_metrics(4.0, 1.0, 6.0)
    assert worse.fraction_of_ideal_gain == -1.0 and worse.speedup < 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"t_comp": 0.0}, "t_comp"),
        ({"t_comm": -1.0}, "t_comm"),
        ({"t_ovl": math.nan}, "t_ovl"),
        ({"t_comp": "3"}, "t_comp"),
        ({"t_comp_under_overlap": math.inf}, "t_comp_under_overlap"),
    ],
)
def test_bad_times(kw, match):
    args = {"t_comp": 1.0, "t_comm": 1.0, "t_ovl": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
        compute_metrics(**args)


def test_summarize():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.min, s.max, s.n, s.iqr) == (3.0, 2.0, 4.0, 1.0, 5.0, 5, 2.0)
    one = summarize([7.0])
    assert one.median == one.q1 == one.q3 == 7.0
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


class VirtualClock:
    """Time advances only when the fake workload says so (ms)."""

    name = "virtual"

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def synchronize(self):
        pass

    def elapsed_ms(self, a, b):
        return b - a


class FakeWorkload:
    """Phases with known durations; round r adds r/8 ms to the overlapped time (a spread)."""

    device = torch.device("cpu")
    uses_group = False
    label = "fake"

    def __init__(self, clock):
        self.clock, self.round = clock, 0

    def run_compute(self):
        self.clock.now += 6.0

    def run_communicate(self):
        self.clock.now += 2.0

    def run_sequential(self):
        self.clock.now += 8.5

    def run_overlapped(self, probe=NULL_PROBE):
        with probe.span():
            self.clock.now += 6.5
        self.clock.now += 0.5 + self.round / 8
        self.round += 1


def test_measure_exact_on_virtual_clock():
    clock = VirtualClock()
    wl = FakeWorkload(clock)
    res = measure(wl, repeats=5, warmup=2, clock=clock, info={"k": 1})
    assert isinstance(res, OverlapResult) and res.repeats == 5 and res.timer == "virtual"
    # warm-up rounds 0, 1 are dropped: overlapped = 7 + r/8 for r = 2..6 -> median 7.5
    ovl = res.times["overlapped"]
    assert (ovl.median, ovl.min, ovl.max, ovl.n) == (7.5, 7.25, 7.75, 5)
    assert res.times["compute"].median == 6.0 and res.times["compute"].iqr == 0.0
    assert res.times["compute_under_overlap"].median == 6.5
    m = res.metrics
    assert m == compute_metrics(6.0, 2.0, 7.5, 6.5, 8.5)
    assert m.comm_hidden == 0.25 and m.reduction == 0.0625
    assert res.metric_spread["speedup"].median == 8.0 / 7.5
    assert res.metric_spread["speedup"].max == 8.0 / 7.25
    flat = res.flat()
    assert flat["speedup"] == m.speedup and flat["k"] == 1 and flat["overlapped_ms"] == 7.5
    assert "speedup" in res.format() and res.to_dict()["metrics"]["t_seq"] == 8.0


@pytest.mark.parametrize(
    "kw, match", [({"repeats": 0}, "repeats"), ({"warmup": -1}, "warmup"), ({"repeats": 2.5}, "repeats")]
)
def test_measure_bad_counts(kw, match):
    with pytest.raises(ValueError, match=match):
        measure(FakeWorkload(VirtualClock()), **kw)


def test_measure_rejects_non_workload():
    with pytest.raises(TypeError, match="not a workload"):
        measure(object())
