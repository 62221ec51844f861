"""DeMo driven by a network policy on real gloo groups: agreed decisions, bit-identical ranks.

The 2-rank scenarios share one spawned world (tests/gloo_cases.py, fixture ``world2``). The
changing-link runs time their steps on an injected clock that the test advances ("compute",
a slow link), so their decisions do not depend on the machine's load.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cokit.compress import DeMo, SparseLoCo
from cokit.compress.checkpoint import records
from cokit.compress.policy import BandwidthTargetPolicy, Decision, IntervalPolicy, NetworkPolicy, Observation
from tests.distributed import run_gloo
from tests.gloo_cases import Case, run_cases
from tests.helpers import STATUS_ROW, byte_counts


class _Fixed(NetworkPolicy):
    """A plug-in policy that always takes one decision (module level: it is pickled)."""

    observes = False

    def __init__(self, decision: Decision):
        self.decision = decision

    def decide(self, observation: Observation | None) -> Decision:
        return self.decision

    def describe(self) -> str:
        return f"_Fixed({self.decision.describe()})"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _one_step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


class _Clock:
    """A fake clock the ranks advance by hand: decisions that follow from it do not depend on
    how loaded the machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _slow_link(comm, delay: list[float], clock: _Clock) -> None:
    """Make every collective of ``comm`` take ``delay[0]`` seconds of ``clock`` longer
    (bytes-independent latency, the same on every rank)."""
    for name in ("all_gather", "_all_reduce"):
        launch = getattr(comm, name)

        def delayed(*args, _launch=launch, **kwargs):
            pending = _launch(*args, **kwargs)
            wait = pending.wait

            def late_wait():
                clock.now += delay[0]
                return wait()

            pending.wait = late_wait
            return pending

        setattr(comm, name, delayed)


def _changing_link(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model()
    clock = _Clock()
    policy = BandwidthTargetPolicy(target=0.2, min_topk_scale=0.25, patience=0)
    opt = DeMo(
        model.parameters(), lr=1e-3, compression_topk=8, compression_chunk=16, policy=policy, clock=clock
    )
    delay = [0.0]
    _slow_link(opt.comm, delay, clock)
    phases = {}
    for step in range(1, 41):
        delay[0] = 0.25 if 5 <= step <= 14 else 0.0  # a slow stretch, then fast again
        clock.now += 0.15  # "compute"
        _one_step(model, opt, rank, step)
        phases[step] = (opt._driver.decision.describe(), opt.comm_stats.step_sent_bytes)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, opt.policy_log, phases


FIXED = (Decision(), Decision(topk_scale=0.5), Decision(payload="sign"), Decision(dense=True))
SKIP = Decision(skip_sync=True)


@pytest.fixture(scope="module")
def world2() -> dict[str, list]:
    """Every 2-rank scenario of this module in one world."""
    cases = [Case("changing link", _changing_link)]
    cases += [Case(d.describe(), _fixed, (d,)) for d in (*FIXED, SKIP)]
    cases.append(Case("resume", _resume_with_policy))
    cases.append(Case("sparseloco interval", _sparseloco_changing_link))
    return run_cases(2, cases)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_policy_follows_a_changing_link_with_the_same_decisions_on_every_rank(request, world):
    results = (
        request.getfixturevalue("world2")["changing link"] if world == 2 else run_gloo(3, _changing_link)
    )
    flat0, log0, phases = results[0]
    for flat, log, _ in results[1:]:
        assert torch.equal(flat, flat0)  # replicas stay bit-identical
        assert [(e["step"], e["decision"]) for e in log] == [(e["step"], e["decision"]) for e in log0]
    # the slow stretch delays each collective: k x0.5 packs into fewer collectives than k x1
    # (0.5 s exposed instead of 0.75 s), so that move down pays; k x0.25 exposes the same
    # 0.5 s, so it is given back (without that rule it walked on to the bottom of the ladder:
    # fewer bytes for no speed)
    assert [e["decision"] for e in log0][:4] == ["k x1", "k x0.5", "k x0.25", "k x0.5"], log0
    assert phases[14][0] == "k x0.5", phases
    assert phases[14][1] < phases[4][1]
    # it stays there while the slow measurements are fresh (memory_steps=20), then probes
    # back up to the optimizer's own k (or dense)
    assert phases[24][0] == "k x0.5", phases
    assert phases[40][0] in ("k x1", "dense"), phases
    moves = [e for e in log0 if e["observation"] is not None]
    assert moves[0]["observation"]["exposed_fraction"] > 0.2


def _sparseloco_changing_link(rank: int, world: int):
    """SparseLoCo (H=2) with an IntervalPolicy: a slow stretch widens the sync interval to
    max_scale x H, a fast link brings it back; a checkpoint taken wide resumes wide."""
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model()
    clock = _Clock()
    opt = SparseLoCo(
        model.parameters(),
        lambda ps: torch.optim.SGD(ps, lr=1e-2),
        sync_every=2,
        topk=8,
        chunk=16,
        policy=IntervalPolicy(target=0.2, max_scale=4),
        timeout=120,
        clock=clock,
    )
    delay = [0.0]
    _slow_link(opt.comm, delay, clock)
    intervals, state = {}, None
    for step in range(1, 41):
        delay[0] = 0.3 if 3 <= step <= 16 else 0.0
        clock.now += 0.1  # "compute"
        _one_step(model, opt, rank, step)
        intervals[step] = opt.current_interval
        if step == 20:
            state = opt.state_dict()
    resumed = SparseLoCo(
        _model().parameters(),
        lambda ps: torch.optim.SGD(ps, lr=1e-2),
        sync_every=2,
        topk=8,
        chunk=16,
        policy=IntervalPolicy(target=0.2, max_scale=4),
    )
    resumed.load_state_dict(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, opt.policy_log, intervals, resumed.current_interval, opt.syncs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sparseloco_widens_its_sync_interval_on_a_slow_link_alike_on_every_rank(request, world):
    results = (
        request.getfixturevalue("world2")["sparseloco interval"]
        if world == 2
        else run_gloo(3, _sparseloco_changing_link)
    )
    flat0, log0, intervals, resumed, syncs = results[0]
    for flat, log, seen, _, _ in results[1:]:
        assert torch.equal(flat, flat0)  # replicas stay bit-identical
        assert [(e["step"], e["decision"]) for e in log] == [(e["step"], e["decision"]) for e in log0]
        assert seen == intervals
    assert max(intervals.values()) == 8, intervals  # 4 x sync_every
    assert intervals[40] == 2, intervals  # back to the optimizer's own interval
    assert resumed == intervals[20]
    assert syncs < 20  # fewer syncs than every 2 steps
    widened = [e for e in log0 if e["sync_scale"] > 1 and e["observation"] is not None]
    assert widened and widened[0]["observation"]["exposed_fraction"] > 0.2


def _fixed(rank: int, world: int, decision: Decision):
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model()
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=8, compression_chunk=16, policy=_Fixed(decision))
    before = [p.detach().clone() for p in model.parameters()]
    deltas = None
    for step in range(1, 4):
        if decision.skip_sync:
            deltas = [opt.plan.error_buffer(p).clone() for p in model.parameters()]
            before = [p.detach().clone() for p in model.parameters()]
        _one_step(model, opt, rank, step)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    after = [p.detach().clone() for p in model.parameters()]
    grads = []
    if decision.skip_sync:  # replay the last step's gradient to check the buffers
        x, y = _batch(rank, 3)
        probe = _model()
        probe.load_state_dict(model.state_dict())
        torch.nn.functional.mse_loss(probe(x), y).backward()
        grads = [p.grad for p in probe.parameters()]
    new_deltas = [opt.plan.error_buffer(p).clone() for p in model.parameters()]
    return (
        flat,
        byte_counts(opt.comm_stats.as_dict()),
        opt.skipped_syncs,
        before,
        after,
        deltas,
        new_deltas,
        grads,
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_each_decision_changes_what_is_sent_and_ranks_stay_identical(world2):
    results = {d.describe(): world2[d.describe()] for d in FIXED}
    for runs in results.values():
        assert torch.equal(runs[0][0], runs[1][0])
    sent = {name: runs[0][1]["step_sent_bytes"] for name, runs in results.items()}
    n = sum(p.numel() for p in _model().parameters())
    status = STATUS_ROW  # the fixed-size status row, all-gathered (world 2)
    assert sent["dense"] == n * 4 + status  # fp32 ring all-reduce at world 2 sends the buffer once
    assert sent["k x0.5"] < sent["k x1"] < sent["dense"]
    assert sent["k x1, sign"] < sent["k x1"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_skipped_sync_keeps_the_update_in_the_error_buffers(world2):
    for _flat, stats, skipped, before, after, deltas, new_deltas, grads in world2[SKIP.describe()]:
        assert skipped == 3
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # parameters unchanged
        for old, new, g in zip(deltas, new_deltas, grads, strict=True):
            torch.testing.assert_close(new, 0.999 * old + 1e-3 * g, rtol=0, atol=1e-7)
        assert stats["step_sent_bytes"] == STATUS_ROW  # only the status exchange


def _resume_with_policy(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    model = _model()
    policy = BandwidthTargetPolicy(patience=3)
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=8, compression_chunk=16, policy=policy)
    for step in range(1, 4):
        _one_step(model, opt, rank, step)
    state = opt.state_dict()
    again = DeMo(_model().parameters(), lr=1e-3, compression_topk=8, compression_chunk=16, policy="bandwidth")
    try:
        again.load_state_dict(state)
        other = None
    except ValueError as exc:
        other = str(exc)
    same = DeMo(
        _model().parameters(),
        lr=1e-3,
        compression_topk=8,
        compression_chunk=16,
        policy=BandwidthTargetPolicy(patience=3),
    )
    same.load_state_dict(state)
    return records(state)["common"]["policy"], same.policy.state_dict(), same.policy_log, other


@pytest.mark.distributed
@pytest.mark.slow
def test_the_policy_state_is_checkpointed_and_must_match(world2):
    saved, loaded, log, other = world2["resume"][0]
    assert json.loads(json.dumps(loaded)) == saved["state"]  # the record is JSON (int keys as str)
    assert log == saved["log"] and log[0]["decision"] == "k x1"
    assert other is not None and "setting 'policy' was 'BandwidthTargetPolicy(target=0.2" in other


def test_policies_are_checked_before_anything_is_built():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="one or the other"):
        DeMo(params, overlap_backward=True, policy="bandwidth")
    with pytest.raises(ValueError, match="policy must be a NetworkPolicy"):
        DeMo(params, policy="fastest")
    with pytest.raises(ValueError, match="bad arguments for policy 'bandwidth'"):
        DeMo(params, policy={"name": "bandwidth", "targte": 0.1})
    with pytest.raises(ValueError, match="target must be in"):
        DeMo(params, policy={"name": "bandwidth", "target": 2})
    assert DeMo(params, policy={"name": "bandwidth", "target": 0.1}).policy.target == 0.1
    assert DeMo(params, overlap_backward=True, policy="static").policy.describe() == "StaticPolicy()"


def test_a_single_process_keeps_deciding_without_peers():
    model = _model()
    opt = DeMo(model.parameters(), lr=1e-3, compression_topk=8, compression_chunk=16, policy="bandwidth")
    for step in range(1, 5):
        _one_step(model, opt, 0, step)
    assert opt.policy_log[0]["decision"] == "k x1" and opt.policy_log[0]["observation"] is None
