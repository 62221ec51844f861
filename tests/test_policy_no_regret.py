"""No-regret network policies (never slower than the static settings), on a small deterministic
link simulator.

The simulator turns each :class:`Decision` into the :class:`Observation` a real link would give:
compute ``C`` seconds, then the payload crosses a link of ``bandwidth`` bytes/s after
``latency`` seconds; a token bucket of ``burst`` bytes (refilled at the link's rate, also
during compute) sends that much at once, so small payloads ride it nearly free, as on the
shaped benchmark links; ``spike_every`` adds a loss stall of ``spike_s`` every so many steps.
A policy that wastes time shows up as total time above the static run's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from itertools import pairwise

import pytest

from cokit.compress.policy import BandwidthTargetPolicy, Decision, IntervalPolicy, Observation

PAYLOAD = 68_000  # bytes at the optimizer's own k (the resilience benchmark's DeMo)
DENSE = 1_720_000  # a dense all-reduce of the same gradients


def _bytes(decision: Decision) -> int:
    if decision.skip_sync:
        return 0
    if decision.dense:
        return DENSE
    return round(PAYLOAD * decision.topk_scale / (2 if decision.payload == "sign" else 1))


@dataclasses.dataclass
class Link:
    compute_s: float = 0.05
    bandwidth: float = math.inf  # bytes / s
    latency_s: float = 0.0
    burst: int = 0  # token bucket, bytes
    spike_every: int = 0
    spike_s: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)

    def _refill(self, seconds: float) -> None:
        if math.isfinite(self.bandwidth):
            self.tokens = min(float(self.burst), self.tokens + self.bandwidth * seconds)

    def step(self, step: int, decision: Decision) -> Observation:
        """One step under ``decision``: compute, then send (blocked: latency + what the burst
        did not cover at the link's rate, + a stall now and then)."""
        sent = _bytes(decision)
        self._refill(self.compute_s)
        exposed = 0.0
        if sent:
            free = min(self.tokens, sent)
            self.tokens -= free
            exposed = self.latency_s + (
                (sent - free) / self.bandwidth if math.isfinite(self.bandwidth) else 0.0
            )
            if self.spike_every and step % self.spike_every == 0:
                exposed += self.spike_s
            self._refill(self.latency_s)
        return Observation(
            step, self.compute_s + exposed, exposed, sent, DENSE, synced=not decision.skip_sync
        )


def _run(policy, link: Link, steps: int, first: int = 1, obs: Observation | None = None):
    """Drive ``policy`` on ``link``: (decisions, observations, total seconds)."""
    decisions, observations, total = [], [], 0.0
    for step in range(first, first + steps):
        decision = policy.decide(obs)
        obs = link.step(step, decision)
        decisions.append(decision)
        observations.append(obs)
        total += obs.step_s
    return decisions, observations, total


def _static_total(link: Link, steps: int) -> float:
    return sum(link.step(s, Decision()).step_s for s in range(1, steps + 1))


def _probes(decisions: list[Decision], rung: Decision) -> list[int]:
    """Steps where ``rung`` was entered."""
    return [i for i, d in enumerate(decisions) if d == rung and (i == 0 or decisions[i - 1] != rung)]


def test_a_latency_bound_link_keeps_the_optimizers_own_settings():
    # 0.1 s latency per step, unlimited bandwidth: fewer bytes cannot cut the exposure
    link = Link(compute_s=0.1, latency_s=0.1)
    decisions, _, total = _run(BandwidthTargetPolicy(), link, 1000)
    assert decisions[-1] == Decision()
    elsewhere = sum(d != Decision() for d in decisions)
    assert elsewhere <= 25, elsewhere  # a few moves down on trial, ever rarer, each given back
    assert total <= 1.01 * _static_total(Link(compute_s=0.1, latency_s=0.1), 1000)


def test_a_refused_move_down_is_tried_again_ever_more_rarely():
    link = Link(compute_s=0.1, latency_s=0.1)
    decisions, _, _ = _run(BandwidthTargetPolicy(patience=2), link, 2000)
    trials = _probes(decisions, Decision(topk_scale=0.5))
    gaps = [b - a for a, b in pairwise(trials)]
    assert len(trials) >= 3 and all(g2 > 1.5 * g1 for g1, g2 in pairwise(gaps) if g1 < 900), trials


def test_a_fast_link_reaches_dense_and_stays():
    link = Link(compute_s=0.05, bandwidth=1e11, latency_s=1e-4)
    decisions, _, _ = _run(BandwidthTargetPolicy(allow_dense=True), link, 1000)
    first = decisions.index(Decision(dense=True))
    assert first <= 60, first  # a blind probe once it costs <= 2% of the time so far
    assert all(d.dense for d in decisions[first:])


def test_a_slow_link_with_a_burst_is_probed_for_dense_at_most_once_in_a_long_while():
    # 10 Mbit with a 70 kB bucket: the 68 kB payload rides the burst nearly free, dense costs
    # ~1.3 s (27 compute times)
    link = Link(compute_s=0.05, bandwidth=1.25e6, burst=70_000)
    policy = BandwidthTargetPolicy(allow_dense=True)
    decisions, observations, total = _run(policy, link, 1000)
    probes = _probes(decisions, Decision(dense=True))
    assert len(probes) <= 1, probes
    lost = sum(o.exposed_s for d, o in zip(decisions, observations, strict=True) if d.dense)
    assert lost < 0.03 * total, (lost, total)
    assert total < 1.03 * _static_total(Link(compute_s=0.05, bandwidth=1.25e6, burst=70_000), 1000)
    assert decisions[-1] == Decision()


def test_small_payloads_inside_the_burst_do_not_predict_that_dense_fits():
    link = Link(compute_s=0.05, bandwidth=1.25e7, burst=200_000)  # 100 Mbit, 200 kB burst
    policy = BandwidthTargetPolicy(allow_dense=True)
    decisions, observations, _ = _run(policy, link, 40)
    assert all(o.exposed_s < 1e-3 for o in observations)  # nearly free
    assert policy._predicted_exposure(observations[-1]) is None  # no step loaded the link
    assert not any(d.dense for d in decisions)  # the old bytes-scaled prediction went dense at once
    # the rest of a long run: few probes, each charged at what dense was measured to cost
    decisions, observations, total = _run(policy, link, 3000, first=41, obs=observations[-1])
    probes = _probes(decisions, Decision(dense=True))
    lost = sum(o.exposed_s for d, o in zip(decisions, observations, strict=True) if d.dense)
    assert 1 <= len(probes) <= 6 and lost < 0.01 * total, (probes, lost, total)
    gaps = [b - a for a, b in pairwise(probes)]
    assert all(g2 > 1.5 * g1 for g1, g2 in pairwise(gaps)), probes


def test_a_bandwidth_bound_link_moves_down_to_a_rung_that_fits_and_not_to_dense():
    # 1 MB/s, no burst: k exposes 68 ms per 50 ms of compute; k/8 (8.5 kB) fits 20%
    link = Link(compute_s=0.05, bandwidth=1e6)
    policy = BandwidthTargetPolicy(allow_dense=True)
    decisions, observations, total = _run(policy, link, 1000)
    assert not any(d.dense for d in decisions)
    tail = observations[-100:]
    assert sum(o.exposed_fraction for o in tail) / len(tail) <= policy.target
    assert decisions[-1].topk_scale < 1
    assert total < 0.75 * _static_total(Link(compute_s=0.05, bandwidth=1e6), 1000)  # it pays
    # probes back up (a rung that did not fit) cost little
    lost = sum(o.exposed_s - 0.2 * o.step_s for o in observations if o.exposed_fraction > policy.target)
    assert lost < 0.05 * total, (lost, total)


def test_loss_spikes_on_a_fast_link_do_not_drive_it_off_dense_for_long():
    link = Link(compute_s=0.05, bandwidth=1e11, spike_every=97, spike_s=0.2)
    decisions, _, _ = _run(BandwidthTargetPolicy(allow_dense=True), link, 1000)
    assert sum(d.dense for d in decisions[200:]) >= 0.9 * 800


def test_a_move_down_that_does_not_cut_the_exposure_is_given_back():
    policy = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=False)
    assert policy.decide(Observation(1, 1.0, 0.5, 10_000, 320_000)).describe() == "k x0.5"
    # half the bytes, the same 0.5 s exposed: latency, not bandwidth -> back to k x1
    assert policy.decide(Observation(2, 1.0, 0.5, 5_000, 320_000)).describe() == "k x1"
    assert policy.decide(Observation(3, 1.0, 0.5, 10_000, 320_000)).describe() == "k x1"  # refused
    # half the bytes, 0.3 s exposed: 0.2 s of the 0.25 s a bandwidth-bound link gives -> it pays
    other = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=False)
    other.decide(Observation(1, 1.0, 0.5, 10_000, 320_000))
    assert other.decide(Observation(2, 0.8, 0.3, 5_000, 320_000)).describe() == "k x0.25"
    # a refused move is tried early when the link gets much slower
    assert policy.decide(Observation(4, 2.0, 1.5, 10_000, 320_000)).describe() == "k x0.5"


@pytest.mark.parametrize("as_json", [False, True])
def test_a_resumed_policy_takes_the_same_decisions(as_json):
    def link() -> Link:
        return Link(compute_s=0.05, bandwidth=2e6, burst=40_000, latency_s=0.01, spike_every=37, spike_s=0.3)

    full, _, _ = _run(BandwidthTargetPolicy(deadline_s=0.25), link(), 600)
    first = BandwidthTargetPolicy(deadline_s=0.25)
    replay = link()
    decisions, observations, _ = _run(first, replay, 300)
    state = copy.deepcopy(first.state_dict())
    if as_json:  # as a checkpoint record stores it (int keys as str, tuples as lists)
        state = json.loads(json.dumps(state))
    resumed = BandwidthTargetPolicy(deadline_s=0.25)
    resumed.load_state_dict(state)
    rest, _, _ = _run(resumed, replay, 300, first=301, obs=observations[-1])
    assert decisions + rest == full
    assert len({d.describe() for d in full}) >= 3  # it really adapted


def test_a_state_saved_before_the_no_regret_fields_still_loads():
    old = {
        "level": 2,
        "hold": 0,
        "skips": 0,
        "late": False,
        "seen": {"1": [68000, 0.2, 10]},
        "recent": [0.1, 0.12],
        "memory": {"0": 40},
        "probe": None,
        "since_move": 3,
    }
    policy = BandwidthTargetPolicy()
    policy.load_state_dict(old)
    state = policy.state_dict()
    assert state["level"] == 2 and state["elapsed"] == 0.0 and state["trial"] is None
    assert state["bound"] == state["failed"] == state["refused"] == {}
    assert policy.decide(Observation(11, 1.0, 0.1, 34000, DENSE)) in policy.ladder


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pay_share": 0}, "pay_share"),
        ({"pay_share": 1.5}, "pay_share"),
        ({"pay_share": True}, "pay_share"),
        ({"probe_budget": 0}, "probe_budget"),
        ({"probe_budget": 1}, "probe_budget"),
        ({"probe_budget": float("nan")}, "probe_budget"),
    ],
)
def test_bad_no_regret_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BandwidthTargetPolicy(**kwargs)


def test_describe_lists_every_setting():
    text = BandwidthTargetPolicy().describe()
    for name in (
        "target",
        "min_topk_scale",
        "allow_sign",
        "allow_dense",
        "headroom",
        "patience",
        "deadline_s",
        "max_skips",
        "memory_steps",
        "pay_share",
        "probe_budget",
    ):
        assert f"{name}=" in text
    assert "probe_budget" in IntervalPolicy().describe()


def _interval_run(policy: IntervalPolicy, link: Link, syncs: int, local_s: float = 0.15):
    """Drive an IntervalPolicy: each observation is one interval of ``sync_scale`` local steps
    (``local_s`` each) and the sync of one payload that closes it. (scales, total seconds)"""
    scales, total, obs = [], 0.0, None
    for i in range(1, syncs + 1):
        scale = policy.decide(obs).sync_scale
        link.compute_s = local_s * scale
        obs = link.step(i, Decision())
        scales.append(scale)
        total += obs.step_s
    return scales, total


def test_interval_policy_does_not_flip_flop_on_a_burst_that_refills_only_in_wide_intervals():
    # the sync (68 kB) takes 1 s at 68 kB/s; the bucket holds one payload. At x8 (1.2 s of
    # compute) it refills and the sync is free, which predicts that x4 fits; at x4 (0.6 s)
    # it does not refill and the sync blocks 0.4 s (40%). Without a memory of that failure
    # the interval halved and doubled every other sync.
    def link() -> Link:
        return Link(bandwidth=68_000.0, burst=68_000)

    scales, total = _interval_run(IntervalPolicy(target=0.2, max_scale=8), link(), 400)
    failed = sum(1 for a, b, c in zip(scales[:-2], scales[1:-1], scales[2:], strict=True) if b < a and c > b)
    assert 1 <= failed <= 6, scales
    wide, wide_total = _interval_run(IntervalPolicy(target=0.2, max_scale=8, headroom=1e-9), link(), 400)
    assert wide[-1] == 8
    # time per local step within 2% of staying at x8
    steps, wide_steps = sum(scales), sum(wide)
    assert total / steps <= 1.02 * wide_total / wide_steps, (total / steps, wide_total / wide_steps)


def test_interval_policy_halves_back_on_a_fast_link_and_resumes_exactly():
    slow = Link(bandwidth=68_000.0, burst=68_000)
    policy = IntervalPolicy(target=0.2, max_scale=8)
    _interval_run(policy, slow, 100)
    state = json.loads(json.dumps(policy.state_dict()))
    resumed = IntervalPolicy(target=0.2, max_scale=8)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == policy.state_dict()
    fast_a, fast_b = Link(bandwidth=1e12), Link(bandwidth=1e12)
    a, _ = _interval_run(policy, fast_a, 300)
    b, _ = _interval_run(resumed, fast_b, 300)
    assert a == b
    assert a[-1] == 1  # the optimizer's own interval again, once the failed halving's cost is paid off
    # a state saved before the probe bookkeeping (only the scale) still loads
    old = IntervalPolicy(max_scale=8)
    old.load_state_dict({"scale": 4})
    assert old.state_dict() == {"scale": 4, "probe": None, "held": 0, "failed": {}, "elapsed": 0.0}
    with pytest.raises(ValueError, match="probe_budget"):
        IntervalPolicy(probe_budget=0)
