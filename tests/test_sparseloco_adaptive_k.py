"""SparseLoCo's ``adaptive_topk`` (against the gap that grows with training) on real gloo groups
(world 2 and 3): the top-k
budget redistributed by the energy each selection captures. Replicas and k's bit-identical on
every rank, the captured shares against a float64 reference, bytes per step from first
principles (payloads from the current k's + the shares' all-gather), the budget kept, exact
resume, a diverged rank caught, the rule on hand-made shares, bad input, a regression and the
study runner."""

from __future__ import annotations

import copy
import json
import math
import os
import random

import pytest
import torch
from distributed import run_gloo
from helpers import STATUS_ROW, SmallNet, regression_data
from test_sparseloco import CHUNK, DECAY, LR, SHAPES, H, K, _aligned, _grad, _init, _to_tiles

from cokit.compress import SparseLoCo
from cokit.compress.agreement import SettingsMismatch
from cokit.compress.sparseloco import redistribute_topk
from cokit.compress.sparseloco_state import records, settings
from cokit.triton_kernels import tiling

STEPS = 4 * H  # four syncs
#: the compressed tensors of SHAPES (the (5,) bias goes dense at world 2 and 3): tiles, tile size
TILES = [tiling.TensorTiling.of(s, CHUNK) for s in SHAPES[:2]]
BUDGET = sum(t.n_tiles * K for t in TILES)  # 6 * 8 + 4 * 8 = 80 values per rank and sync
CONFIGS = {"int2": dict(), "dct-nesterov": dict(dct=True, outer="nesterov", outer_lr=0.7)}


def _opt(params, inner: str = "sgd", **kwargs) -> SparseLoCo:
    """test_sparseloco's settings (H=3, top-8 of 16x16 tiles, int2) with ``adaptive_topk``."""
    options: dict = dict(
        sync_every=H, topk=K, chunk=CHUNK, error_decay=DECAY, timeout=120, adaptive_topk=True
    )
    options.update(kwargs)
    if inner == "adamw":
        return SparseLoCo(params, lambda ps: torch.optim.AdamW(ps, lr=1e-2), **options)
    return SparseLoCo(params, lambda ps: torch.optim.SGD(ps, lr=LR), **options)


def _feed(rank: int, step: int, params) -> None:
    for i, p in enumerate(params):
        p.grad = _grad(rank, step, i, p.shape)


# ----------------------------------------------------------------------------- workers


def _configs(rank: int, world: int) -> dict:
    out = {}
    for name, options in CONFIGS.items():
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _opt(params, **options)
        snaps, sent, topks, shares, buckets = [], [], [], [], []
        for step in range(STEPS):
            buckets.append([(list(b.members), b.topk) for b in opt.plan.buckets()])  # what this step uses
            _feed(rank, step, params)
            opt.step()
            sent.append(opt.comm_stats.step_sent_bytes)
            snaps.append([p.detach().clone() for p in params])
            topks.append(opt.current_topk)
            shares.append(opt.captured_energy)
        out[name] = {
            "snaps": snaps,
            "sent": sent,
            "topks": topks,
            "shares": shares,
            "buckets": buckets,
            "syncs": opt.syncs,
            "bytes_per_step": opt.bytes_per_step,
        }
    return out


def _run(rank, params, steps, start=0, state=None):
    opt = _opt(params, "adamw")
    if state is not None:
        opt.load_state_dict(state)
    saved, topks = {}, []
    for step in range(start, steps):
        _feed(rank, step, params)
        opt.step()
        topks.append(opt.current_topk)
        if step + 1 in (H, H + 2):  # right after the first k change, then mid-period
            saved[step + 1] = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    return opt, saved, topks


def _resume(rank: int, world: int) -> dict:
    params = [torch.nn.Parameter(t) for t in _init()]
    opt, saved, topks = _run(rank, params, STEPS)
    resumed = {}
    for at, (state, values) in saved.items():
        again = [torch.nn.Parameter(v.clone()) for v in values]
        opt2, _, topks2 = _run(rank, again, STEPS, start=at, state=state)
        resumed[at] = ([p.detach().clone() for p in again], opt2.comm_stats.total_sent_bytes, topks2)
    return {
        "final": [p.detach().clone() for p in params],
        "sent": opt.comm_stats.total_sent_bytes,
        "topks": topks,
        "saved topks": {at: records(s[0])["common"]["topk_per_tensor"] for at, s in saved.items()},
        "resumed": resumed,
    }


def _diverged(rank: int, world: int) -> dict:
    """Rank 1's k's are changed after the first sync: the next sync raises on every rank."""
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _opt(params)
    message = None
    for step in range(2 * H):
        _feed(rank, step, params)
        if step == H and rank == 1:
            opt.plan.set_topks({i: k + 1 for i, k in opt.plan.topks().items()})
        before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
        try:
            opt.step()
        except SettingsMismatch as exc:
            message = str(exc)
            break
    # theta_global and the error buffers as they were (the local step before the sync ran)
    unchanged = all(
        torch.equal(before[p][key], opt.state[p][key]) for p in params for key in before[p]
    ) and all(set(before[p]) == set(opt.state[p]) for p in params)
    # one rank with the option on: the first step's agreement names it
    other = None
    try:
        _opt([torch.nn.Parameter(t) for t in _init()], adaptive_topk=rank == 0).step()
    except SettingsMismatch as exc:
        other = str(exc)
    return {"message": message, "step": step, "unchanged": unchanged, "other": other}


def _regression(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    opt = SparseLoCo(
        model.named_parameters(),
        lambda ps: torch.optim.AdamW(ps, lr=3e-3),
        sync_every=5,
        topk=8,
        chunk=16,
        timeout=120,
        adaptive_topk=True,
    )
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
        "syncs": opt.syncs,
        "topk": opt.current_topk,
        "compressed": len(opt.current_topk),
    }


def _world2(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"  # torch kernel paths in the workers
    return {
        "configs": _configs(rank, world),
        "resume": _resume(rank, world),
        "diverged": _diverged(rank, world),
        "regression": _regression(rank, world),
    }


def _world3(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    return {"configs": _configs(rank, world)}


@pytest.fixture(scope="module")
def world2():
    return run_gloo(2, _world2)


@pytest.fixture(scope="module")
def world3():
    return run_gloo(3, _world3)


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def results(request):
    """``(world, every rank's results)``: each world's processes start once, when first needed."""
    return request.param, request.getfixturevalue(f"world{request.param}")


# ----------------------------------------------------------------------------- first principles


def _int2_bytes(members: list[int], k: int) -> int:
    """The int2 payload of one bucket: 2-byte indices, 2-bit values, a bf16 scale per tile."""
    slots = sum(TILES[i].n_tiles * k for i in members)
    tiles = sum(TILES[i].n_tiles for i in members)
    return _aligned(2 * slots) + _aligned(-(-slots // 4)) + _aligned(2 * tiles)


def _expected_sent(world: int, topks: list[dict[int, int]]) -> list[int]:
    """Bytes per step: the first step's status row and parameter check; each sync's status
    row, the ring all-gather of one bucket per distinct k (the k's in force: those after the
    step before), the ring all-reduce of the dense bias (fp32) and the ring all-gather of one
    fp32 captured-energy share per compressed tensor; nothing otherwise."""
    static = {0: K, 1: K}
    sent = [0] * STEPS
    sent[0] += (world - 1) * (STATUS_ROW + 8 * len(SHAPES))
    for step in range(H - 1, STEPS, H):
        ks = topks[step - 1] if step > 0 else static
        by_k: dict[int, list[int]] = {}
        for i, k in ks.items():
            by_k.setdefault(k, []).append(i)
        payload = sum(_int2_bytes(members, k) for k, members in by_k.items())
        dense = (2 * (world - 1) * 4 * math.prod(SHAPES[2])) // world
        sent[step] += (world - 1) * (STATUS_ROW + payload + 4 * len(ks)) + dense
    return sent


def _reference_shares(world: int) -> list[float]:
    """float64: the first sync's shares. Error buffers start at zero and SGD has no state, so
    each rank's error buffer is ``LR * (sum of its H gradients)``; per 16x16 tile the top-K
    magnitudes' energy over the tile's, summed per tensor, averaged over the ranks."""
    shares = []
    for i, t in enumerate(TILES):
        total = 0.0
        for r in range(world):
            e = LR * sum(_grad(r, h, i, SHAPES[i]).double() for h in range(H))
            m = _to_tiles(e, t)
            top = m.abs().topk(K, dim=1).values
            total += float(top.square().sum() / m.square().sum())
        shares.append(total / world)
    return shares


# ----------------------------------------------------------------------------- distributed tests


@pytest.mark.distributed
def test_replicas_and_ks_stay_identical_and_bytes_follow_the_current_ks(results):
    world, res_list = results
    syncs = list(range(H - 1, STEPS, H))
    for name in CONFIGS:
        first = res_list[0]["configs"][name]
        for res in res_list:
            got = res["configs"][name]
            assert got["syncs"] == len(syncs)
            assert got["topks"] == first["topks"] and got["shares"] == first["shares"], name
            for s in syncs:
                for a, b in zip(got["snaps"][s], first["snaps"][s], strict=True):
                    assert torch.equal(a, b), f"{name}: ranks differ after step {s + 1}"
            expected = _expected_sent(world, got["topks"])
            assert got["sent"] == expected, name
            assert got["bytes_per_step"] == sum(expected) / STEPS
        # the k's change at syncs only, within the budget and the range, and do change
        topks = first["topks"]
        assert topks[: H - 1] == [{0: K, 1: K}] * (H - 1)
        changes = [s for s in range(1, STEPS) if topks[s] != topks[s - 1]]
        assert changes and set(changes) <= set(syncs), (name, topks)
        for ks in topks:
            assert sum(TILES[i].n_tiles * k for i, k in ks.items()) <= BUDGET
            assert all(2 <= k <= min(4 * K, TILES[i].tile_numel) for i, k in ks.items())
        # each sync's k's are the rule's, from the shares agreed at that sync
        for s in syncs:
            shares = first["shares"][s]
            before = topks[s - 1] if s > 0 else {0: K, 1: K}  # the k's the shares were measured at
            want = redistribute_topk(
                [shares[0], shares[1]],
                [t.n_tiles for t in TILES],
                [t.tile_numel for t in TILES],
                K,
                current=[before[0], before[1]],
            )
            assert [topks[s][0], topks[s][1]] == want
        # each sync's buckets: one per distinct k, from the k's in force
        for s in syncs:
            ks = topks[s - 1] if s > 0 else {0: K, 1: K}
            compressed = sorted((sorted(m), k) for m, k in first["buckets"][s] if k is not None)
            by_k: dict[int, list[int]] = {}
            for i, k in ks.items():
                by_k.setdefault(k, []).append(i)
            assert compressed == sorted((m, k) for k, m in by_k.items())


@pytest.mark.distributed
def test_the_first_syncs_shares_match_a_float64_reference(results):
    world, res_list = results
    want = _reference_shares(world)
    shares = res_list[0]["configs"]["int2"]["shares"][H - 1]
    assert res_list[0]["configs"]["int2"]["shares"][H - 2] is None  # nothing before the first sync
    # fp32 shares on the wire, averaged in float64
    torch.testing.assert_close(torch.tensor([shares[0], shares[1]]), torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert want[0] < want[1]  # the 16x16 tiles keep 8 of 256 values, the 1-D ones 8 of 16
    ks = res_list[0]["configs"]["int2"]["topks"][H - 1]
    assert ks[0] > K > ks[1]  # the tensor that missed more energy gets the larger k


@pytest.mark.distributed
def test_resume_right_after_a_k_change_and_mid_period_is_exact(world2):
    for res in world2:
        r = res["resume"]
        assert r["saved topks"][H] != [[0, K], [1, K]]  # the first sync changed the k's
        assert r["saved topks"][H] == r["saved topks"][H + 2]
        for at, (params, sent, topks) in r["resumed"].items():
            for a, b in zip(params, r["final"], strict=True):
                assert torch.equal(a, b), f"resumed at step {at}"
            # resumed comm_stats, and the first step after the load: the status row and the
            # replica check (one float64 sum per tensor)
            assert sent - r["sent"] == (len(world2) - 1) * (STATUS_ROW + 8 * len(SHAPES)), at
            assert topks == r["topks"][at:]
    for a, b in zip(world2[0]["resume"]["final"], world2[1]["resume"]["final"], strict=True):
        assert torch.equal(a, b)  # the run ends with a sync


@pytest.mark.distributed
def test_a_rank_whose_ks_diverged_or_that_has_the_option_alone_raises_on_every_rank(world2):
    for res in world2:
        d = res["diverged"]
        assert d["step"] == 2 * H - 1  # the next sync, before anything changed
        assert d["unchanged"]
        assert "setting 'topk_per_tensor' is" in d["message"] and "on rank [1]" in d["message"]
        # (the first setting in sorted order that differs)
        assert "setting 'adaptive_range' is [0.25, 4.0] on rank [0], None on rank [1]" in d["other"]


@pytest.mark.distributed
def test_a_small_regression_with_adaptive_topk_trains_to_a_low_loss(world2):
    for res in world2:
        reg = res["regression"]
        assert reg["losses"][-1] < 0.02 * reg["losses"][0], (reg["losses"][0], reg["losses"][-1])
        assert reg["syncs"] == 30 and reg["compressed"] == 5  # the weights, biases and norm
        assert reg["topk"] == world2[0]["regression"]["topk"]
    for a, b in zip(world2[0]["regression"]["params"], world2[1]["regression"]["params"], strict=True):
        assert torch.equal(a, b)  # step 150 is a sync


# ----------------------------------------------------------------------------- the rule


SIZES = [256, 16]  # test_sparseloco's compressed tensors: tile sizes and tile counts
COUNTS = [6, 4]


def test_the_rule_gives_more_k_to_the_tensor_that_missed_more_and_keeps_the_budget():
    # w = (0.8, 0.2): lam * 5.6 = 80, targets (11.43, 2.86) -> floor (11, 2) = 74 values; the
    # larger fractional part takes +1 (4 tiles fit in the 6 left), the other's 6 do not
    assert redistribute_topk([0.2, 0.8], COUNTS, SIZES, K) == [11, 3]
    assert redistribute_topk([0.8, 0.2], COUNTS, SIZES, K) == [4, 14]
    # equal shares: the static k's, whatever they are
    assert redistribute_topk([0.5, 0.5], COUNTS, SIZES, K) == [K, K]
    assert redistribute_topk([0.3, 0.3], [2, 3], [4, 256], K) == [4, 8]  # k_eff(8) of a 4-value tile
    # everything captured: the smallest weight, the lower end of the range
    assert redistribute_topk([0.0, 1.0], COUNTS, SIZES, K) == [12, 2]
    # the upper end of the range (1.5 * 8 = 12) binds; 6 values are left that no step fits
    assert redistribute_topk([0.0, 0.9], [1, 10], [256, 256], K, (0.5, 1.5)) == [12, 7]
    # the tile size binds (a 16-value tile keeps at most 16)
    assert redistribute_topk([1.0, 0.0], COUNTS, SIZES, K, (0.25, 8.0)) == [2, 16]
    assert redistribute_topk([], [], [], K) == []


def test_the_rule_settles_instead_of_swinging_between_syncs():
    """Each tensor misses the share ``c / k`` of its energy at ``k`` (a power law, clamped):
    the rule, fed its own k's back, settles within a few syncs, the harder tensor (larger
    ``c``) holding the larger k. Weighting by the missed share alone swung 12/2 -> 9/6 -> 11/3."""
    hardness = [2.0, 6.0]
    counts, sizes = [4, 4], [256, 256]
    ks, history = [K, K], []
    for _ in range(12):
        missed = [min(1.0, c / k) for c, k in zip(hardness, ks, strict=True)]
        ks = redistribute_topk([1 - m for m in missed], counts, sizes, K, current=ks)
        history.append(ks)
    assert history[-1] == history[-2] == history[-3], history
    assert history[-1][1] > history[-1][0] and sum(history[-1]) <= 2 * K


def test_the_rule_keeps_the_budget_and_the_range_on_random_shares_deterministically():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        counts = [rng.randint(1, 40) for _ in range(n)]
        sizes = [rng.choice([4, 16, 100, 256, 4096]) for _ in range(n)]
        topk = rng.randint(1, 64)
        k_range = (rng.choice([0.1, 0.25, 0.5, 1.0]), rng.choice([1.0, 2.0, 4.0, 10.0]))
        shares = [rng.random() for _ in range(n)]
        ks = redistribute_topk(shares, counts, sizes, topk, k_range)
        assert ks == redistribute_topk(list(shares), list(counts), list(sizes), topk, k_range)
        budget = sum(c * min(topk, s) for c, s in zip(counts, sizes, strict=True))
        assert sum(c * k for c, k in zip(counts, ks, strict=True)) <= budget
        for k, s in zip(ks, sizes, strict=True):
            low = min(s, max(1, math.ceil(k_range[0] * topk - 1e-9)))
            assert low <= k <= min(s, max(low, math.floor(k_range[1] * topk + 1e-9)))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([0.5], [1, 2], [16, 16], 8), "have 1, 2 and 2 entries"),
        (([0.5], [0], [16], 8), "positive integers"),
        (([1.5], [1], [16], 8), r"in \[0, 1\]"),
        (([0.5], [1], [16], 8, (0.0, 2.0)), "0 < low <= 1 <= high"),
        (([0.5], [1], [16], 8, (0.5, 2.0), [0]), "one positive integer k per tensor"),
        (([0.5], [1], [16], 8, (0.5, 2.0), [8, 8]), "one positive integer k per tensor"),
    ],
)
def test_the_rule_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        redistribute_topk(*args)


# ----------------------------------------------------------------------------- bad input, state


def _params():
    return [torch.nn.Parameter(t) for t in _init()]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(adaptive_topk=1), TypeError, "adaptive_topk must be True or False, got 1"),
        (dict(adaptive_topk="yes"), TypeError, "adaptive_topk must be True or False"),
        (
            dict(adaptive_range=(0.5, 2.0)),
            ValueError,
            r"adaptive_range=\(0.5, 2.0\) needs adaptive_topk=True",
        ),
        (dict(adaptive_topk=True, topk=None), ValueError, "it needs topk"),
        (dict(adaptive_topk=True, adaptive_range=2.0), ValueError, r"adaptive_range must be a pair"),
        (dict(adaptive_topk=True, adaptive_range=(0.5,)), ValueError, r"adaptive_range must be a pair"),
        (dict(adaptive_topk=True, adaptive_range=(0.0, 2.0)), ValueError, r"adaptive_range\[0\] must be"),
        (dict(adaptive_topk=True, adaptive_range=(1.5, 2.0)), ValueError, r"adaptive_range\[0\] must be"),
        (dict(adaptive_topk=True, adaptive_range=(0.5, 0.9)), ValueError, r"adaptive_range\[1\] must be"),
        (
            dict(adaptive_topk=True, adaptive_range=(0.5, math.inf)),
            ValueError,
            r"adaptive_range\[1\] must be",
        ),
        (dict(adaptive_topk=True, adaptive_range=(True, 2.0)), ValueError, r"adaptive_range\[0\] must be"),
    ],
)
def test_bad_adaptive_input_fails_clearly_before_anything_changes(kwargs, error, match):
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(error, match=match):
        SparseLoCo(params, topk=kwargs.pop("topk", K), **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_the_option_off_keeps_settings_and_plan_and_a_changed_option_refuses_to_load():
    params = _params()
    plain = _opt(params, adaptive_topk=False)
    default = SparseLoCo(
        params, lambda ps: torch.optim.SGD(ps, lr=LR), sync_every=H, topk=K, chunk=CHUNK, error_decay=DECAY
    )
    assert "adaptive_topk" not in settings(plain) and settings(plain) == settings(default)
    assert plain._describe() == default._describe()  # off: the fingerprint of before
    assert plain.current_topk == {0: K, 1: K} and plain.captured_energy is None
    # one process: the option still redistributes (its own shares are the mean)
    opt = _opt(params)
    for step in range(H + 1):
        _feed(0, step, params)
        opt.step()
    state = opt.state_dict()
    saved = records(state)["common"]
    assert saved["settings"]["adaptive_topk"] is True and saved["settings"]["adaptive_range"] == [0.25, 4.0]
    assert (
        saved["topk_per_tensor"] == [[i, k] for i, k in sorted(opt.current_topk.items())] != [[0, K], [1, K]]
    )

    def refused(opt: SparseLoCo, sd: dict, match: str) -> None:
        before = [p.detach().clone() for p in opt._model_params]
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert all(torch.equal(a, p) for a, p in zip(before, opt._model_params, strict=True))
        assert opt._steps == 0 and opt.current_topk == {0: K, 1: K}

    refused(_opt(_params(), adaptive_topk=False), state, "setting 'adaptive_topk' was True, is False now")
    refused(
        _opt(_params(), adaptive_range=(0.5, 2.0)),
        state,
        r"'adaptive_range' was \[0.25, 4.0\], is \[0.5, 2.0\]",
    )
    plain_state = plain.state_dict()
    refused(_opt(_params()), plain_state, "setting 'adaptive_topk' was False, is True now")
    for bad in ([[0, 30], [1, 8]], [[0, 8]], [[0, 8], [1, 1]], [[0, 8], [2, 8]], "8", [[0, 8.0], [1, 8]]):
        damaged = copy.deepcopy(state)
        common = records(damaged)["common"]
        common["topk_per_tensor"] = bad
        damaged["param_groups"][0]["sparseloco"] = json.dumps(common)
        refused(_opt(_params()), damaged, "the saved topk_per_tensor .* do not fit")
    again = _opt(_params())
    again.load_state_dict(state)
    assert again.current_topk == opt.current_topk and again._steps == H + 1


def test_the_study_runner_passes_adaptive_topk_through():
    from cokit.train import MethodSpec, build_method

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 64))
    spec = MethodSpec(
        "sparseloco",
        lr=1e-3,
        options={
            "sync_every": 2,
            "topk": 8,
            "chunk": 16,
            "adaptive_topk": True,
            "adaptive_range": (0.5, 2.0),
        },
    )
    method = build_method(spec, net)
    opt = method.optimizer
    assert opt.adaptive_topk and opt.adaptive_range == (0.5, 2.0)
    assert sorted(opt.current_topk) == [0, 1, 2, 3] and set(opt.current_topk.values()) == {8}
    x = torch.randn(16, 32)
    for _ in range(4):
        net(x).square().mean().backward()
        method.step()
        method.zero_grad()
    assert (opt._steps, opt.syncs) == (4, 2) and opt.captured_energy is not None
    ks = opt.current_topk
    assert all(4 <= k <= 16 for k in ks.values())
    tilings = opt.plan.tilings()
    assert sum(tilings[i].n_tiles * k for i, k in ks.items()) <= sum(t.n_tiles * 8 for t in tilings.values())
