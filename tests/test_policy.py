"""Network policies as pure functions of agreed observations (compress/policy.py)."""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch

from cokit.compress.policy import BandwidthTargetPolicy, Decision, IntervalPolicy, Observation, StaticPolicy


def _obs(step: int, exposed: float, step_s: float = 1.0, sent: int = 1000, dense: int = 32000, synced=True):
    return Observation(step, step_s, exposed, sent, dense, synced)


def test_static_policy_never_changes_anything():
    policy = StaticPolicy()
    assert not policy.observes
    for obs in (None, _obs(1, 0.99), _obs(2, 0.0)):
        assert policy.decide(obs) == Decision()
    assert policy.state_dict() == {}


def test_ladder_runs_from_dense_to_sign_at_the_smallest_k():
    policy = BandwidthTargetPolicy(min_topk_scale=0.25, allow_dense=True)
    assert [d.describe() for d in policy.ladder] == ["dense", "k x1", "k x0.5", "k x0.25", "k x0.25, sign"]
    assert policy.decide(None) == Decision()  # starts on the optimizer's own settings
    assert [d.describe() for d in BandwidthTargetPolicy(allow_dense=False, allow_sign=False).ladder] == [
        "k x1",
        "k x0.5",
        "k x0.25",
        "k x0.125",
    ]


_BYTES = {
    "dense": 32000,
    "k x1": 1000,
    "k x0.5": 500,
    "k x0.25": 250,
    "k x0.25, sign": 125,
    "k x0.125": 125,
    "k x0.125, sign": 62,
}


def test_a_slow_link_walks_down_one_rung_per_patience_window_and_stops_at_the_bottom():
    # a bandwidth-bound link (4 s per kB over 1 s of compute): every move down pays. (This
    # test used to feed the same 0.9 s whatever the bytes; the policy now gives back a move
    # down that does not cut the exposure, see test_policy_no_regret.py.)
    policy = BandwidthTargetPolicy(target=0.2, min_topk_scale=0.25, patience=1)
    seen, current = [], "k x1"
    for s in range(1, 10):
        exposed = 4.0 * _BYTES[current] / 1000
        current = policy.decide(_obs(s, exposed, step_s=1.0 + exposed, sent=_BYTES[current])).describe()
        seen.append(current)
    assert seen == [
        "k x0.5",
        "k x0.5",  # held for patience=1 step
        "k x0.25",  # the move paid (half the exposure for half the bytes) and is still over
        "k x0.25",
        "k x0.25, sign",
        "k x0.25, sign",
        "k x0.25, sign",  # bottom of the ladder
        "k x0.25, sign",
        "k x0.25, sign",
    ]


def test_a_fast_link_climbs_back_up_on_link_bound_evidence_and_probes_dense_only_when_cheap():
    # The policy used to scale any exposure by bytes, 0.01 s as well as 0.0001 s: a payload
    # that rode a burst predicted that dense fits. Now only steps that loaded the link
    # (>= target / 4 of the step) predict, and a rung with no such evidence is a probe that
    # must fit probe_budget of the time so far.
    policy = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=True)
    policy.level = 3  # k x0.25
    # 6% exposed at 1000 B loads the link: twice the bytes predict ~11%, under 0.7 * 20%
    assert policy.decide(_obs(1, 0.06, step_s=1.06, sent=1000)).describe() == "k x0.5"
    # 12% at 2000 B: k x1 (4000 B) predicts ~19%: no, and a probe (0.24 s) does not fit 2% of 2 s
    assert policy.decide(_obs(2, 0.12, step_s=1.12, sent=2000)).describe() == "k x0.5"
    # ... but 1% exposed does not show a faster link: the 2000 B step that loaded it still rules
    assert policy.decide(_obs(3, 0.01, step_s=1.01, sent=2000)).describe() == "k x0.5"
    # on a link where k x0.5 exposes 6% (link-bound) at 2000 B, k x1 predicts ~11%: it climbs
    policy = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=True)
    policy.level = 2  # k x0.5
    assert policy.decide(_obs(1, 0.06, step_s=1.06, sent=2000)).describe() == "k x1"
    # k x1 nearly free (0.01%) says nothing about dense (16x the bytes); the k x0.5 step that
    # loaded the link predicts 1.92 s for dense while it is fresh (memory_steps=20), then the
    # probe is blind, charged one step (1 s): taken once that is <= 2% of the time so far
    seen = [policy.decide(_obs(s, 0.0001, sent=4000, dense=64000)).describe() for s in range(2, 51)]
    assert seen == ["k x1"] * 48 + ["dense"]
    # a link so fast that even dense fits: it stays
    assert policy.decide(_obs(51, 0.0002, sent=64000, dense=64000)).describe() == "dense"
    # with no link-bound step at all, the probe is blind: it is charged one step (1 s), 50 s
    blind = BandwidthTargetPolicy(target=0.2, allow_dense=True)
    seen = [blind.decide(_obs(s, 0.0001, sent=4000, dense=64000)).describe() for s in range(1, 51)]
    assert seen == ["k x1"] * 49 + ["dense"]


def test_climbing_uses_the_bytes_a_rung_sent_when_it_was_last_measured():
    policy = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=False, memory_steps=0)
    policy.decide(_obs(1, 0.5, sent=10_000))  # k x1 sent 10 kB and was too slow: down to k x0.5
    assert policy.level == 1
    # at k x0.5 the exposed share is 10%: k x1 (10 kB, 2x) predicts ~18%, above 0.7 * 20%
    assert policy.decide(_obs(2, 0.1, sent=5_000)).describe() == "k x0.5"


def test_a_rung_measured_too_slow_recently_is_not_retried_until_its_memory_expires():
    # a lossy link: k x1 exposed 0.4 s although k x0.5 (half the bytes) exposes only 0.01 s
    policy = BandwidthTargetPolicy(target=0.2, patience=0, allow_dense=False, memory_steps=10)
    policy.decide(_obs(1, 0.4, sent=10_000))
    assert policy.level == 1
    # bytes alone (2 x 0.01 s) would predict 2% and climb; the measurement (0.4 s) says no
    held = [policy.decide(_obs(s, 0.01, sent=5_000)).describe() for s in range(2, 12)]
    assert held == ["k x0.5"] * 10
    # 11 steps after k x1 was measured its memory has expired, and 1% exposed at k x0.5 did
    # not load the link: nothing predicts k x1, so it is a blind probe, charged one step
    # (1 s) and taken once that is <= probe_budget (2%) of the time so far, at 50 s. (Without
    # the probe budget it was retried from bytes at step 12.)
    later = [policy.decide(_obs(s, 0.01, sent=5_000)).describe() for s in range(12, 50)]
    assert later == ["k x0.5"] * 38
    assert policy.decide(_obs(50, 0.01, sent=5_000)).describe() == "k x1"


def test_deadline_skips_syncs_then_sends_again():
    policy = BandwidthTargetPolicy(target=0.3, deadline_s=2.0, max_skips=2, allow_dense=False, patience=0)
    assert policy.decide(_obs(1, 0.1, step_s=1.0)) == Decision()
    late = policy.decide(_obs(2, 3.0, step_s=4.0))  # over the deadline and over target
    assert late.skip_sync
    assert policy.decide(_obs(3, 0.0, synced=False)).skip_sync  # second skip in a row
    back = policy.decide(_obs(4, 0.0, synced=False))  # max_skips reached: sync again
    assert not back.skip_sync and back.describe() == "k x0.5"
    assert not policy.decide(_obs(5, 0.2, step_s=1.0)).skip_sync


def _closed_loop(
    policy: BandwidthTargetPolicy, steps: range, decision: Decision | None = None
) -> list[Decision]:
    """A link that is bandwidth-bound (0.9 s per kB) 4 steps in 7 and fast otherwise: each
    observation follows from the decision before it."""
    out = []
    for s in steps:
        sent = 0 if decision is None or decision.skip_sync else _BYTES[decision.describe()]
        exposed = 0.9 * sent / 1000 if s % 7 < 4 else 0.01
        obs = (
            None
            if decision is None
            else _obs(s, exposed, step_s=1.0, sent=sent, synced=not decision.skip_sync)
        )
        decision = policy.decide(obs)
        out.append(decision)
    return out


def test_same_observations_give_the_same_decisions_and_state_round_trips():
    a, b = BandwidthTargetPolicy(deadline_s=0.85), BandwidthTargetPolicy(deadline_s=0.85)
    decisions_a = _closed_loop(a, range(1, 60))
    assert decisions_a == _closed_loop(b, range(1, 60))
    assert len({d.describe() for d in decisions_a}) > 2  # it really adapted

    first = BandwidthTargetPolicy(deadline_s=0.85)
    head = _closed_loop(first, range(1, 30))
    resumed = BandwidthTargetPolicy(deadline_s=0.85)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert _closed_loop(first, range(30, 60), head[-1]) == _closed_loop(resumed, range(30, 60), head[-1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target": 0}, "target"),
        ({"target": 1.5}, "target"),
        ({"target": float("nan")}, "target"),
        ({"min_topk_scale": 0}, "min_topk_scale"),
        ({"headroom": 1}, "headroom"),
        ({"patience": -1}, "patience"),
        ({"patience": True}, "patience"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"deadline_s": float("inf")}, "deadline_s"),
        ({"max_skips": 1.5}, "max_skips"),
        ({"memory_steps": -2}, "memory_steps"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BandwidthTargetPolicy(**kwargs)


def test_a_state_from_other_settings_is_rejected():
    state = BandwidthTargetPolicy(min_topk_scale=1 / 64).state_dict() | {"level": 8}
    with pytest.raises(ValueError, match="other policy settings"):
        BandwidthTargetPolicy().load_state_dict(state)
    with pytest.raises(ValueError, match="keeps no state"):
        StaticPolicy().load_state_dict({"level": 1})


def test_a_rung_that_fails_every_probe_is_probed_ever_more_rarely():
    # the current rung hides its exposure (overlap), so nothing says whether dense fits; it
    # never does. Each failure (0.9 s) waits until 2**(failures - 1) x 0.9 s is <= 2% of the
    # time since (without the probe budget only the measurement memory doubled: 8 probes in 120 steps)
    policy = BandwidthTargetPolicy(target=0.2, patience=0, memory_steps=5, allow_dense=True)
    probes = []
    for step in range(1, 1500):
        on_dense = policy.level == 0
        decision = policy.decide(_obs(step, 0.9 if on_dense else 0.001, sent=1000, dense=32000))
        if decision.dense:
            probes.append(step)
    assert all(b - a > 1 for a, b in pairwise(probes))  # each failed probe costs one step
    gaps = [b - a for a, b in pairwise(probes)]
    assert len(gaps) >= 3 and all(g2 > 1.5 * g1 for g1, g2 in pairwise(gaps)), probes
    assert probes[0] == 50  # blind: once one step (1 s) is <= 2% of the time so far


def test_interval_policy_widens_while_a_sync_blocks_too_much_and_narrows_when_the_link_recovers():
    policy = IntervalPolicy(target=0.2, max_scale=4)
    assert policy.decide(None) == Decision()  # the optimizer's own sync_every
    slow = [policy.decide(_obs(s, exposed=0.5, step_s=1.0)).sync_scale for s in range(1, 5)]
    assert slow == [2, 4, 4, 4]  # doubles, capped at max_scale
    # fast again: 0.01 s blocked over 1 s; at half the compute it predicts 0.01 / 0.505 < 0.14
    fast = [policy.decide(_obs(s, exposed=0.01, step_s=1.0)).sync_scale for s in range(5, 8)]
    assert fast == [2, 1, 1]
    # in between: fits the target now but would not at half the interval -> it stays
    policy = IntervalPolicy(target=0.2, max_scale=4)
    policy.decide(_obs(1, exposed=0.5))
    assert policy.decide(_obs(2, exposed=0.15, step_s=1.0)).sync_scale == 2
    # a skipped (non-finite) sync measures nothing
    assert policy.decide(_obs(3, exposed=0.9, synced=False)).sync_scale == 2
    assert Decision(sync_scale=4).describe() == "sync every x4"


def test_interval_policy_state_round_trips_and_bad_settings_are_refused():
    policy = IntervalPolicy(max_scale=8)
    for s in range(3):
        policy.decide(_obs(s, exposed=0.9))
    fresh = IntervalPolicy(max_scale=8)
    fresh.load_state_dict(copy.deepcopy(policy.state_dict()))
    assert fresh.decide(None) == policy.decide(None) == Decision(sync_scale=8)
    with pytest.raises(ValueError, match=r"outside 1\.\.2"):
        IntervalPolicy(max_scale=2).load_state_dict({"scale": 8})
    for kwargs, match in (
        ({"target": 1.5}, "target"),
        ({"max_scale": 3}, "power of 2"),
        ({"max_scale": 0}, "max_scale"),
        ({"max_scale": True}, "max_scale"),
        ({"headroom": 1.0}, "headroom"),
    ):
        with pytest.raises(ValueError, match=match):
            IntervalPolicy(**kwargs)


def test_each_optimizer_takes_only_the_policies_it_can_follow():
    from cokit.compress import DeMo, SparseLoCo

    params = [torch.nn.Parameter(torch.zeros(8, 8))]
    with pytest.raises(ValueError, match=r"IntervalPolicy.*not a policy DeMo can follow"):
        DeMo(params, lr=0.1, policy=IntervalPolicy())
    with pytest.raises(ValueError, match=r"one of \['static', 'bandwidth'\]"):
        DeMo(params, lr=0.1, policy="interval")
    with pytest.raises(ValueError, match="not a policy SparseLoCo can follow"):
        SparseLoCo(params, policy=BandwidthTargetPolicy())
    with pytest.raises(ValueError, match=r"one of \['static', 'interval'\]"):
        SparseLoCo(params, policy={"name": "bandwidth"})
    opt = SparseLoCo(params, sync_every=3, policy={"name": "interval", "max_scale": 2})
    assert opt.policy.describe() == "IntervalPolicy(target=0.2, max_scale=2, headroom=0.7, probe_budget=0.02)"
    assert opt.current_interval == 3


def test_the_default_ladder_starts_at_the_optimizers_own_settings_without_dense():
    # the resilience benchmark (DeMo, 3 seeds): with three one-step dense probes per 100 Mbit
    # run no seed reached static DeMo's final loss, and going dense paid on no profile for
    # all seeds; dense is opt-in
    policy = BandwidthTargetPolicy()
    assert policy.ladder[policy.level] == Decision() and not any(d.dense for d in policy.ladder)
    assert "allow_dense=False" in policy.describe()


def test_sign_first_ladder_switches_payload_before_halving_k():
    policy = BandwidthTargetPolicy(min_topk_scale=0.25, sign_first=True, allow_dense=True)
    assert [d.describe() for d in policy.ladder] == [
        "dense",
        "k x1",
        "k x1, sign",
        "k x0.5, sign",
        "k x0.25, sign",
    ]
    assert "sign_first=True" in policy.describe()
    assert "sign_first" not in BandwidthTargetPolicy().describe()  # old checkpoints still match
    plain = BandwidthTargetPolicy(sign_first=True, allow_sign=False)
    assert [d.payload for d in plain.ladder] == [None] * 4  # k .. k/8: sign_first needs allow_sign
