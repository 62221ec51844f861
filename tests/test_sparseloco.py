"""SparseLoCo / DiLoCo on real gloo groups (world 2 and 3) against a float64 simulation of every
rank: the outer steps, replicas bit-identical, local inner state, exact resume, byte counts
from first principles, non-finite pseudo-gradients, settings that differ, bad input."""

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
from helpers import STATUS_ROW, SmallNet, dcp_load, dcp_save, regression_data

from cokit.compress import SparseLoCo
from cokit.compress.agreement import PeerDataError
from cokit.compress.buckets import sends_dense
from cokit.compress.payload import PayloadCodec, get_codec
from cokit.compress.sparseloco_state import records
from cokit.triton_kernels import tiling
from cokit.triton_kernels.dct import dct_decode_reference, dct_encode_reference

SHAPES = [(32, 48), (64,), (5,)]  # a 2-D weight (6 tiles of 16x16), a 1-D one, a tiny bias (dense)
CHUNK, K, H, LR = 16, 8, 3, 0.05
DECAY = 0.95
# name -> SparseLoCo keyword arguments (topk=None: DiLoCo)
CONFIGS = {
    "int2": dict(payload="int2"),
    "int2-dct": dict(payload="int2", dct=True),
    "int2-nesterov": dict(payload="int2", outer="nesterov", outer_lr=0.7),
    "int2-dct-nesterov": dict(payload="int2", dct=True, outer="nesterov", outer_lr=0.7),
    "sign": dict(payload="sign", outer_lr=0.9),
    "sign-dct": dict(payload="sign", dct=True),
    "compact-nesterov": dict(payload="compact", outer="nesterov", outer_lr=0.7),
    "compact-dct": dict(payload="compact", dct=True),
    "dense": dict(topk=None),
    "dense-nesterov": dict(topk=None, outer="nesterov", outer_lr=0.7),
}
WORLD3 = ("int2-dct-nesterov", "sign", "dense-nesterov")


def _grad(rank: int, step: int, i: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + i))


def _init() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def _build(params, **kwargs) -> SparseLoCo:
    options = dict(sync_every=H, topk=K, chunk=CHUNK, error_decay=DECAY, timeout=120)
    options.update(kwargs)
    return SparseLoCo(params, lambda ps: torch.optim.SGD(ps, lr=LR), **options)


# ----------------------------------------------------------------------------- workers


def _sim_configs(rank: int, world: int, names) -> dict:
    out = {}
    for name in names:
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _build(params, **CONFIGS[name])
        snaps, sent = [], []
        for step in range(2 * H):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p.shape)
            opt.step()
            sent.append(opt.comm_stats.step_sent_bytes)
            if (step + 1) % H == 0:
                snaps.append([p.detach().clone() for p in params])
        out[name] = {"snaps": snaps, "sent": sent, "bytes_per_step": opt.bytes_per_step, "syncs": opt.syncs}
    return out


def _adamw_run(rank, params, steps, start=0, state=None, **kwargs):
    opt = SparseLoCo(
        params, lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_every=H, topk=K, chunk=CHUNK, **kwargs
    )
    if state is not None:
        opt.load_state_dict(state)
    saved = {}
    for step in range(start, steps):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        opt.step()
        if step + 1 in (4, 6):
            saved[step + 1] = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    return opt, saved


def _resume(rank: int, world: int) -> dict:
    params = [torch.nn.Parameter(t) for t in _init()]
    opt, saved = _adamw_run(rank, params, 9, dct=True)
    final = [p.detach().clone() for p in params]
    resumed = {}
    for at, (state, values) in saved.items():  # 4: mid-period, 6: right after a sync
        again = [torch.nn.Parameter(v.clone()) for v in values]
        opt2, _ = _adamw_run(rank, again, 9, start=at, state=state, dct=True)
        resumed[at] = ([p.detach().clone() for p in again], opt2.comm_stats.total_sent_bytes)
    exp_avg = opt.inner.state[params[0]]["exp_avg"].clone()
    return {
        "final": final,
        "resumed": resumed,
        "sent": opt.comm_stats.total_sent_bytes,
        "exp_avg": exp_avg,
        "error": opt.state[params[0]]["error"].clone(),
        "since_sync": {at: records(s[0])["common"]["counters"]["since_sync"] for at, s in saved.items()},
    }


def _regression(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    opt = SparseLoCo(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=3e-3), sync_every=5, timeout=120)
    losses = []
    for _ in range(150):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "bps": opt.bytes_per_step,
    }


def _faults(rank: int, world: int) -> dict:
    out: dict = {}
    bad_rank = world - 1
    # an inf gradient (kind "grad") poisons the inner AdamW; a local weight and inner state that
    # went non-finite some other way ("overflow": a bad kernel, an edit) do the same: the
    # pseudo-gradient is non-finite, and the sync raises or is skipped on every rank
    for kind in ("grad", "overflow"):
        for mode in ("error", "skip"):
            params = [torch.nn.Parameter(t) for t in _init()]
            opt = _build(params, sync_every=2, nonfinite=mode)
            opt.inner = torch.optim.AdamW(params, lr=1e-2)  # a state that a bad step would poison
            before = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(2):
                    for i, p in enumerate(params):
                        p.grad = _grad(rank, step, i, p.shape)
                        if rank == bad_rank and step == 1 and i == 1 and kind == "grad":
                            p.grad[3] = math.inf
                    if rank == bad_rank and step == 1 and kind == "overflow":
                        with torch.no_grad():
                            params[1][3] = math.inf
                        opt.inner.state[params[1]]["exp_avg"][3] = math.nan
                    before = {
                        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)
                    }
                    try:
                        opt.step()
                    except FloatingPointError as exc:
                        out[f"{kind} {mode}"] = str(exc)
            name = f"{kind} {mode} "
            after = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)}
            out[name + "state same"] = all(
                before[n].keys() == after[n].keys()
                and all(torch.equal(before[n][k], after[n][k]) for k in before[n])
                for n in before
            )
            out[name + "counts"] = (opt.syncs, opt.skipped_syncs, opt.skipped_steps, opt.inner_resets)
            out[name + "inner finite"] = all(
                bool(torch.isfinite(v).all()) for s in opt.inner.state.values() for v in s.values()
            )
            out[name + "warnings"] = [str(w.message) for w in caught if "skipped a sync" in str(w.message)]
            if mode == "skip":
                out[name + "params"] = [p.detach().clone() for p in params]
                out[name + "global"] = [opt.state[p]["global"].clone() for p in params]
                for step in range(2, 4):  # the next period syncs normally
                    for i, p in enumerate(params):
                        p.grad = _grad(rank, step, i, p.shape)
                    opt.step()
                out[name + "then sync"] = ([p.detach().clone() for p in params], opt.syncs)
    out["peer"] = _peer_fault(rank, bad_rank)
    # settings that differ: at the first step, and an inner lr changed on one rank later
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _build(params, outer_lr=0.5 if rank == bad_rank else 1.0)
    for i, p in enumerate(params):
        p.grad = _grad(rank, 0, i, p.shape)
    try:
        opt.step()
    except ValueError as exc:
        out["outer_lr"] = str(exc)
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _build(params)
    for step in range(H):
        if step == 1 and rank == bad_rank:
            opt.param_groups[0]["lr"] = 0.01  # an LR scheduler stepped on one rank only
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        try:
            opt.step()
        except ValueError as exc:
            out["inner lr"] = (step, str(exc), opt.syncs)
    params = [torch.nn.Parameter(t + (rank == bad_rank)) for t in _init()]  # different weights
    opt = _build(params)
    for i, p in enumerate(params):
        p.grad = _grad(rank, 0, i, p.shape)
    try:
        opt.step()
    except ValueError as exc:
        out["weights"] = str(exc)
    return out


def _peer_fault(rank: int, bad_rank: int) -> dict:
    """The second sync (step 3) with a malformed payload from ``bad_rank`` (a NaN value, or a
    position outside its tile): what every rank raised, whether the sync changed any state,
    and the replicas after the next step, which syncs again."""
    out: dict = {}
    for what in ("nan-value", "bad-index"):
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _build(params, sync_every=2, outer="nesterov", outer_lr=0.7)
        for step in range(5):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p.shape)
            corrupt = step == 3 and rank == bad_rank
            before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)}
            with mock.patch.object(PayloadCodec, "to_wire", _corrupted(what)) if corrupt else nullcontext():
                try:
                    opt.step()
                except PeerDataError as exc:
                    after = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in enumerate(params)}
                    out[what] = (step, str(exc), _same(before, after), opt.syncs)
        out[what + " then"] = (opt.syncs, [p.detach().clone() for p in params])
    return out


def _corrupted(what: str):
    """``PayloadCodec.to_wire`` that sends one bad slot: NaN, or a position outside its tile."""
    original = PayloadCodec.to_wire

    def to_wire(codec, indices, values):
        idx, vals = (
            x[0].clone() for x in codec.decode([w.reshape(1, -1) for w in original(codec, indices, values)])
        )
        if what == "nan-value":
            vals[0] = math.nan
        else:
            idx[0] = codec.plan.tilings[0].tile_numel + 3
        return original(codec, idx, vals)

    return to_wire


def _same(a: dict, b: dict) -> bool:
    return all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def _world2(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"  # torch kernel paths in the workers
    return {
        "sim": _sim_configs(rank, world, list(CONFIGS)),
        "resume": _resume(rank, world),
        "regression": _regression(rank, world),
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


def _to_tiles(x: torch.Tensor, t: tiling.TensorTiling) -> torch.Tensor:
    return x.reshape(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2).reshape(t.n_tiles, t.tile_numel)


def _from_tiles(m: torch.Tensor, t: tiling.TensorTiling) -> torch.Tensor:
    return m.reshape(t.rows // t.h, t.cols // t.w, t.h, t.w).transpose(1, 2).reshape(t.shape)


def _quantize(payload: str, v: torch.Tensor) -> torch.Tensor:
    """float64 values of one ``(n_tiles, k)`` selection as the codec's receivers see them."""
    if payload == "compact":
        return v.to(torch.bfloat16).double()
    if payload == "sign":
        scale = v.abs().mean(1, keepdim=True).to(torch.bfloat16).double()
        return torch.where(v < 0, -scale, scale)
    rows = []  # int2: the step rms * c (c in 0.25 .. 0.75, bf16) of least squared error per tile
    for tile in v:
        rms, best = tile.square().mean().sqrt(), None
        for c in [0.25 + 0.05 * i for i in range(11)]:
            step = (rms * c).to(torch.bfloat16).double()
            q = (2 * torch.round((tile / step + 3) / 2).clamp(0, 3) - 3) * step
            err = float((q - tile).square().sum())
            if best is None or err < best[0] * (1 - 1e-9):
                best = (err, q)
        rows.append(best[1])
    return torch.stack(rows)


def _simulate(world: int, options: dict) -> list[list[torch.Tensor]]:
    """theta_global after each of 2 syncs, every rank's H local SGD steps simulated in float64."""
    topk, dct = options.get("topk", K), options.get("dct", False)
    payload, outer = options.get("payload", "int2"), options.get("outer", "average")
    outer_lr, mu = options.get("outer_lr", 1.0), 0.9
    theta = [t.double() for t in _init()]
    codec = get_codec(payload)
    dense = [topk is None or sends_dense(s, CHUNK, topk, codec, torch.bfloat16, world) for s in SHAPES]
    errors = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
    momentum = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    snaps = []
    for sync in range(2):
        deltas = []
        for r in range(world):
            local = [t.clone() for t in theta]
            for h in range(H):
                for i in range(len(SHAPES)):
                    local[i] -= LR * _grad(r, sync * H + h, i, SHAPES[i]).double()
            deltas.append([g - x for g, x in zip(theta, local, strict=True)])
        for i, shape in enumerate(SHAPES):
            if dense[i]:
                mean = sum(d[i] for d in deltas) / world
            else:
                t = tiling.TensorTiling.of(shape, CHUNK)
                total = torch.zeros(t.n_tiles, t.tile_numel, dtype=torch.float64)
                for r in range(world):
                    e = errors[r][i]
                    e.mul_(DECAY).add_(deltas[r][i])
                    m = dct_encode_reference(e, CHUNK, torch.float64) if dct else _to_tiles(e, t)
                    idx = m.abs().topk(min(topk, t.tile_numel), dim=1).indices
                    q = torch.zeros_like(m).scatter_(1, idx, _quantize(payload, m.gather(1, idx)))
                    e -= dct_decode_reference(q, shape, CHUNK, torch.float64) if dct else _from_tiles(q, t)
                    total += q
                total /= world
                mean = (
                    dct_decode_reference(total, shape, CHUNK, torch.float64) if dct else _from_tiles(total, t)
                )
            if outer == "nesterov":
                momentum[i] = mu * momentum[i] + mean
                theta[i] = theta[i] - outer_lr * (mean + mu * momentum[i])
            else:
                theta[i] = theta[i] - outer_lr * mean
        snaps.append([t.clone() for t in theta])
    return snaps


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def _expected_sent(world: int, options: dict) -> list[int]:
    """Bytes per step from first principles: the first step's status row and parameter check
    (one float64 sum per parameter), each sync's status row and payloads (ring all-gather of
    the compressed bucket; ring all-reduce of the fp32 dense pseudo-gradients); nothing on
    other steps."""
    topk, payload = options.get("topk", K), options.get("payload", "int2")
    n = len(SHAPES)
    codec = get_codec(payload)
    dense = [topk is None or sends_dense(s, CHUNK, topk, codec, torch.bfloat16, world) for s in SHAPES]
    tilings = [tiling.TensorTiling.of(s, CHUNK) for s, d in zip(SHAPES, dense, strict=True) if not d]
    slots = sum(t.n_tiles * t.k_eff(topk) for t in tilings) if tilings else 0
    tiles = sum(t.n_tiles for t in tilings)
    payload_bytes = (
        {
            "int2": _aligned(2 * slots) + _aligned(-(-slots // 4)) + _aligned(2 * tiles),
            "sign": _aligned(2 * slots) + _aligned(-(-slots // 8)) + _aligned(2 * tiles),
            "compact": _aligned(2 * slots) + _aligned(2 * slots),
        }[payload]
        if tilings
        else 0
    )
    dense_numel = sum(math.prod(s) for s, d in zip(SHAPES, dense, strict=True) if d)
    sync = (
        (world - 1) * STATUS_ROW + (world - 1) * payload_bytes + (2 * (world - 1) * 4 * dense_numel) // world
    )
    sent = [0] * (2 * H)
    sent[0] += (world - 1) * (STATUS_ROW + 8 * n)
    sent[H - 1] += sync
    sent[2 * H - 1] += sync
    return sent


# ----------------------------------------------------------------------------- tests


def _check_against_simulation(results, world, names):
    for name in names:
        want = _simulate(world, CONFIGS[name])
        for res in results:
            got = res["sim"][name]
            assert got["syncs"] == 2
            for s in range(2):
                for a, b in zip(got["snaps"][s], results[0]["sim"][name]["snaps"][s], strict=True):
                    assert torch.equal(a, b), f"{name}: ranks differ after sync {s + 1}"
                for i, (a, b) in enumerate(zip(got["snaps"][s], want[s], strict=True)):
                    torch.testing.assert_close(
                        a.double(),
                        b,
                        rtol=1e-5,
                        atol=1e-5,
                        msg=f"{name} sync {s + 1} param {i}",
                    )
            expected = _expected_sent(world, CONFIGS[name])
            assert got["sent"] == expected, name
            assert got["bytes_per_step"] == sum(expected) / len(expected)


@pytest.mark.distributed
def test_world2_matches_a_float64_simulation_and_counts_bytes(world2):
    _check_against_simulation(world2, 2, list(CONFIGS))


@pytest.mark.distributed
def test_world3_matches_a_float64_simulation_and_counts_bytes(world3):
    _check_against_simulation(world3, 3, WORLD3)


@pytest.mark.distributed
def test_resume_is_exact_mid_period_and_at_a_sync_and_inner_state_stays_local(world2):
    for res in world2:
        assert res["resume"]["since_sync"] == {4: 1, 6: 0}
        for at, (params, sent) in res["resume"]["resumed"].items():
            for a, b in zip(params, res["resume"]["final"], strict=True):
                assert torch.equal(a, b), f"resumed at step {at}"
            # comm_stats resumed too; the first step after the load opens with the status row
            # and compares the replicas again (theta_global: one float64 sum per tensor)
            assert sent - res["resume"]["sent"] == (len(world2) - 1) * (STATUS_ROW + 8 * len(SHAPES)), at
    r0, r1 = (res["resume"] for res in world2)
    for a, b in zip(r0["final"], r1["final"], strict=True):
        assert torch.equal(a, b)  # step 9 ends with the third sync: replicas identical
    assert not torch.equal(r0["exp_avg"], r1["exp_avg"])  # AdamW moments: each rank's own
    assert not torch.equal(r0["error"], r1["error"])  # error buffers too


@pytest.mark.distributed
def test_a_small_regression_trains_to_a_low_loss(world2):
    for res in world2:
        losses = res["regression"]["losses"]
        assert losses[-1] < 0.02 * losses[0], (losses[0], losses[-1])
    # a sync every 5 steps, top-64 of each tile in 2 bits: far fewer bytes than a dense all-reduce
    dense = 2 * 1 * 4 * sum(p.numel() for p in SmallNet().parameters()) // 2
    assert world2[0]["regression"]["bps"] < dense / 10


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_pseudo_gradients_and_differing_settings_raise_or_skip_on_every_rank(world, world2, world3):
    results = world2 if world == 2 else world3
    bad = world - 1
    for res in results:
        f = res["faults"]
        # an inf gradient (it poisons the inner AdamW of that rank) or a weight and inner state
        # gone non-finite otherwise: a non-finite pseudo-gradient at the sync. The sync is not
        # applied, every rank is back at theta_global, and that rank resets the inner state of
        # the parameter that went bad: training goes on
        resets = int(res is results[bad])
        for kind in ("grad", "overflow"):
            assert f"non-finite pseudo-gradient in 'param 1' (64,) on rank {bad}" in f[f"{kind} error"]
            assert "training can go on" in f[f"{kind} error"]
            assert f"{kind} skip" not in f and len(f[f"{kind} skip warnings"]) == 1
            for mode, syncs in (("error", (0, 0, 0, resets)), ("skip", (0, 1, 0, resets))):
                assert f[f"{kind} {mode} state same"] and f[f"{kind} {mode} counts"] == syncs, (kind, mode)
                assert f[f"{kind} {mode} inner finite"]
            for p, g in zip(f[f"{kind} skip params"], f[f"{kind} skip global"], strict=True):
                assert torch.equal(p, g)  # every rank back at theta_global
            assert f[f"{kind} skip then sync"][1] == 1  # the next period syncs
        assert (
            "setting 'outer_lr' is 1.0 on rank" in f["outer_lr"] and f"0.5 on rank [{bad}]" in f["outer_lr"]
        )
        step, message, syncs = f["inner lr"]
        assert step == H - 1 and "param group 0 setting 'lr' is 0.05 on rank" in message and syncs == 0
        assert "parameter 'param 0' (32, 48) differs between the ranks" in f["weights"]
    for res in results:
        for what, fault in (("nan-value", "non-finite value"), ("bad-index", "outside the tile")):
            step, message, unchanged, syncs = res["faults"]["peer"][what]
            # every rank raised at the second sync, naming the sender; the sync changed no state
            assert step == 3 and syncs == 1, (step, syncs)
            assert f"rank {bad} sent a malformed payload" in message and fault in message, message
            assert "the sync was not applied" in message and "a later step() syncs again" in message
            assert unchanged, f"the failed sync changed SparseLoCo's state: {message}"
            syncs, params = res["faults"]["peer"][what + " then"]
            assert syncs == 2  # the next step synced again: every rank can go on
            for a, b in zip(params, results[0]["faults"]["peer"][what + " then"][1], strict=True):
                assert torch.isfinite(a).all() and torch.equal(a, b)
        for key in ("grad skip then sync", "overflow skip then sync"):
            for a, b in zip(res["faults"][key][0], results[0]["faults"][key][0], strict=True):
                assert torch.equal(a, b)  # replicas bit-identical after the skip


def _net():
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sync_every=0), ValueError, "sync_every must be an integer >= 1"),
        (dict(sync_every=2.5), ValueError, "sync_every must be an integer"),
        (dict(topk=0), ValueError, r"topk must be an integer >= 1 or None"),
        (dict(chunk=-1), ValueError, "chunk must be an integer"),
        (dict(payload="int3"), ValueError, r"payload must be one of \(.*'int2'"),
        (dict(dct="yes"), TypeError, "dct must be True or False"),
        (dict(outer="adam"), ValueError, r"outer must be one of 'average', 'nesterov', got 'adam'"),
        (dict(outer_lr=0.0), ValueError, "outer_lr must be a finite number > 0"),
        (dict(outer_momentum=1.0), ValueError, r"outer_momentum must be a finite number in \[0.0, 1.0\)"),
        (dict(error_decay=1.5), ValueError, "error_decay must be a finite number"),
        (dict(nonfinite="ignore"), ValueError, r"nonfinite must be one of 'error', 'skip'"),
        (dict(precision="half"), ValueError, "nearest"),
        (dict(value_dtype=torch.int8), TypeError, "value_dtype must be"),
        (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be"),
        (dict(inner="adamw"), TypeError, "inner must be None .* a torch.optim.Optimizer or a callable"),
        (dict(inner=lambda ps: 3), TypeError, r"inner\(params\) must return a torch.optim.Optimizer"),
        (dict(inner=torch.optim.SGD(_net().parameters(), lr=0.1)), ValueError, "exactly the parameters"),
    ],
)
def test_bad_constructor_input_fails_clearly(kwargs, error, match):
    with pytest.raises(error, match=match):
        SparseLoCo(_net().parameters(), **kwargs)


def test_single_process_defaults_schedulers_and_low_precision():
    net = _net()
    opt = SparseLoCo(net.parameters())
    assert (opt.sync_every, opt.topk, opt.chunk, opt.dct, opt.payload) == (5, 64, 64, False, "int2")
    assert (opt.error_decay, opt.outer, opt.outer_lr) == (0.95, "average", 1.0)
    assert isinstance(opt.inner, torch.optim.AdamW) and opt.param_groups is opt.inner.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)
    for _ in range(3):
        net(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(1e-3 / 8)
    assert opt.comm_stats.steps == 3 and opt.bytes_per_step == 0  # alone: nothing on the wire

    # bf16 parameters: "master" steps fp32 copies, so small inner updates reach the sync
    moved = {}
    for precision in ("nearest", "master"):
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 16).to(torch.bfloat16)
        start = [p.detach().float().clone() for p in lin.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o = SparseLoCo(
                lin.parameters(),
                lambda ps: torch.optim.SGD(ps, lr=1e-4),
                sync_every=4,
                topk=None,
                precision=precision,
            )
        assert any("master" in str(w.message) for w in caught) == (precision == "nearest")
        for _ in range(4):
            for p in lin.parameters():
                p.grad = torch.ones_like(p)
            o.step()
        assert o.syncs == 1
        shift = torch.cat(
            [(o.state[p]["global"] - s).flatten() for p, s in zip(lin.parameters(), start, strict=True)]
        )
        moved[precision] = float((shift != 0).float().mean())
        if precision == "master":
            assert o.inner.param_groups[0]["params"][0].dtype == torch.float32
            torch.testing.assert_close(shift, torch.full_like(shift, -4e-4), rtol=1e-3, atol=0)
    assert moved["master"] == 1.0 and moved["nearest"] < 0.5  # 1e-4 steps vanish in bf16 rounding

    # an inner optimizer instance over bf16 parameters steps their fp32 masters
    lin = torch.nn.Linear(16, 16).to(torch.bfloat16)
    inner = torch.optim.SGD(lin.parameters(), lr=0.1)
    SparseLoCo(lin.parameters(), inner, precision="master")
    assert [p.dtype for p in inner.param_groups[0]["params"]] == [torch.float32] * 2
    used = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    for p in lin.parameters():
        p.grad = torch.ones_like(p)
    used.step()
    with pytest.raises(ValueError, match="already has state"):
        SparseLoCo(lin.parameters(), used, precision="master")


def test_the_study_runner_builds_sparseloco_with_a_named_inner_optimizer():
    from cokit.train import MethodSpec, build_method

    torch.manual_seed(0)
    net = _net()
    spec = MethodSpec("sparseloco", lr=0.1, weight_decay=0.01, options={"inner": "sgd", "sync_every": 2})
    method = build_method(spec, net)
    inner = method.optimizer.inner
    assert isinstance(inner, torch.optim.SGD)
    assert inner.param_groups[0]["lr"] == 0.1 and inner.param_groups[0]["weight_decay"] == 0.01
    method.set_lr_factor(0.5)  # the runner's schedule drives the inner lr
    assert inner.param_groups[0]["lr"] == 0.05
    net(torch.randn(8, 4)).square().mean().backward()
    sent, dense = method.step()
    assert sent == 0 and dense == 0  # one process: nothing to send
    assert isinstance(
        build_method(MethodSpec("sparseloco", lr=1e-3), _net()).optimizer.inner, torch.optim.AdamW
    )
    with pytest.raises(ValueError, match=r"inner must be one of \('adamw', 'sgd', 'muon'\), got 'lion'"):
        build_method(MethodSpec("sparseloco", lr=1e-3, options={"inner": "lion"}), _net())


def test_synchronized_swaps_in_the_last_syncs_weights_and_restores_the_local_ones():
    from cokit.train import MethodSpec, build_method

    torch.manual_seed(0)
    net = _net()
    method = build_method(MethodSpec("sparseloco", lr=0.1, options={"inner": "sgd", "sync_every": 2}), net)
    opt = method.optimizer
    before = [p.detach().clone() for p in net.parameters()]
    with method.evaluation():  # before the first step: nothing to swap
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    x = torch.randn(8, 4)
    for _ in range(3):  # a sync at step 2, then one local step
        net(x).square().mean().backward()
        method.step()
        method.zero_grad()
    local = [p.detach().clone() for p in net.parameters()]
    shared = [opt.state[p]["global"].clone() for p in net.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(local, shared, strict=True))
    with opt.synchronized():
        assert all(torch.equal(p, g) for p, g in zip(net.parameters(), shared, strict=True))
    assert all(torch.equal(p, a) for p, a in zip(net.parameters(), local, strict=True))  # bit for bit


@pytest.mark.parametrize("dct", [False, True])
def test_the_triton_kernels_give_the_sync_of_the_torch_references(dct, monkeypatch):
    """One process (mean over one rank): the sync through the Triton kernels (interpreter here,
    GPUs in production) matches the torch reference path."""
    out = {}
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _build(params, dct=dct, payload="compact", value_dtype=torch.float32)
        for step in range(H):
            for i, p in enumerate(params):
                p.grad = _grad(0, step, i, p.shape)
            opt.step()
        assert opt.syncs == 1
        out[interpret] = [p.detach().clone() for p in params] + [opt.state[params[0]]["error"].clone()]
    for a, b in zip(out["1"], out["0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- DCP


def _dcp_run(rank: int, world: int, folder: str, precision: str):
    """Train 9 steps (H=3), saving with DCP after step 4 (mid-period); resume a fresh model and
    optimizer (other initial weights) from it in the same processes; both must end alike."""
    os.environ["TRITON_INTERPRET"] = "0"
    x, y = regression_data(rank)

    def build(seed: int):
        torch.manual_seed(seed)
        model = SmallNet().to(torch.bfloat16 if precision == "master" else torch.float32)
        inner = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
        return model, SparseLoCo(
            model.named_parameters(), inner, sync_every=3, precision=precision, timeout=120
        )

    def train(model, opt, steps):
        for step in steps:
            xs, ys = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]
            torch.nn.functional.mse_loss(model(xs.to(model.a.weight.dtype)).float(), ys).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(4))
    dcp_save(model, opt, folder)
    train(model, opt, range(4, 9))
    straight = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = build(1)
    dcp_load(model2, opt2, folder)
    counters = (opt2._steps, opt2._since_sync, opt2.syncs)
    train(model2, opt2, range(4, 9))
    resumed = [p.detach().clone() for p in model2.parameters()]
    return straight, resumed, counters


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["nearest", "master"])
def test_dcp_saves_and_resumes_sparseloco_exactly(tmp_path, precision):
    """get_optimizer_state_dict(model, SparseLoCo(...)) used to raise KeyError('param_groups')."""
    for straight, resumed, counters in run_gloo(2, _dcp_run, str(tmp_path / "ckpt"), precision):
        assert counters == (4, 1, 1)
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)
