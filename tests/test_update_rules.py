"""DeMo's inner update rules and precision modes (quality beyond sign and fp32) on real gloo groups.

Each rule against a float64 simulation, replicas bit-identical, exact resume, a regression
that trains with every rule, bf16 parameters with a master copy or stochastic rounding, and
bad settings rejected before anything changes.
"""

from __future__ import annotations

import copy
import os
import warnings

import demo_simulation as sim
import pytest
import torch
from distributed import run_gloo
from helpers import SmallNet, regression_data

from cokit.compress import DeMo, rules
from cokit.compress.precision import LowPrecisionWarning

RULES = rules.UPDATE_RULES
SHAPES = [(32, 48), (48,), (24, 40), (7,), (16, 3, 3, 3), (40, 8)]
LR, BETA, CHUNK, K, WD = 0.01, 0.9, 16, 4, 0.1
STEPS = 4
SETTINGS = dict(lr=LR, compression_decay=BETA, compression_topk=K, compression_chunk=CHUNK, weight_decay=WD)


def _torch_path() -> None:
    """In rank processes only: kernels take the torch path (tests use monkeypatch)."""
    os.environ["TRITON_INTERPRET"] = "0"


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _world2(rank: int, world: int) -> dict:
    """Every world-2 check in one group (one spawn): the ranks disagreeing comes last."""
    return {
        "sim": _rule_steps(rank, world),
        "train": _trains_and_resumes(rank, world),
        "precision": _precision_runs(rank, world),
        "mismatch": _rule_mismatch(rank, world),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_gloo(2, _world2)


# ----------------------------------------------------------------------------- float64 simulation


def _rule_steps(rank: int, world: int):
    """Every rule for STEPS steps of synthetic gradients; reference payload, dense fallback on
    (the small tensors go dense), so both decode paths run."""
    _torch_path()
    out = {}
    for rule in RULES:
        params = _params()
        opt = DeMo(params, **SETTINGS, payload="reference", dense_fallback=True, update_rule=rule)
        for step in range(STEPS):
            for p, g in zip(params, _grads(rank, step), strict=True):
                p.grad = g
            opt.step()
        entries = opt.plan.entries()
        dense = [False] * len(entries)
        for b in opt.plan.buckets(entries):
            for i in b.members:
                dense[i] = b.dense
        out[rule] = {
            "params": [p.detach().clone() for p in params],
            "deltas": [opt.state[p]["delta"].clone() for p in params],
            "v": [opt.state[p]["v"].clone() if "v" in opt.state[p] else None for p in params],
            "dense": dense,
        }
    return out


def _simulate(rule: str, world: int, dense: list[bool]):
    """float64: every rank's encode (independent DCT/top-k), the mean over ranks, the rule."""
    params = [p.detach().double() for p in _params()]
    deltas = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
    vs: list[torch.Tensor | None] = [None] * len(SHAPES)
    fragile = [torch.zeros(s, dtype=torch.bool) for s in SHAPES]  # where |u| ~ 0 (sign-like rules)
    for step in range(STEPS):
        grads = [_grads(r, step) for r in range(world)]
        for i, shape in enumerate(SHAPES):
            if dense[i]:
                bufs = [BETA * deltas[r][i] + LR * grads[r][i].double() for r in range(world)]
                u = torch.stack(bufs).mean(0)
                for r in range(world):
                    deltas[r][i] = torch.zeros_like(bufs[r])  # alpha = 1: everything was sent
            else:
                payloads = []
                for r in range(world):
                    deltas[r][i], pl = sim.encode(deltas[r][i], grads[r][i], BETA, LR, CHUNK, K)
                    payloads.append(pl)
                u = sim.decode(shape, payloads, CHUNK)
            resolved = rules.effective_rule(rule, "adam", shape)
            update, vs[i] = rules.reference_update(resolved, u, vs[i], step + 1)
            if resolved in ("sign", "adam"):
                fragile[i] |= u.abs() < 1e-4 * u.abs().max()
            params[i] = params[i] * (1 - LR * WD) - LR * update
    return params, deltas, vs, fragile


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_every_rule_matches_a_float64_simulation_and_ranks_stay_identical(world, request):
    if world == 2:
        results = [r["sim"] for r in request.getfixturevalue("world2")]
    else:
        results = run_gloo(world, _rule_steps)
    for rule in RULES:
        got = results[0][rule]
        assert any(got["dense"]) and not all(got["dense"]), got["dense"]  # both decode paths
        params, deltas, vs, fragile = _simulate(rule, world, got["dense"])
        for r in range(world):
            for i, shape in enumerate(SHAPES):
                mine = results[r][rule]
                assert torch.equal(mine["params"][i], got["params"][i]), (rule, r, shape)
                assert torch.allclose(mine["deltas"][i].double(), deltas[r][i], atol=1e-6, rtol=1e-5)
        for i, shape in enumerate(SHAPES):
            err = (got["params"][i].double() - params[i]).abs()
            tol = 2e-6 + 1e-5 * params[i].abs()
            wrong = (err > tol) & ~fragile[i]
            assert not wrong.any(), (rule, shape, err.max().item())
            assert fragile[i].float().mean() < 0.05, (rule, shape)  # the check is not vacuous
            if vs[i] is not None:
                assert got["v"][i] is not None
                assert torch.allclose(got["v"][i].double(), vs[i], rtol=1e-4, atol=1e-14), (rule, shape)
            else:
                assert got["v"][i] is None, (rule, shape)


def test_rule_functions_match_their_float64_reference():
    g = torch.Generator().manual_seed(3)
    for shape in [(32, 48), (48, 32), (16, 3, 3, 3)]:
        u = torch.randn(shape, generator=g) * 1e-3
        ns = rules.newton_schulz(u, 5) * rules.ns_scale(u.shape)
        ref, _ = rules.reference_update("newton_schulz", u.double(), ns_steps=5)
        assert torch.allclose(ns.double(), ref, rtol=1e-4, atol=1e-6)
        # orthogonalized: the singular values sit in Muon's band around 1
        sv = torch.linalg.svdvals(rules.newton_schulz(u, 5).reshape(shape[0], -1))
        assert sv.min() > 0.6 and sv.max() < 1.25, sv
        assert torch.allclose(rules.rms_update(u).square().mean(), torch.tensor(1.0), rtol=1e-5)
    zero = torch.zeros(8, 4)
    for rule in RULES:
        state: dict = {}
        group = {**rules.RULE_DEFAULTS, "update_rule": rule}
        update = rules.apply_rule(zero, state, group)
        assert torch.equal(update, torch.zeros_like(zero)), rule  # zero direction: no update, no NaN


# ----------------------------------------------------------------------------- training, resume


def _train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


TRAIN_LR = {"sign": 1e-2, "rms": 1e-2, "adam": 1e-2, "newton_schulz": 2e-2}


def _trains_and_resumes(rank: int, world: int):
    _torch_path()
    x, y = regression_data(rank, 128)
    out = {}
    for rule in RULES:
        torch.manual_seed(0)
        model = SmallNet()
        kwargs = dict(lr=TRAIN_LR[rule], compression_topk=8, update_rule=rule)
        opt = DeMo(model.named_parameters(), **kwargs)
        losses = _train(model, opt, x, y, 60)
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        _train(model, opt, x, y, 3)
        resumed = SmallNet()
        resumed.load_state_dict(saved_model)
        opt2 = DeMo(resumed.named_parameters(), **kwargs)
        opt2.load_state_dict(saved_opt)
        _train(resumed, opt2, x, y, 3)
        keys = sorted({k for entry in saved_opt["state"].values() for k in entry})
        out[rule] = {
            "losses": losses,
            "params": [p.detach().clone() for p in model.parameters()],
            "resume_exact": all(
                torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
            ),
            "state_keys": keys,
        }
    return out


@pytest.mark.distributed
def test_every_rule_trains_a_regression_ranks_agree_and_resume_is_exact(world2):
    results = [r["train"] for r in world2]
    for rule in RULES:
        got = results[0][rule]
        losses = got["losses"]
        assert losses[-1] < 0.05 * losses[0], (rule, losses[::10])
        assert got["resume_exact"] and results[1][rule]["resume_exact"], rule
        for a, b in zip(got["params"], results[1][rule]["params"], strict=True):
            assert torch.equal(a, b), rule
        expected = {"delta_rank0"} | ({"rule_step", "v"} if rule in ("adam", "newton_schulz") else set())
        assert set(got["state_keys"]) == expected, (rule, got["state_keys"])


# ----------------------------------------------------------------------------- precision


def _synthetic_runs(rank: int) -> dict[str, list[torch.Tensor]]:
    """fp32 and bf16 parameters from the same start under the same synthetic gradients (they do
    not depend on the weights, and bf16 holds them exactly): the runs differ only by how the
    weights are stored."""
    out = {}
    for name, dtype, precision in [
        ("fp32", torch.float32, "nearest"),
        ("master", torch.bfloat16, "master"),
        ("nearest", torch.bfloat16, "nearest"),
    ]:
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _bf16_start()]
        # no dense fallback: a dense bucket travels in the parameters' dtype (bf16 here)
        opt = DeMo(
            params, **{**SETTINGS, "lr": 1e-3}, update_rule="rms", precision=precision, dense_fallback=False
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LowPrecisionWarning)
            for step in range(8):
                for p, g in zip(params, _grads(rank, step), strict=True):
                    p.grad = g.bfloat16().to(dtype)  # the same gradient values in both runs
                opt.step()
        out[name] = [p.detach().double() for p in params]
        out[name + "_state"] = [opt.state[p]["master"].double() for p in params] if name == "master" else []
    return out


def _bf16_start() -> list[torch.Tensor]:
    """Initial weights that bf16 represents exactly (both runs start from the same point)."""
    return [p.detach().bfloat16().float() for p in _params()]


def _precision_runs(rank: int, world: int):
    _torch_path()
    x, y = regression_data(rank, 128)
    out: dict = {}
    for name, dtype, precision, rule in [
        ("fp32", torch.float32, "nearest", "rms"),
        ("master", torch.bfloat16, "master", "rms"),
        ("nearest", torch.bfloat16, "nearest", "rms"),
        ("stochastic", torch.bfloat16, "stochastic", "adam"),
    ]:
        torch.manual_seed(0)
        model = SmallNet().to(dtype)
        kwargs = dict(lr=3e-3, compression_topk=8, update_rule=rule, precision=precision, seed=5)
        opt = DeMo(model.named_parameters(), **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _train(model, opt, x.to(dtype), y, 20)
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        _train(model, opt, x.to(dtype), y, 3)
        resumed = SmallNet().to(dtype)
        resumed.load_state_dict(saved_model)
        opt2 = DeMo(resumed.named_parameters(), **kwargs)
        opt2.load_state_dict(saved_opt)
        _train(resumed, opt2, x.to(dtype), y, 3)
        out[name] = {
            "losses": losses,
            "params": [p.detach().clone() for p in model.parameters()],
            "masters": [opt.state[p].get("master") for p in model.parameters()],
            "warnings": sum(issubclass(w.category, LowPrecisionWarning) for w in caught),
            "resume_exact": all(
                torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
            ),
        }
    out["synthetic"] = _synthetic_runs(rank)  # after the warning counts: it warns once per process
    return out


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x.double() - y.double()).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5


@pytest.mark.distributed
def test_bf16_master_tracks_fp32_stochastic_keeps_replicas_identical_and_nearest_warns_once(world2):
    results = [r["precision"] for r in world2]
    runs = {k: v for k, v in results[0].items() if k != "synthetic"}
    for name, run in runs.items():  # every run is exact on resume and the same on both ranks
        assert run["resume_exact"], name
        for a, b in zip(run["params"], results[1][name]["params"], strict=True):
            assert torch.equal(a, b), name
        assert run["losses"][-1] < 0.7 * run["losses"][0], (name, run["losses"][::5])
    assert all(m is not None and m.dtype == torch.float32 for m in runs["master"]["masters"])
    assert all(m is None for m in runs["fp32"]["masters"] + runs["stochastic"]["masters"])
    assert runs["nearest"]["warnings"] == 1  # bf16 without a master: one warning, once
    assert runs["fp32"]["warnings"] == runs["master"]["warnings"] == runs["stochastic"]["warnings"] == 0
    # same start, same gradients: the master is the fp32 run, bit for bit, and the bf16
    # weights are its rounding; round-to-nearest loses the small updates
    syn = results[0]["synthetic"]
    assert all(torch.equal(m, p) for m, p in zip(syn["master_state"], syn["fp32"], strict=True))
    for p, m in zip(syn["master"], syn["master_state"], strict=True):
        assert torch.equal(p, m.to(torch.bfloat16).double())
    lost = [
        (n != f.to(torch.bfloat16).double()).double().mean().item()
        for n, f in zip(syn["nearest"], syn["fp32"], strict=True)
    ]
    assert min(lost) > 0.2, lost  # nearest: many weights miss where the fp32 run went


def test_master_copy_moves_bf16_weights_that_nearest_rounding_leaves_stuck(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path, for this test only
    for precision in ("nearest", "master", "stochastic"):
        w = torch.nn.Parameter(torch.full((8, 16), 1.0, dtype=torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LowPrecisionWarning)
            opt = DeMo([w], lr=1e-4, update_rule="rms", precision=precision, compression_topk=4)
            for _ in range(40):
                w.grad = torch.ones_like(w)
                opt.step()
        # 40 steps of 1e-4 = 0.004 (the bf16 spacing at 1.0 is 0.0078): nearest never moves
        mean = w.float().mean().item()
        if precision == "nearest":
            assert mean == 1.0
        else:
            assert 0.99 < mean < 0.999, (precision, mean)


@pytest.mark.parametrize("rule", RULES)
def test_bf16_gradients_work_with_every_rule_and_precision(rule, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path, for this test only
    for precision in ("nearest", "master", "stochastic"):
        params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _params()]
        start = [p.detach().clone() for p in params]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LowPrecisionWarning)
            opt = DeMo(params, **{**SETTINGS, "lr": 0.05}, update_rule=rule, precision=precision)
            for step in range(3):
                for p, g in zip(params, _grads(0, step), strict=True):
                    p.grad = g.bfloat16()
                opt.step()
        for p, p0 in zip(params, start, strict=True):
            assert p.dtype == torch.bfloat16 and torch.isfinite(p).all(), (rule, precision)
            assert not torch.equal(p, p0), (rule, precision, tuple(p.shape))


def test_damaged_rule_state_in_a_checkpoint_is_rejected_before_anything_changes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path, for this test only
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _params()]
    opt = DeMo(params, **SETTINGS, update_rule="adam", precision="master")
    for step in range(2):
        for p, g in zip(params, _grads(0, step), strict=True):
            p.grad = g.bfloat16()
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"delta_rank0", "v", "rule_step", "master"}
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    for key, value, match in [
        ("v", torch.zeros(3), r"'v' of .* has shape \(3,\)"),
        ("master", torch.full(SHAPES[0], float("nan")), "non-finite values"),
        ("rule_step", torch.tensor(0.5), "not a count"),
        ("v", torch.zeros(SHAPES[0], dtype=torch.int32), "not a float tensor"),
    ]:
        bad = copy.deepcopy(sd)
        bad["state"][0][key] = value
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert all(torch.equal(before[k], opt.state[params[0]][k]) for k in before)
    lone = copy.deepcopy(sd)
    del lone["state"][0]["rule_step"]
    with pytest.raises(ValueError, match="only one of 'v' and 'rule_step'"):
        opt.load_state_dict(lone)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(update_rule="lion"),
            "update_rule must be one of 'sign', 'rms', 'adam', 'newton_schulz', got 'lion'",
        ),
        (dict(update_rule=None), "update_rule must be one of"),
        (dict(rule_fallback="rms"), "rule_fallback .* must be one of 'sign', 'adam'"),
        (dict(rule_beta2=1.0), r"rule_beta2 must be a finite number in \[0, 1\)"),
        (dict(rule_beta2=float("nan")), "rule_beta2"),
        (dict(rule_eps=0.0), "rule_eps must be a finite number > 0"),
        (dict(rule_eps="1e-8"), "rule_eps"),
        (dict(ns_steps=0), "ns_steps must be an integer >= 1"),
        (dict(ns_steps=101), r"ns_steps must be an integer in \[1, 100\]"),
        (dict(ns_steps=True), "ns_steps"),
        (dict(ns_steps=2.5), "ns_steps"),
        (dict(precision="fp8"), "nearest.*master.*stochastic"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_rule_and_precision_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeMo([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_a_bad_group_rule_is_rejected_and_nothing_changes():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    opt = DeMo([w], update_rule="adam")
    before = copy.deepcopy(opt.param_groups[0]["update_rule"]), len(opt.param_groups)
    with pytest.raises(ValueError, match="param group 1: update_rule must be one of"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "update_rule": "Adam"})
    assert (opt.param_groups[0]["update_rule"], len(opt.param_groups)) == before
    # a rule set on one group only is that group's rule
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "update_rule": "rms"})
    assert [g["update_rule"] for g in opt.param_groups] == ["adam", "rms"]


def _rule_mismatch(rank: int, world: int):
    _torch_path()
    params = _params()
    opt = DeMo(params, **SETTINGS, update_rule=("adam", "rms")[rank])
    for p, g in zip(params, _grads(rank, 0), strict=True):
        p.grad = g
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    except ValueError as exc:
        return str(exc), all(torch.equal(a, b) for a, b in zip(before, params, strict=True)), len(opt.state)
    return None, False, len(opt.state)


@pytest.mark.distributed
def test_ranks_with_different_rules_fail_together_naming_the_setting(world2):
    for message, unchanged, n_state in [r["mismatch"] for r in world2]:
        assert message is not None and "param group 0 setting 'update_rule'" in message, message
        assert "'adam' on rank [0], 'rms' on rank [1]" in message
        assert unchanged and n_state == 0
