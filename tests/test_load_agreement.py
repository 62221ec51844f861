"""Loads that used to be accepted silently: replicas that disagree after a load (DeMo,
SparseLoCo, Dion), and states that SparseLoCo took although DeMo and Dion refuse them (NaN lr,
negative second moments, missing or extra entries). World 2 and 3, real gloo groups.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from distributed import run_gloo

from cokit.compress import DeMo, Dion, SparseLoCo

SHAPES = [(32, 48), (64,), (5,)]
STEPS = 4  # one sync at H=3, then one local step: a state mid-period


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _grads(params, rank: int, step: int) -> None:
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _sparseloco(params, **kwargs) -> SparseLoCo:
    return SparseLoCo(params, sync_every=3, topk=8, chunk=16, timeout=120, **kwargs)


def _dion(params) -> Dion:
    return Dion(params, lr=0.01, rank=4, timeout=120)


def _trained(make, rank: int):
    params = _params()
    opt = make(params)
    for step in range(STEPS):
        _grads(params, rank, step)
        opt.step()
    return params, opt


def _replica_drift(rank: int, world: int, kind: str) -> str:
    """Save, shift one replicated tensor on the last rank only, load, step: the error, or ''."""
    make = {"sparseloco": _sparseloco, "nesterov": lambda ps: _sparseloco(ps, outer="nesterov", outer_lr=0.7)}
    make["dion"] = _dion
    params, opt = _trained(make[kind], rank)
    sd = copy.deepcopy(opt.state_dict())
    if rank == world - 1:
        entry = sd["state"][0]
        key = {"sparseloco": "global", "nesterov": "momentum", "dion": "Q"}[kind]
        if kind == "dion":
            entry = sd["state"][1]  # the 1-D weight: AdamW's moments, the same on every rank
            key = "exp_avg"
            entry[key] = entry[key] + 0.1
        else:
            entry[key] = entry[key] + 1e-3
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make[kind](fresh_params)
    fresh.load_state_dict(sd)
    before = [p.detach().clone() for p in fresh_params]
    _grads(fresh_params, rank, STEPS)
    try:
        fresh.step()
    except ValueError as exc:
        assert all(torch.equal(a, p) for a, p in zip(before, fresh_params, strict=True)), (
            "changed before raising"
        )
        return str(exc)
    return ""


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["sparseloco", "nesterov", "dion"])
def test_a_replica_that_loaded_other_replicated_state_raises_on_every_rank_before_anything_changes(
    world, kind
):
    messages = run_gloo(world, _replica_drift, kind)
    what = {"sparseloco": "parameter 'param 0'", "nesterov": "the outer momentum of 'param 0'"}
    what["dion"] = "exp_avg of 'param 1'"
    for message in messages:
        assert "differs between the ranks at the first step (or the first after a load)" in message, message
        assert what[kind] in message, message
        assert f"rank(s) [{world - 1}] hold other values than rank 0" in message, message


def _demo(params, **kwargs) -> DeMo:
    return DeMo(params, lr=1e-3, compression_topk=8, compression_chunk=16, timeout=120, **kwargs)


def _demo_drift(rank: int, world: int, where: str):
    """DeMo (the adam rule: ``v`` and ``rule_step`` are shared state; fp32 masters of bf16
    weights): save, load, with ``where`` shifted by 1e-3 on the last rank (the step count by 1;
    nothing: the same everywhere), step twice. The error and whether anything changed before
    it, or the weights and the bytes each step sent."""
    low = where == "master"
    params = _params()
    if low:
        params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    make = functools.partial(_demo, update_rule="adam", precision="master" if low else "nearest")
    opt = make(params)
    for step in range(STEPS):
        _grads(params, rank, step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    if rank == world - 1 and where != "nothing":
        if where == "parameter":
            with torch.no_grad():
                fresh_params[1] += 1e-3
        else:  # (a step count stays a count)
            sd["state"][0][where] = sd["state"][0][where] + (1 if where == "rule_step" else 1e-3)
    fresh = make(fresh_params)
    fresh.load_state_dict(sd)
    before = [p.detach().clone() for p in fresh_params]
    buffers = [t.clone() for s in fresh.state.values() for t in s.values()]
    sent = []
    try:
        for step in range(STEPS, STEPS + 2):
            _grads(fresh_params, rank, step)
            fresh.step()
            sent.append(fresh.comm_stats.step_sent_bytes)
    except ValueError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, fresh_params, strict=True))
        unchanged = unchanged and all(
            torch.equal(a, b)
            for a, b in zip(buffers, [t for s in fresh.state.values() for t in s.values()], strict=True)
        )
        return str(exc), unchanged
    return "", ([p.detach().clone() for p in fresh_params], sent)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("where", ["parameter", "v", "rule_step", "master"])
def test_demo_replicas_that_loaded_other_shared_state_raise_on_every_rank_before_anything_changes(
    world, where
):
    what = {
        "parameter": "parameter group 0 param 1 (64,)",
        "v": "the 'v' of group 0 param 0 (32, 48)",
        "rule_step": "the 'rule_step' of group 0 param 0 (32, 48)",
        "master": "the 'master' of group 0 param 0 (32, 48)",
    }[where]
    for message, unchanged in run_gloo(world, _demo_drift, where):
        assert "DeMo: " in message and what in message, message
        assert "differs between the ranks at the first step (or the first after a load)" in message, message
        assert f"rank(s) [{world - 1}] hold other values than rank 0" in message, message
        assert unchanged, "changed before raising"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_demo_replicas_that_loaded_the_same_state_train_on(world):
    results = run_gloo(world, _demo_drift, "nothing")
    for message, (weights, sent) in results:
        assert message == "", message
        for a, b in zip(weights, results[0][1][0], strict=True):
            assert torch.equal(a, b)  # DeMo's replicas stay bit-identical
        # the first step after the load also compares the replicas: one float64 sum per
        # parameter and per adam-rule buffer (v, rule_step), all-gathered; the next step does not
        assert sent[0] - sent[1] == (world - 1) * 8 * 3 * len(SHAPES)


def _edited(sd: dict, edit: str) -> dict:
    sd = copy.deepcopy(sd)
    rank_key = next(k for k in sd["state"][0] if str(k).startswith("error_rank"))
    if edit == "nan lr":
        sd["param_groups"][0]["lr"] = math.nan
    elif edit == "negative lr":
        sd["param_groups"][0]["lr"] = -0.1
    elif edit == "negative exp_avg_sq":
        key = next(k for k in sd["state"][1] if str(k).endswith("exp_avg_sq"))
        sd["state"][1][key] = -sd["state"][1][key].abs() - 1.0
    elif edit == "no global":
        del sd["state"][1]["global"]
    elif edit == "no error buffer":
        del sd["state"][0][rank_key]
    elif edit == "extra entry":
        sd["state"][7] = {"global": torch.zeros(3)}
    return sd


EDITS = {
    "nan lr": "lr=nan",
    "negative lr": "lr=-0.1 < 0",
    "negative exp_avg_sq": "exp_avg_sq of 'param 1' (64,) is negative",
    "no global": "lacks theta_global of 'param 1' (64,)",
    "no error buffer": "lacks this rank's error buffer of 'param 0' (32, 48)",
    "extra entry": "entries ['7'] that no saved param group lists",
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_sparseloco_refuses_a_damaged_state_before_anything_changes(edit):
    params, opt = _trained(lambda ps: _sparseloco(ps, inner=lambda g: torch.optim.AdamW(g, lr=1e-3)), 0)
    sd = _edited(opt.state_dict(), edit)
    fresh = _sparseloco(params, inner=lambda g: torch.optim.AdamW(g, lr=1e-3))
    state_before = copy.deepcopy(fresh.state_dict())
    weights = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="damaged") as info:
        fresh.load_state_dict(sd)
    assert EDITS[edit] in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(weights, params, strict=True))
    after = fresh.state_dict()
    assert after["param_groups"][0]["lr"] == state_before["param_groups"][0]["lr"]
    assert set(after["state"]) == set(state_before["state"])
