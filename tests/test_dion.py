"""Dion (data-parallel, arXiv 2504.05295) on real gloo groups (world 2 and 3) against a float64
simulation of every rank: replicas bit-identical, bytes per step from first principles, exact
resume, non-finite gradients and a GradScaler's inf on one rank, settings that differ, bad input,
a small regression and the study runner's "dion" method."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from distributed import run_gloo
from helpers import AGREEMENT_ROW, SmallNet, regression_data

from cokit.compress import Dion
from cokit.compress.dion import dion_step, orthonormalize
from cokit.compress.precision import LowPrecisionWarning

# a matrix, a conv weight (8 x 36 flattened), a norm weight and a bias (AdamW)
NAMES = ("body.weight", "conv.weight", "norm.weight", "head.bias")
SHAPES = [(24, 16), (8, 4, 3, 3), (16,), (5,)]
STEPS = 4
# name -> Dion keyword arguments
CONFIGS = {
    "rank3": dict(rank=3, mu=0.9, weight_decay=0.01),
    "fraction": dict(rank_fraction=0.5, lr=0.02),
    "dense_params": dict(rank=2, dense_params=("conv",), adamw_lr_ratio=0.5),
    "buckets": dict(rank=3, bucket_cap_mb=0.0005),  # 524 bytes: several buckets per phase
}
WORLD3 = ("rank3", "buckets")
DEFAULTS = dict(lr=0.01, mu=0.95, weight_decay=0.0, adamw_lr_ratio=0.1, betas=(0.9, 0.95), eps=1e-8)


def _grad(rank: int, step: int, i: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + i))


def _init() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def _build(params, **kwargs) -> Dion:
    return Dion(list(zip(NAMES, params, strict=True)), **{"timeout": 120, **kwargs})


# ----------------------------------------------------------------------------- workers


def _sim_configs(rank: int, world: int, names) -> dict:
    out = {}
    for name in names:
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _build(params, **CONFIGS[name])
        q0 = {n: opt.state[p]["Q"].clone() for n, p in enumerate(params) if "Q" in opt.state[p]}
        sent, dense = [], []
        for step in range(STEPS):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p.shape)
            opt.step()
            sent.append(opt.comm_stats.step_sent_bytes)
            dense.append(opt.comm_stats.step_dense_bytes)
        out[name] = {
            "params": [p.detach().clone() for p in params],
            "q0": q0,
            "ranks": opt.ranks,
            "sent": sent,
            "dense": dense,
            "bytes_per_step": opt.bytes_per_step,
            "momentum": opt.state[params[0]]["momentum_buffer"].clone(),
        }
    return out


def _run(me, params, start, stop, state=None, **kwargs):
    opt = _build(params, **kwargs)
    if state is not None:
        opt.load_state_dict(state)
    saved = None
    for step in range(start, stop):
        for i, p in enumerate(params):
            p.grad = _grad(me, step, i, p.shape)
        opt.step()
        if step + 1 == 3:
            saved = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    return opt, saved


def _resume(rank: int, world: int) -> dict:
    options = CONFIGS["rank3"]
    params = [torch.nn.Parameter(t) for t in _init()]
    opt, saved = _run(rank, params, 0, 6, **options)
    assert saved is not None
    state, values = saved
    again = [torch.nn.Parameter(v.clone()) for v in values]
    opt2, _ = _run(rank, again, 3, 6, state=state, **options)
    errors = {}
    # loading fails before anything changes: another rank's state, other settings
    other = _build([torch.nn.Parameter(t) for t in _init()], **options)
    before = copy.deepcopy(other.state_dict())
    foreign = copy.deepcopy(state)
    g0 = foreign["param_groups"][0]
    g0[f"dion_rank{1 - rank}"] = g0.pop(f"dion_rank{rank}")  # (world 2)
    for n in foreign["state"]:
        key = f"momentum_buffer_rank{rank}"
        if key in foreign["state"][n]:
            foreign["state"][n][f"momentum_buffer_rank{1 - rank}"] = foreign["state"][n].pop(key)
    for label, sd, opt_ in (
        ("rank", foreign, other),
        ("settings", state, _build([torch.nn.Parameter(t) for t in _init()], rank=2)),
    ):
        try:
            opt_.load_state_dict(sd)
        except ValueError as exc:
            errors[label] = str(exc)
    after = other.state_dict()
    unchanged = all(
        torch.equal(before["state"][n][k], after["state"][n][k])
        for n in before["state"]
        for k in before["state"][n]
    )
    return {
        "final": [p.detach().clone() for p in params],
        "resumed": [p.detach().clone() for p in again],
        "sent": (opt.comm_stats.total_sent_bytes, opt2.comm_stats.total_sent_bytes),
        "steps": (opt._steps, opt2._steps),
        "state": state,
        "errors": errors,
        "unchanged": unchanged,
    }


def _regression(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    opt = Dion(model.parameters(), lr=0.02, rank=8, adamw_lr_ratio=0.3, timeout=120)
    losses = []
    for _ in range(120):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def _runner(rank: int, world: int) -> dict:
    from cokit.train import MethodSpec, build_method

    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank, 32)
    method = build_method(MethodSpec("dion", lr=0.02, weight_decay=0.01, options={"rank": 4}), model)
    opt = method.optimizer
    counts = []
    for _ in range(3):
        method.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        counts.append(method.step())
    return {
        "counts": counts,
        "type": type(opt).__name__,
        "ranks": opt.ranks,  # type: ignore[attr-defined]
        "lr": opt.param_groups[0]["lr"],
        "wd": opt.param_groups[0]["weight_decay"],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _faults(rank: int, world: int) -> dict:
    out: dict = {}
    bad_rank = world - 1
    for mode in ("error", "skip"):
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _build(params, rank=3, nonfinite=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                for i, p in enumerate(params):
                    p.grad = _grad(rank, step, i, p.shape)
                    if rank == bad_rank and step == 1 and i == 1:
                        p.grad[2, 1, 0, 0] = math.nan
                before = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
                try:
                    opt.step()
                except FloatingPointError as exc:
                    out[f"{mode} message"] = str(exc)
        after = ([p.detach().clone() for p in params], opt.state_dict())
        out[f"{mode} params same"] = all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
        out[f"{mode} state same"] = all(
            torch.equal(before[1]["state"][n][k], after[1]["state"][n][k])
            for n in before[1]["state"]
            for k in before[1]["state"][n]
        )
        out[f"{mode} counts"] = (opt._steps, opt.skipped_steps)
        out[f"{mode} warnings"] = [str(w.message) for w in caught if "skipped a step" in str(w.message)]
        if mode == "skip":  # the next step goes on normally
            for i, p in enumerate(params):
                p.grad = _grad(rank, 2, i, p.shape)
            opt.step()
            out["skip then"] = ([p.detach().clone() for p in params], opt._steps)
    # a GradScaler's inf on one rank skips the step on every rank; else it steps as unscaled
    results = {}
    for inf in (False, True):
        torch.manual_seed(0)
        model = SmallNet()
        x, y = regression_data(rank, 32)
        opt = Dion(model.parameters(), rank=4, timeout=120)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if inf and rank == bad_rank:
            model.a.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        results[inf] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "before": before,
            "counts": (opt._steps, opt.skipped_steps),
        }
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank, 32)
    opt = Dion(model.parameters(), rank=4, timeout=120)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    results["plain"] = [p.detach().clone() for p in model.parameters()]
    out["scaler"] = results
    # settings that differ at a step; different starting weights
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _build(params, rank=3, mu=0.9 if rank == bad_rank else 0.95)
    for i, p in enumerate(params):
        p.grad = _grad(rank, 0, i, p.shape)
    try:
        opt.step()
    except ValueError as exc:
        out["mu"] = str(exc)
    params = [torch.nn.Parameter(t + (rank == bad_rank)) for t in _init()]
    opt = _build(params, rank=3)
    for i, p in enumerate(params):
        p.grad = _grad(rank, 0, i, p.shape)
    try:
        opt.step()
    except ValueError as exc:
        out["weights"] = str(exc)
    return out


def _world2(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    return {
        "sim": _sim_configs(rank, world, list(CONFIGS)),
        "resume": _resume(rank, world),
        "regression": _regression(rank, world),
        "runner": _runner(rank, world),
        "faults": _faults(rank, world),
    }


def _world3(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    return {"sim": _sim_configs(rank, world, WORLD3), "faults": _faults(rank, world)}


@pytest.fixture(scope="module")
def world2():
    return run_gloo(2, _world2)


@pytest.fixture(scope="module")
def world3():
    return run_gloo(3, _world3)


# ----------------------------------------------------------------------------- float64 simulation


def _rank_of(shape, options) -> int:
    m, n = shape[0], math.prod(shape[1:])
    if len(shape) < 2 or m < 2 or n < 2:
        return 0
    if options.get("rank") is not None:
        return min(options["rank"], m, n)
    return max(1, min(math.ceil(options.get("rank_fraction", 0.25) * min(m, n)), m, n))


def _simulate(world: int, options: dict, q0: dict) -> list[torch.Tensor]:
    """Every rank's Dion (matrices) / averaged AdamW (the rest) steps in float64."""
    hp = {**DEFAULTS, **{k: v for k, v in options.items() if k in DEFAULTS}}
    lr, mu, wd, ratio = hp["lr"], hp["mu"], hp["weight_decay"], hp["adamw_lr_ratio"]
    b1, b2 = hp["betas"]
    forced = [any(s in name for s in options.get("dense_params", ())) for name in NAMES]
    ranks = [0 if f else _rank_of(s, options) for s, f in zip(SHAPES, forced, strict=True)]
    x = [t.double() for t in _init()]
    momenta = [
        [torch.zeros(s[0], math.prod(s[1:]), dtype=torch.float64) for s in SHAPES] for _ in range(world)
    ]
    qs = {i: q0[i].double() for i, r in enumerate(ranks) if r}
    adam = [(torch.zeros(s, dtype=torch.float64), torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    for step in range(STEPS):
        for i, shape in enumerate(SHAPES):
            grads = [_grad(r, step, i, shape).double() for r in range(world)]
            if ranks[i]:
                bs = [momenta[r][i] + grads[r].reshape(shape[0], -1) for r in range(world)]
                p = sum(b @ qs[i] for b in bs) / world
                p = torch.linalg.qr(p).Q
                rr = sum(b.T @ p for b in bs) / world
                for r in range(world):
                    momenta[r][i] = bs[r] - (1 - mu) * p @ rr.T
                qs[i] = rr / rr.norm(dim=0, keepdim=True).clamp_min(1e-8)
                m, n = bs[0].shape
                x[i] = x[i] * (1 - lr * wd) - lr * math.sqrt(m / n) * (p @ qs[i].T).reshape(shape)
            else:
                g = sum(grads) / world
                a_lr, (ea, eq) = lr * ratio, adam[i]
                ea.mul_(b1).add_(g, alpha=1 - b1)
                eq.mul_(b2).add_(g * g, alpha=1 - b2)
                t = step + 1
                denom = eq.sqrt() / math.sqrt(1 - b2**t) + hp["eps"]
                x[i] = x[i] * (1 - a_lr * wd) - a_lr / (1 - b1**t) * ea / denom
    return x


def _ring(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def _buckets(sizes: list[int], cap: int) -> list[int]:
    """Bytes of each bucket: consecutive fp32 tensors, at most ``cap`` bytes (one alone may be more)."""
    out: list[int] = []
    used = cap
    for numel in sizes:
        if used + 4 * numel > cap or not out:
            out.append(0)
            used = 0
        out[-1] += 4 * numel
        used += 4 * numel
    return out


def _expected_sent(world: int, options: dict) -> list[int]:
    """Bytes per step from first principles: the status row, at the first step the parameter
    check (a float64 sum per parameter, all-gathered), then per bucket a ring all-reduce of the
    fp32 P's (m r each), one of the R's (n r) and one of the other parameters' gradients."""
    forced = [any(s in name for s in options.get("dense_params", ())) for name in NAMES]
    ranks = [0 if f else _rank_of(s, options) for s, f in zip(SHAPES, forced, strict=True)]
    cap = int(options.get("bucket_cap_mb", 25.0) * 2**20)
    mats = [(s[0], math.prod(s[1:]), r) for s, r in zip(SHAPES, ranks, strict=True) if r]
    rest = [math.prod(s) for s, r in zip(SHAPES, ranks, strict=True) if not r]
    payload = sum(
        _ring(b, world)
        for sizes in ([m * r for m, _, r in mats], [n * r for _, n, r in mats], rest)
        for b in _buckets(sizes, cap)
    )
    sent = [(world - 1) * AGREEMENT_ROW + payload] * STEPS
    sent[0] += (world - 1) * 8 * len(SHAPES)
    return sent


# ----------------------------------------------------------------------------- tests


def _check_against_simulation(results, world, names):
    for name in names:
        options = CONFIGS[name]
        first = results[0]["sim"][name]
        want = _simulate(world, options, first["q0"])
        expected = _expected_sent(world, options)
        for res in results:
            got = res["sim"][name]
            for n, q in got["q0"].items():  # the starting Q: orthonormal, alike on every rank
                assert torch.equal(q, first["q0"][n])
                torch.testing.assert_close(q.T @ q, torch.eye(q.shape[1]), atol=1e-5, rtol=0)
            for i, (a, b) in enumerate(zip(got["params"], first["params"], strict=True)):
                assert torch.equal(a, b), f"{name}: ranks differ in param {i}"
            for i, (a, b) in enumerate(zip(got["params"], want, strict=True)):
                torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=f"{name} param {i}")
            assert got["sent"] == expected, name
            assert got["bytes_per_step"] == sum(expected) / STEPS
            assert got["dense"] == [_ring(4 * sum(math.prod(s) for s in SHAPES), world)] * STEPS
        # the momentum (error feedback) is each rank's own
        assert not torch.equal(results[0]["sim"][name]["momentum"], results[1]["sim"][name]["momentum"])


@pytest.mark.distributed
def test_world2_matches_a_float64_simulation_and_counts_bytes(world2):
    assert world2[0]["sim"]["rank3"]["ranks"] == [3, 3, 0, 0]
    assert world2[0]["sim"]["fraction"]["ranks"] == [8, 4, 0, 0]
    assert world2[0]["sim"]["dense_params"]["ranks"] == [2, 0, 0, 0]
    _check_against_simulation(world2, 2, list(CONFIGS))


@pytest.mark.distributed
def test_world3_matches_a_float64_simulation_and_counts_bytes(world3):
    _check_against_simulation(world3, 3, WORLD3)


@pytest.mark.distributed
def test_resume_is_exact_and_bad_loads_change_nothing(world2):
    for rank, res in enumerate(world2):
        r = res["resume"]
        for a, b in zip(r["resumed"], r["final"], strict=True):
            assert torch.equal(a, b)
        # comm_stats resumed too; the first step after the load compares the replicas again:
        # the weights and the replicated state (Q, AdamW's moments and steps), one float64 sum
        # each, all-gathered
        replicated = sum(
            k in ("Q", "step", "exp_avg", "exp_avg_sq") for e in r["state"]["state"].values() for k in e
        )
        assert r["sent"][1] - r["sent"][0] == (len(world2) - 1) * 8 * (len(SHAPES) + replicated)
        assert r["steps"] == (6, 6)
        assert (
            f"the state holds the records of rank(s) [{1 - rank}], this is rank {rank}" in r["errors"]["rank"]
        )
        assert "setting 'rank' was 3, is 2 now" in r["errors"]["settings"]
        assert r["unchanged"]
    # a world-2 state in a single process (world 1): refused before anything changes
    opt = _build([torch.nn.Parameter(t) for t in _init()], **CONFIGS["rank3"])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="the state was saved at world size 2, this run has world size 1"):
        opt.load_state_dict(world2[0]["resume"]["state"])
    after = opt.state_dict()
    for n in before["state"]:
        for k in before["state"][n]:
            assert torch.equal(before["state"][n][k], after["state"][n][k])


@pytest.mark.distributed
def test_nonfinite_gradient_on_one_rank_raises_or_skips_on_every_rank(world2, world3):
    for results, world in ((world2, 2), (world3, 3)):
        for res in results:
            f = res["faults"]
            msg = f["error message"]
            assert "non-finite gradient in 'conv.weight' (8, 4, 3, 3)" in msg
            assert f"on rank {world - 1}" in msg and "no parameter and no buffer changed" in msg
            assert f["error params same"] and f["error state same"]
            assert f["error counts"] == (1, 0)
            assert f["skip params same"] and f["skip state same"]
            assert f["skip counts"] == (1, 1)
            assert len(f["skip warnings"]) == 1
            assert "skip message" not in f
            for a, b in zip(f["skip then"][0], results[0]["faults"]["skip then"][0], strict=True):
                assert torch.equal(a, b)
            assert f["skip then"][1] == 2
            assert "setting 'mu' is 0.95 on rank" in f["mu"]
            assert "differs between the ranks at the first step" in f["weights"]


@pytest.mark.distributed
def test_a_grad_scalers_inf_on_one_rank_skips_everywhere(world2):
    for res in world2:
        s = res["faults"]["scaler"]
        assert s[True]["counts"] == (0, 1)
        for a, b in zip(s[True]["params"], s[True]["before"], strict=True):
            assert torch.equal(a, b)
        assert s[False]["counts"] == (1, 0)
        for a, b in zip(s[False]["params"], s["plain"], strict=True):  # unscaled: the plain step
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_regression_trains_to_a_low_loss_at_world2(world2):
    for res in world2:
        losses = res["regression"]["losses"]
        assert losses[-1] < 0.02 * losses[0], (losses[0], losses[-1])
    for a, b in zip(world2[0]["regression"]["params"], world2[1]["regression"]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.distributed
def test_the_study_runner_builds_and_steps_dion(world2):
    first = world2[0]["runner"]
    # SmallNet: a.weight 130 x 24 (rank 4), the rest AdamW
    assert first["type"] == "Dion" and first["ranks"] == [4, 0, 0, 0, 0, 0]
    assert first["lr"] == 0.02 and first["wd"] == 0.01
    numel = 130 * 24 + 130 + 130 + 130 + 130 + 1
    payload = _ring(4 * 130 * 4, 2) + _ring(4 * 24 * 4, 2) + _ring(4 * (numel - 130 * 24), 2)
    sent = [AGREEMENT_ROW + payload] * 3
    sent[0] += 8 * 6
    for res in world2:
        assert [c[0] for c in res["runner"]["counts"]] == sent
        assert all(c[1] == _ring(4 * numel, 2) for c in res["runner"]["counts"])
        for a, b in zip(res["runner"]["params"], first["params"], strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- single process


def test_dion_step_alone_is_the_algorithm_in_one_process():
    torch.manual_seed(1)
    x = torch.randn(6, 10)
    g = torch.randn(6, 10)
    m = torch.zeros(6, 10)
    q = orthonormalize(torch.randn(10, 3))
    x0, q0 = x.clone(), q.clone()
    dion_step([x], [g], [m], [q], lr=0.1, mu=0.9, weight_decay=0.5)
    p = torch.linalg.qr((g @ q0).double()).Q
    r = g.double().T @ p
    q1 = r / r.norm(dim=0, keepdim=True)
    torch.testing.assert_close(m.double(), g.double() - 0.1 * p @ r.T)
    torch.testing.assert_close(q.double(), q1)
    want = x0.double() * (1 - 0.05) - 0.1 * math.sqrt(6 / 10) * p @ q1.T
    torch.testing.assert_close(x.double(), want)


def test_a_zero_gradient_gives_no_nan():
    x = torch.nn.Parameter(torch.ones(4, 6))
    opt = Dion([x], rank=2)
    x.grad = torch.zeros(4, 6)
    opt.step()
    assert torch.isfinite(x).all() and torch.isfinite(opt.state[x]["Q"]).all()


def _dtensor(monkeypatch):
    monkeypatch.setattr("cokit.compress.named_params.is_dtensor", lambda t: True)
    return [torch.nn.Parameter(torch.randn(4, 4))]


BAD = {
    "rank 0": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(rank=0),
        ValueError,
        "rank must be an integer >= 1",
    ),
    "rank float": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(rank=2.5),
        ValueError,
        "rank must be an integer",
    ),
    "fraction 0": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(rank_fraction=0.0),
        ValueError,
        r"rank_fraction must be a finite number in \(0.0, 1.0\]",
    ),
    "fraction 1.5": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(rank_fraction=1.5),
        ValueError,
        "rank_fraction",
    ),
    "mu 1": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(mu=1.0),
        ValueError,
        r"mu must be a finite number in \[0.0, 1.0\)",
    ),
    "mu negative": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(mu=-0.1),
        ValueError,
        "mu must be",
    ),
    "lr 0": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(lr=0.0),
        ValueError,
        "lr must be a finite number > 0.0",
    ),
    "lr negative": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(lr=-1.0),
        ValueError,
        "lr must be",
    ),
    "weight decay": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(weight_decay=-1.0),
        ValueError,
        "weight_decay",
    ),
    "nonfinite": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(nonfinite="ignore"),
        ValueError,
        "nonfinite must be one of",
    ),
    "int params": (
        lambda mp: [torch.zeros(4, 4, dtype=torch.int64)],
        {},
        TypeError,
        "float32, float16 and bfloat16",
    ),
    "float64 params": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))],
        {},
        TypeError,
        "float32, float16 and bfloat16",
    ),
    "dtensor": (_dtensor, {}, TypeError, "DTensor"),
    "duplicate": (
        lambda mp: [p := torch.nn.Parameter(torch.randn(4, 4)), p],
        {},
        ValueError,
        "more than once",
    ),
    "empty": (lambda mp: [], {}, ValueError, "empty parameter list"),
    "a tensor": (lambda mp: torch.nn.Parameter(torch.randn(4, 4)), {}, TypeError, "got a tensor"),
    "dense_params str": (
        lambda mp: [("w", torch.nn.Parameter(torch.randn(4, 4)))],
        dict(dense_params="w"),
        TypeError,
        r"write \('w',\)",
    ),
    "dense_params unmatched": (
        lambda mp: [("w", torch.nn.Parameter(torch.randn(4, 4)))],
        dict(dense_params=("embed",)),
        ValueError,
        "matches no parameter name",
    ),
    "dense_params unnamed": (
        lambda mp: [torch.nn.Parameter(torch.randn(4, 4))],
        dict(dense_params=("w",)),
        ValueError,
        "named_parameters",
    ),
    "group lr": (
        lambda mp: [{"params": [torch.nn.Parameter(torch.randn(4, 4))], "lr": -1.0}],
        {},
        ValueError,
        "param group 0: lr must be",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_a_clear_error(case, monkeypatch):
    make, kwargs, kind, match = BAD[case]
    with pytest.raises(kind, match=match):
        Dion(make(monkeypatch), **kwargs)


def test_a_bad_scheduled_lr_raises_before_anything_changes():
    x = torch.nn.Parameter(torch.randn(4, 6))
    opt = Dion([x], rank=2)
    x.grad = torch.randn(4, 6)
    before = x.detach().clone()
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="param group 0: lr must be a finite number"):
        opt.step()
    assert torch.equal(x, before) and opt.comm_stats.steps == 0


def test_a_damaged_or_foreign_state_is_refused():
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _build(params, rank=3)
    for i, p in enumerate(params):
        p.grad = _grad(0, 0, i, p.shape)
    opt.step()
    good = opt.state_dict()
    fresh = _build([torch.nn.Parameter(t) for t in _init()], rank=3)
    bad = copy.deepcopy(good)
    bad["state"][0]["Q"][0, 0] = math.nan
    with pytest.raises(ValueError, match=r"Q of 'body\.weight' \(24, 16\) is not finite"):
        fresh.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["state"][1]["Q"] = torch.zeros(36, 2)
    with pytest.raises(
        ValueError, match=r"Q of 'conv\.weight' \(8, 4, 3, 3\) has shape \(36, 2\), expected \(36, 3\)"
    ):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="not a Dion state_dict"):
        fresh.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="no readable 'dion' record"):
        fresh.load_state_dict(torch.optim.SGD(params, lr=0.1).state_dict())
    fewer = Dion(list(zip(NAMES[:2], params[:2], strict=True)), rank=3)
    with pytest.raises(ValueError, match="param group 0 has 4 parameters in the checkpoint, 2 here"):
        fewer.load_state_dict(good)
    # as many parameters, but the norm weight a matrix: Dion's instead of AdamW's
    other = _build([torch.nn.Parameter(t) for t in [*_init()[:2], torch.randn(4, 4), _init()[3]]], rank=3)
    with pytest.raises(
        ValueError, match=r"per-parameter ranks are \[3, 3, 0, 0\], this optimizer's \[3, 3, 3, 0\]"
    ):
        other.load_state_dict(good)
    assert fresh.comm_stats.steps == 0 and fresh._steps == 0
    fresh.load_state_dict(good)  # the good one loads
    assert fresh._steps == 1 and torch.equal(
        fresh.state[fresh._model_params[0]]["Q"], opt.state[params[0]]["Q"]
    )


def test_low_precision_parameters_step_in_fp32_and_warn():
    torch.manual_seed(0)
    x = torch.nn.Parameter(torch.randn(6, 10).bfloat16())
    b = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    with pytest.warns(LowPrecisionWarning, match="Dion: 2 of 2 parameters are bfloat16/float16"):
        opt = Dion([x, b], lr=0.1, rank=2)
    assert opt.state[x]["momentum_buffer"].dtype == torch.float32
    x.grad, b.grad = torch.randn(6, 10).bfloat16(), torch.randn(6).half()
    before = x.detach().clone()
    opt.step()
    assert x.dtype == torch.bfloat16 and b.dtype == torch.float16
    assert not torch.equal(x, before) and torch.isfinite(x.float()).all() and b.abs().sum() > 0
