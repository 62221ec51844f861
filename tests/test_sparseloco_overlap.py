"""SparseLoCo's overlapped outer sync (``sync="eager"``) on real gloo groups (world 2 and 3):
the shared state bit-identical on every rank after each sync, exact resume with a round in
flight, the blocking sync's bytes, the last round applied by ``finish()``, a peer's bad data
while in flight, and the settings it refuses."""

from __future__ import annotations

import copy
import math
import os
import warnings
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from distributed import run_gloo
from helpers import SmallNet, dcp_load, dcp_save, regression_data

from cokit.compress import SparseLoCo
from cokit.compress.agreement import PeerDataError
from cokit.compress.exchange import Exchange
from cokit.compress.sparseloco_state import records
from cokit.compress.timing import StepTimer

SHAPES = [(32, 48), (64,), (5,)]  # a 2-D weight (6 tiles of 16x16), a 1-D one, a tiny bias (dense)
CHUNK, K, H, LR = 16, 8, 3, 0.05
CONFIGS = {
    "int2": dict(payload="int2"),
    "int2-dct-nesterov": dict(payload="int2", dct=True, outer="nesterov", outer_lr=0.7),
    "sign": dict(payload="sign", outer_lr=0.9),
    "dense-nesterov": dict(topk=None, outer="nesterov", outer_lr=0.7),
    "warmup-stochastic": dict(dense_warmup=2, precision="stochastic"),
}
STEPS = 3 * H + 1  # three syncs (two applied before the last launch), then a step into the next period


def _grad(rank: int, step: int, i: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + i))


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _build(params, **kwargs) -> SparseLoCo:
    options = dict(sync_every=H, topk=K, chunk=CHUNK, error_decay=0.95, timeout=120, sync="eager")
    options.update(kwargs)
    return SparseLoCo(params, lambda ps: torch.optim.AdamW(ps, lr=1e-2), **options)


def _shared(opt: SparseLoCo) -> list[torch.Tensor]:
    """theta_global and the outer momentum of every parameter (what every rank must hold alike)."""
    out = []
    for p in opt._model_params:
        s = opt.state[p]
        out += [s["global"].clone()] + ([s["momentum"].clone()] if "momentum" in s else [])
    return out


def _run(rank, params, opt, start, stop, save_at=(), hook=None):
    """Steps ``start..stop-1``; the shared state after each, and state dicts at ``save_at``."""
    shared, saved = [], {}
    for step in range(start, stop):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        opt.step()
        shared.append((opt.syncs, _shared(opt)))
        if step + 1 in save_at:
            saved[step + 1] = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    return shared, saved


def _configs(rank: int, world: int) -> dict:
    """Every config: the shared state after every step, the bytes per step of eager and blocking,
    and ``finish()`` after the last step."""
    out = {}
    for name, kwargs in CONFIGS.items():
        sent = {}
        for sync in ("blocking", "eager"):
            params = _params()
            opt = _build(params, sync=sync, **kwargs)
            steps = []
            for step in range(STEPS):
                for i, p in enumerate(params):
                    p.grad = _grad(rank, step, i, p.shape)
                opt.step()
                steps.append(opt.comm_stats.step_sent_bytes)
            sent[sync] = steps
            if sync == "eager":
                shared_before = _shared(opt)
                syncs_before = opt.syncs
                local = [p.detach().clone() for p in params]
                opt.finish()
                out[name] = {
                    "syncs": (syncs_before, opt.syncs),
                    "finished": _shared(opt),
                    "changed": any(
                        not torch.equal(a, b) for a, b in zip(shared_before, _shared(opt), strict=True)
                    ),
                    "local kept": all(torch.equal(a, p) for a, p in zip(local, params, strict=True)),
                }
                opt.finish()  # nothing in flight: nothing happens
                out[name]["again"] = opt.syncs
        out[name]["sent"] = sent
        params = _params()
        out[name]["shared"], _ = _run(rank, params, _build(params, **kwargs), 0, STEPS)
    return out


def _resume(rank: int, world: int) -> dict:
    """An uninterrupted eager run against runs resumed from its state dicts: mid-period with a
    round in flight (4, 5), right after a launch (6) and before any sync (2)."""
    kwargs = dict(outer="nesterov", outer_lr=0.7, dct=True)
    params = _params()
    opt = _build(params, **kwargs)
    _, saved = _run(rank, params, opt, 0, STEPS, save_at=(2, 4, 5, 6))
    opt.finish()
    final = ([p.detach().clone() for p in params], _shared(opt), opt.state[params[0]]["error"].clone())
    out: dict = {"final": final, "in_flight": {}}
    for at, (state, values) in saved.items():
        out["in_flight"][at] = records(state)["common"]["in_flight"] is not None
        again = [torch.nn.Parameter(v.clone()) for v in values]
        opt2 = _build(again, **kwargs)
        opt2.load_state_dict(state)
        _run(rank, again, opt2, at, STEPS)
        opt2.finish()
        out[at] = ([p.detach().clone() for p in again], _shared(opt2), opt2.state[again[0]]["error"].clone())
    return out


def _corrupted_gather():
    """``Exchange.gather`` that puts a NaN in the first value slot of what the peers receive
    (this rank's own encode and error buffers see the bytes it meant to send)."""
    original = Exchange.gather

    def gather(exchange, codec, wires):
        idx, vals = (x[0].clone() for x in codec.decode([w.reshape(1, -1) for w in wires]))
        vals[0] = math.nan
        return original(exchange, codec, codec.to_wire(idx, vals))

    return gather


def _peer_fault(rank: int, world: int) -> dict:
    """Rank world-1 sends a NaN in the round launched at step 2 (the first sync); every rank
    finds it when that round lands (step 5), and the state is what it was; then training goes
    on and the replicas stay identical."""
    params = _params()
    opt = _build(params, outer="nesterov", outer_lr=0.7)
    out: dict = {}
    for step in range(3 * H + 1):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        corrupt = step == H - 1 and rank == world - 1
        before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)}
        with mock.patch.object(Exchange, "gather", _corrupted_gather()) if corrupt else nullcontext():
            try:
                opt.step()
            except PeerDataError as exc:
                after = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)}
                same = all(
                    before[n].keys() == after[n].keys()
                    and all(torch.equal(before[n][k], after[n][k]) for k in before[n])
                    for n in before
                )
                out["raised"] = (step, str(exc), same, opt.syncs, opt._flight is None)
    out["then"] = (opt.syncs, _shared(opt))
    return out


def _nonfinite(rank: int, world: int) -> dict:
    """Rank world-1's weight overflows in period 1: its report rides on the round launched at
    step 2, found when that round lands (step 5): ``"error"`` raises on every rank, ``"skip"``
    skips it on every rank; either way every rank is back at theta_global and goes on."""
    out: dict = {}
    for mode in ("error", "skip"):
        params = _params()
        opt = _build(params, nonfinite=mode)
        for step in range(4 * H):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p.shape)
            if step == 1 and rank == world - 1:
                with torch.no_grad():
                    params[1][3] = math.inf
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    opt.step()
                except FloatingPointError as exc:
                    out[mode] = (step, str(exc))
            if any("skipped a sync" in str(w.message) for w in caught):
                out[mode] = (step, "skipped")
            if step == 2 * H - 1:
                out[mode + " back"] = all(
                    torch.equal(p.detach(), opt.state[p]["global"]) and "start" not in opt.state[p]
                    for p in params
                )
        out[mode + " then"] = (opt.syncs, opt.skipped_syncs, _shared(opt))
    return out


def _mismatch(rank: int, world: int) -> dict:
    """One rank eager, the others blocking: the first step (a waited status round) raises on
    every rank. Then an inner lr changed on one rank in period 1: the row that rides with the
    round launched at step 2 says so, and every rank raises when it lands (step 5)."""
    params = _params()
    opt = _build(params, sync="eager" if rank == world - 1 else "blocking")
    for i, p in enumerate(params):
        p.grad = _grad(rank, 0, i, p.shape)
    out: dict = {"raised": None, "later": None}
    try:
        opt.step()
    except ValueError as exc:
        out["raised"] = str(exc)
    params = _params()
    opt = _build(params)
    for step in range(2 * H):
        if step == 1 and rank == world - 1:
            opt.param_groups[0]["lr"] = 0.5  # an LR scheduler stepped on one rank only
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        try:
            opt.step()
        except ValueError as exc:
            out["later"] = (step, str(exc), opt.syncs, opt._flight is None)
    return out


def _world(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"  # torch kernel paths in the workers
    out = {
        "configs": _configs(rank, world),
        "peer": _peer_fault(rank, world),
        "nonfinite": _nonfinite(rank, world),
        "mismatch": _mismatch(rank, world),
    }
    if world == 2:
        out["resume"] = _resume(rank, world)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_gloo(2, _world)


@pytest.fixture(scope="module")
def world3():
    return run_gloo(3, _world)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_replicas_hold_the_same_shared_state_after_every_sync_and_bytes_match_blocking(world, world2, world3):
    results = world2 if world == 2 else world3
    for name in CONFIGS:
        per_rank = [r["configs"][name] for r in results]
        for step in range(STEPS):
            syncs = {r["shared"][step][0] for r in per_rank}
            assert len(syncs) == 1, (name, step)
            assert all(_equal(per_rank[0]["shared"][step][1], r["shared"][step][1]) for r in per_rank[1:]), (
                name,
                step,
            )
        # a round lands one period late: syncs applied after step s (after the dense warm-up)
        warm = CONFIGS[name].get("dense_warmup", 0)
        launched = (STEPS - warm) // H
        assert [n for n, _ in per_rank[0]["shared"]] == [
            max(0, (s + 1 - warm) // H - 1) for s in range(STEPS)
        ]
        for r in per_rank:  # the same bytes at the same steps as the blocking sync
            assert r["sent"]["eager"] == r["sent"]["blocking"], name
            assert sum(r["sent"]["eager"]) > 0
            assert r["syncs"] == (launched - 1, launched) and r["changed"] and r["local kept"]
            assert r["again"] == launched
        assert all(_equal(per_rank[0]["finished"], r["finished"]) for r in per_rank[1:]), name


def test_resume_with_a_round_in_flight_is_bit_exact(world2):
    for rank in world2:
        res = rank["resume"]
        assert res["in_flight"] == {2: False, 4: True, 5: True, 6: True}
        for at in (2, 4, 5, 6):
            params, shared, error = res[at]
            assert _equal(params, res["final"][0]), at
            assert _equal(shared, res["final"][1]), at
            assert torch.equal(error, res["final"][2]), at


@pytest.mark.parametrize("world", [2, 3])
def test_bad_peer_data_in_flight_raises_on_every_rank_and_changes_nothing(world, world2, world3):
    results = world2 if world == 2 else world3
    for r in results:
        step, message, same, syncs, dropped = r["peer"]["raised"]
        assert step == 2 * H - 1  # found when the round lands, one period after its launch
        assert same and syncs == 0 and dropped
        assert f"rank {world - 1}" in message and "in flight" in message and "dropped" in message
    then = [r["peer"]["then"] for r in results]
    assert all(t[0] == then[0][0] == 1 for t in then)  # the next round was applied
    assert all(_equal(then[0][1], t[1]) for t in then[1:])


@pytest.mark.parametrize("world", [2, 3])
def test_a_nonfinite_pseudo_gradient_in_flight_raises_or_skips_on_every_rank(world, world2, world3):
    results = world2 if world == 2 else world3
    for r in results:
        nf = r["nonfinite"]
        step, message = nf["error"]
        assert step == 2 * H - 1 and f"on rank {world - 1}" in message and "back at the last sync" in message
        assert nf["skip"] == (2 * H - 1, "skipped") and nf["error back"] and nf["skip back"]
    for mode in ("error", "skip"):
        then = [r["nonfinite"][mode + " then"] for r in results]
        # back at theta_global at step 5, no launch there; launched at 8, landed at 11
        assert all(t[:2] == (1, 1 if mode == "skip" else 0) for t in then), then
        assert all(_equal(then[0][2], t[2]) for t in then[1:])


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_with_another_sync_setting_stops_every_rank(world, world2, world3):
    results = world2 if world == 2 else world3
    for r in results:
        assert r["mismatch"]["raised"] is not None and "sync" in r["mismatch"]["raised"]
        step, message, syncs, dropped = r["mismatch"]["later"]
        assert step == 2 * H - 1 and "lr" in message and syncs == 0 and dropped


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sync="late"), r"sync must be one of 'blocking', 'eager', got 'late'"),
        (dict(sync="eager", adaptive_topk=True), "sync='eager' does not combine with adaptive_topk"),
        (dict(sync="eager", policy="interval"), "sync='eager' needs the static policy"),
    ],
)
def test_unsupported_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseLoCo(_net().parameters(), **kwargs)


def test_blocking_keeps_its_saved_settings_and_a_single_process_eager_run_finishes():
    net = _net()
    opt = SparseLoCo(net.parameters(), sync="blocking")
    assert "sync" not in records(opt.state_dict())["common"]["settings"]
    net = _net()
    opt = SparseLoCo(net.parameters(), sync="eager", sync_every=2, topk=4)
    x = torch.randn(16, 8)
    for _ in range(5):
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    assert opt.syncs == 1 and opt._flight is not None
    state = opt.state_dict()
    assert records(state)["common"]["settings"]["sync"] == "eager"
    assert len(records(state)["common"]["in_flight"]) == 1  # the status row of the round in flight
    opt.finish()
    assert opt.syncs == 2 and opt._flight is None
    with pytest.raises(ValueError, match="sync"):  # an eager state into a blocking optimizer
        SparseLoCo(_net().parameters(), sync="blocking").load_state_dict(state)


def _dcp_run(rank: int, world: int, folder: str) -> tuple:
    """Train 9 steps (H=3, eager) and save with DCP after step 4 (a round in flight); a fresh
    model and optimizer (other initial weights) resumed from it must end alike."""
    os.environ["TRITON_INTERPRET"] = "0"
    x, y = regression_data(rank)

    def build(seed: int):
        torch.manual_seed(seed)
        model = SmallNet()
        inner = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
        return model, SparseLoCo(model.named_parameters(), inner, sync_every=3, timeout=120, sync="eager")

    def train(model, opt, steps, final=True):
        for step in steps:
            xs, ys = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        if not final:
            return []
        opt.finish()
        with opt.synchronized():
            return [p.detach().clone() for p in model.parameters()] + _shared(opt)

    model, opt = build(0)
    train(model, opt, range(4), final=False)
    dcp_save(model, opt, folder)
    straight = train(model, opt, range(4, 9))
    model2, opt2 = build(1)
    dcp_load(model2, opt2, folder)
    in_flight = opt2._flight is not None
    return straight, train(model2, opt2, range(4, 9)), in_flight


@pytest.mark.distributed
def test_dcp_saves_and_resumes_a_round_in_flight_exactly(tmp_path):
    for straight, resumed, in_flight in run_gloo(2, _dcp_run, str(tmp_path / "ckpt")):
        assert in_flight
        assert _equal(straight, resumed)


def test_a_wait_on_a_round_launched_in_an_earlier_step_is_exposed_time_of_the_step_that_waits():
    clock = iter([0.0, 1.0, 5.0])
    timer = StepTimer(clock=lambda: next(clock))
    record = timer.launched("payload all-gather", 8, 8, timer.mark())  # launched at 0 s
    launch_step = timer.take().resolve()
    start, end = timer.mark(), timer.mark()  # the next sync waits from 1 s to 5 s
    timer.waited(record, start, end)
    landing_step = timer.take().resolve()
    assert launch_step["exposed_s"] == 0.0 and landing_step["exposed_s"] == 4.0
