"""SparseLoCo's options against the gap that grows with training, on real gloo groups (world 2
and 3): a dense warm-up, per-layer
dense exchange (``dense_params``) and the hybrid Muon inner optimizer. Replicas bit-identical,
bytes per step from first principles, float64 references, exact resume, bad input."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from distributed import run_gloo
from helpers import STATUS_ROW, SmallNet, regression_data
from test_sparseloco import CHUNK, DECAY, LR, SHAPES, H, K, _aligned, _grad, _init

from cokit.compress import Muon, SparseLoCo
from cokit.compress.buckets import sends_dense
from cokit.compress.inner import EXCLUDE
from cokit.compress.payload import get_codec
from cokit.compress.sparseloco_state import records, settings
from cokit.triton_kernels import tiling

NAMES = ("body.weight", "head.weight", "head.bias")  # SHAPES: (32, 48), (64,), (5,)
WARM = 2
MUON = dict(lr=0.02, momentum=0.9, adamw_lr_ratio=0.5, weight_decay=0.01)
# name -> (SparseLoCo keyword arguments, inner: "sgd" or "muon", steps run)
CONFIGS = {
    "warmup": (dict(dense_warmup=WARM), "sgd", WARM + 2 * H),
    "dense_params": (dict(dense_params=("head",)), "sgd", 2 * H),
    "muon": (dict(dense_warmup=1, dense_params=("head",)), "muon", 1 + 2 * H),
}


def _named(params):
    return list(zip(NAMES, params, strict=True))


def _opt(params, inner: str = "sgd", **kwargs) -> SparseLoCo:
    """test_sparseloco's settings (H=3, top-8 of 16x16 tiles, int2, SGD inner) over named
    parameters; ``inner="muon"``: the hybrid Muon instead of SGD."""
    options: dict = dict(sync_every=H, topk=K, chunk=CHUNK, error_decay=DECAY, timeout=120)
    options.update(kwargs)
    if inner == "muon":
        return SparseLoCo(_named(params), lambda ps: Muon(ps, **MUON), **options)
    return SparseLoCo(_named(params), lambda ps: torch.optim.SGD(ps, lr=LR), **options)


# ----------------------------------------------------------------------------- workers


def _configs(rank: int, world: int) -> dict:
    out = {}
    for name, (options, inner, steps) in CONFIGS.items():
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _opt(params, inner, **options)
        snaps, sent, follows = [], [], []
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p.shape)
            opt.step()
            sent.append(opt.comm_stats.step_sent_bytes)
            snaps.append([p.detach().clone() for p in params])
            follows.append(all(torch.equal(opt.state[p]["global"], p.detach()) for p in params))
        out[name] = {
            "snaps": snaps,
            "sent": sent,
            "follows": follows,
            "syncs": opt.syncs,
            "errors": [n for n, p in enumerate(params) if "error" in opt.state[p]],
            "bytes_per_step": opt.bytes_per_step,
        }
    # the same 2H steps without dense_params: the compressed weight ends alike
    params = [torch.nn.Parameter(t) for t in _init()]
    opt = _opt(params)
    for step in range(2 * H):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        opt.step()
    out["plain"] = [p.detach().clone() for p in params]
    return out


def _warmup_faults(rank: int, world: int) -> dict:
    """A non-finite gradient (one rank) and a GradScaler's inf (one rank) at warm-up step 2."""
    out: dict = {}
    bad = world - 1
    for case in ("error", "skip", "found_inf"):
        params = [torch.nn.Parameter(t) for t in _init()]
        opt = _opt(params, dense_warmup=3, nonfinite="skip" if case == "skip" else "error")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = _grad(rank, step, i, p.shape)
                    if step == 1 and rank == bad and i == 1 and case != "found_inf":
                        p.grad[3] = math.nan
                if step == 1:
                    before = [p.detach().clone() for p in params]
                    opt.grad_scale = torch.ones(())  # what a GradScaler hands step()
                    opt.found_inf = torch.ones(()) if case == "found_inf" and rank == bad else torch.zeros(())
                try:
                    opt.step()
                except FloatingPointError as exc:
                    out[f"{case} message"] = str(exc)
                if step == 1:
                    out[f"{case} unchanged"] = all(
                        torch.equal(a, p) for a, p in zip(before, params, strict=True)
                    )
                    del opt.grad_scale, opt.found_inf
                    if case == "error":
                        break
        out[f"{case} warnings"] = [str(w.message) for w in caught if "warm-up" in str(w.message)]
        out[f"{case} counts"] = (opt._steps, opt.skipped_steps, opt.syncs)
        out[f"{case} params"] = [p.detach().clone() for p in params]
    return out


def _run(rank, params, steps, start=0, state=None, inner="muon", **options):
    opt = _opt(params, inner, **options)
    if state is not None:
        opt.load_state_dict(state)
    saved = {}
    for step in range(start, steps):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i, p.shape)
        opt.step()
        if step + 1 in (2, 5):  # mid-warm-up (3 steps), mid-period (one step after the warm-up)
            saved[step + 1] = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    return opt, saved


def _resume(rank: int, world: int) -> dict:
    out = {}
    for inner, options in (
        ("muon", dict(dense_warmup=3, dense_params=("head",))),
        ("sgd", dict(dense_warmup=3, dct=True)),
    ):
        params = [torch.nn.Parameter(t) for t in _init()]
        opt, saved = _run(rank, params, 9, inner=inner, **options)
        final = [p.detach().clone() for p in params]
        resumed = {}
        for at, (state, values) in saved.items():
            again = [torch.nn.Parameter(v.clone()) for v in values]
            opt2, _ = _run(rank, again, 9, start=at, state=state, inner=inner, **options)
            resumed[at] = ([p.detach().clone() for p in again], opt2.comm_stats.total_sent_bytes)
        out[inner] = {
            "final": final,
            "resumed": resumed,
            "sent": opt.comm_stats.total_sent_bytes,
            "syncs": opt.syncs,
            "counters": {at: records(s[0])["common"]["counters"] for at, s in saved.items()},
        }
    return out


def _regression(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    x, y = regression_data(rank)
    opt = SparseLoCo(
        model.named_parameters(),
        lambda ps: Muon(ps, lr=0.02, adamw_lr_ratio=0.15),
        sync_every=5,
        timeout=120,
        dense_warmup=10,
        dense_params=("b.",),
    )
    losses = []
    for _ in range(150):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "syncs": opt.syncs}


def _world2(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"  # torch kernel paths in the workers
    return {
        "configs": _configs(rank, world),
        "faults": _warmup_faults(rank, world),
        "resume": _resume(rank, world),
        "regression": _regression(rank, world),
    }


def _world3(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    return {"configs": _configs(rank, world), "faults": _warmup_faults(rank, world)}


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


def _int2_bytes(shapes) -> int:
    """The int2 payload of one bucket of ``shapes`` (top-K of CHUNK tiles)."""
    tilings = [tiling.TensorTiling.of(s, CHUNK) for s in shapes]
    if not tilings:
        return 0
    slots = sum(t.n_tiles * t.k_eff(K) for t in tilings)
    tiles = sum(t.n_tiles for t in tilings)
    return _aligned(2 * slots) + _aligned(-(-slots // 4)) + _aligned(2 * tiles)


def _expected_sent(world: int, options: dict, steps: int) -> list[int]:
    """Bytes per step: the first step's status row and parameter check (a float64 sum per
    parameter); each warm-up step's status row and ring all-reduce of every fp32 gradient; each
    sync's status row, the ring all-gather of the compressed tensors' payload and the ring
    all-reduce of the dense ones (fp32), ``dense_params`` among them; nothing otherwise."""
    warm = options.get("dense_warmup", 0)
    forced = [any(s in name for s in options.get("dense_params", ())) for name in NAMES]
    codec = get_codec("int2")
    dense = [
        f or sends_dense(s, CHUNK, K, codec, torch.bfloat16, world)
        for s, f in zip(SHAPES, forced, strict=True)
    ]
    dense_numel = sum(math.prod(s) for s, d in zip(SHAPES, dense, strict=True) if d)
    total_numel = sum(math.prod(s) for s in SHAPES)
    ring = lambda numel: (2 * (world - 1) * 4 * numel) // world  # noqa: E731
    row = (world - 1) * STATUS_ROW
    sync = (
        row
        + (world - 1) * _int2_bytes([s for s, d in zip(SHAPES, dense, strict=True) if not d])
        + ring(dense_numel)
    )
    sent = [0] * steps
    sent[0] += (world - 1) * (STATUS_ROW + 8 * len(SHAPES))
    for step in range(warm):
        sent[step] += row + ring(total_numel)
    for step in range(warm + H - 1, steps, H):
        sent[step] += sync
    return sent


def _sgd_reference(world: int, steps: int, warm: int, dense: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """float64: ``warm`` data-parallel SGD steps, then (for the tensors in ``dense``, exchanged
    dense) DiLoCo periods of H local SGD steps averaged with outer lr 1."""
    theta = [t.double() for t in _init()]
    for step in range(warm):
        for i, s in enumerate(SHAPES):
            theta[i] = theta[i] - LR * sum(_grad(r, step, i, s).double() for r in range(world)) / world
    for start in range(warm, steps, H):
        for i in dense:
            local = [
                theta[i] - LR * sum(_grad(r, start + h, i, SHAPES[i]).double() for h in range(H))
                for r in range(world)
            ]
            theta[i] = sum(local) / world
    return theta


# ----------------------------------------------------------------------------- tests


def _identical(res_list, name: str, steps: list[int]) -> None:
    for res in res_list:
        for s in steps:
            for a, b in zip(
                res["configs"][name]["snaps"][s], res_list[0]["configs"][name]["snaps"][s], strict=True
            ):
                assert torch.equal(a, b), f"{name}: ranks differ after step {s + 1}"


@pytest.mark.distributed
def test_dense_warmup_keeps_replicas_identical_and_counts_ring_all_reduce_bytes(results):
    world, res_list = results
    options, _, steps = CONFIGS["warmup"]
    syncs = list(range(WARM + H - 1, steps, H))
    _identical(res_list, "warmup", list(range(WARM)) + syncs)  # every warm-up step, every sync
    expected = _expected_sent(world, options, steps)
    for res in res_list:
        got = res["configs"]["warmup"]
        assert got["sent"] == expected
        assert got["bytes_per_step"] == sum(expected) / steps
        assert got["syncs"] == 2  # the first sync H steps after the warm-up
        assert got["follows"][:WARM] == [True] * WARM  # theta_global follows the warm-up
        assert not got["follows"][WARM]  # then local steps
        # the warm-up is data-parallel SGD on the mean gradient (float64 reference)
        want = _sgd_reference(world, WARM, WARM)
        for a, b in zip(got["snaps"][WARM - 1], want, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)
        # the compressed sync that follows starts from there: the dense tensor (5,) averages exactly
        want = _sgd_reference(world, steps, WARM, dense=(2,))
        torch.testing.assert_close(got["snaps"][-1][2].double(), want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_dense_params_send_named_tensors_dense_and_count_them_as_dense(results):
    world, res_list = results
    options, _, steps = CONFIGS["dense_params"]
    _identical(res_list, "dense_params", [H - 1, 2 * H - 1])
    expected = _expected_sent(world, options, steps)
    want = _sgd_reference(world, steps, 0, dense=(1, 2))
    for res in res_list:
        got = res["configs"]["dense_params"]
        assert got["sent"] == expected and got["syncs"] == 2
        assert got["errors"] == [0]  # only the compressed weight keeps an error buffer
        for i in (1, 2):  # "head.*": the exact DiLoCo average, no top-k, no error feedback
            torch.testing.assert_close(got["snaps"][-1][i].double(), want[i], rtol=1e-5, atol=1e-6)
        # the compressed weight syncs as without dense_params, bit for bit
        assert torch.equal(got["snaps"][-1][0], res["configs"]["plain"][0])
    assert expected[H - 1] != _expected_sent(world, {}, steps)[H - 1]


@pytest.mark.distributed
def test_muon_inner_with_both_options_keeps_replicas_identical_and_counts_bytes(results):
    world, res_list = results
    options, _, steps = CONFIGS["muon"]
    _identical(res_list, "muon", [0, H, 2 * H])  # the warm-up step and both syncs
    expected = _expected_sent(world, options, steps)
    for res in res_list:
        got = res["configs"]["muon"]
        assert got["sent"] == expected and got["syncs"] == 2
        assert all(torch.isfinite(t).all() for t in got["snaps"][-1])


@pytest.mark.distributed
def test_a_nonfinite_gradient_or_found_inf_in_the_warmup_raises_or_skips_on_every_rank(results):
    world, res_list = results
    bad = world - 1
    for res in res_list:
        f = res["faults"]
        message = f["error message"]
        assert f"non-finite gradient in 'head.weight' (64,) on rank {bad} at dense warm-up step 2" in message
        assert "no parameter and no buffer changed" in message and "nonfinite='skip'" in message
        assert f["error unchanged"] and f["error counts"] == (1, 0, 0)
        for case in ("skip", "found_inf"):
            assert f[f"{case} unchanged"], case  # the step is skipped on every rank
            assert f[f"{case} counts"] == (3, world, 0), case  # skipped_steps: once per rank
            assert "skip message" not in f and "found_inf message" not in f
        assert len(f["skip warnings"]) == 1 and "skipped a step on every rank" in f["skip warnings"][0]
        assert "at dense warm-up step 2" in f["skip warnings"][0]
        assert f["found_inf warnings"] == []
        for case in ("skip", "found_inf"):
            for a, b in zip(f[f"{case} params"], res_list[0]["faults"][f"{case} params"], strict=True):
                assert torch.equal(a, b)  # the warm-up goes on, replicas identical


@pytest.mark.distributed
def test_resume_mid_warmup_and_mid_period_is_exact(world2):
    for res in world2:
        for inner in ("muon", "sgd"):
            r = res["resume"][inner]
            assert r["syncs"] == 2  # syncs after steps 6 and 9
            assert {at: c["steps"] for at, c in r["counters"].items()} == {2: 2, 5: 5}
            assert r["counters"][5]["since_sync"] == 2
            for at, (params, sent) in r["resumed"].items():
                for a, b in zip(params, r["final"], strict=True):
                    assert torch.equal(a, b), f"{inner}: resumed at step {at}"
                # resumed comm_stats, and the first step after the load: the status row and the
                # replica check (one float64 sum per tensor)
                assert sent - r["sent"] == (len(world2) - 1) * (STATUS_ROW + 8 * len(SHAPES)), at
    for inner in ("muon", "sgd"):
        for a, b in zip(
            world2[0]["resume"][inner]["final"], world2[1]["resume"][inner]["final"], strict=True
        ):
            assert torch.equal(a, b)  # the run ends with a sync


@pytest.mark.distributed
def test_a_small_regression_with_every_option_trains_to_a_low_loss(world2):
    for res in world2:
        losses = res["regression"]["losses"]
        assert losses[-1] < 0.02 * losses[0], (losses[0], losses[-1])
        assert res["regression"]["syncs"] == (150 - 10) // 5
    for a, b in zip(world2[0]["regression"]["params"], world2[1]["regression"]["params"], strict=True):
        assert torch.equal(a, b)  # step 150 is a sync


# ----------------------------------------------------------------------------- bad input


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(t) for t in _init()]


@pytest.mark.parametrize(
    ("kwargs", "named", "error", "match"),
    [
        (dict(dense_warmup=-1), True, ValueError, r"dense_warmup must be an integer >= 0"),
        (dict(dense_warmup=2.5), True, ValueError, r"dense_warmup must be an integer >= 0"),
        (dict(dense_warmup=True), True, ValueError, r"dense_warmup must be an integer >= 0"),
        (dict(dense_params=("head",)), False, ValueError, r"pass model.named_parameters\(\)"),
        (dict(dense_params="head"), True, TypeError, r"got the string 'head'; write \('head',\)"),
        (dict(dense_params=3), True, TypeError, r"dense_params must be None or a tuple of non-empty name"),
        (dict(dense_params=("head", "")), True, TypeError, r"tuple of non-empty name substrings"),
        (
            dict(dense_params=("embed",)),
            True,
            ValueError,
            r"'embed' matches no parameter name .*'body.weight'",
        ),
    ],
)
def test_bad_option_input_fails_clearly_before_anything_changes(kwargs, named, error, match):
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(error, match=match):
        SparseLoCo(_named(params) if named else params, **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_options_off_keep_the_settings_and_a_changed_option_refuses_to_load():
    params = _params()
    plain = SparseLoCo(_named(params), dense_params=(), dense_warmup=0)
    assert plain.dense_params is None and "dense_warmup" not in settings(plain)
    assert settings(plain) == settings(SparseLoCo(params))  # off: the fingerprint of before
    opt = _opt(params, dense_warmup=3, dense_params=("head",))
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = _grad(0, step, i, p.shape)
        opt.step()
    state = opt.state_dict()
    assert records(state)["common"]["settings"]["dense_warmup"] == 3
    with pytest.raises(ValueError, match="setting 'dense_warmup' was 3, is 0 now"):
        _opt(_params(), dense_params=("head",)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"setting 'dense_params' was \['head'\], is None now"):
        _opt(_params(), dense_warmup=3).load_state_dict(state)
    _opt(_params(), dense_warmup=3, dense_params=("head",)).load_state_dict(state)


# ----------------------------------------------------------------------------- Muon


def _ns64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """float64 Newton-Schulz (Muon's quintic coefficients), independent of cokit's."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / torch.linalg.matrix_norm(y)
    for _ in range(steps):
        s = y @ y.T
        y = a * y + b * s @ y + c * s @ s @ y
    return y.T if tall else y


def _muon64(p, grads, lr, momentum, wd, nesterov=True):
    """float64 Muon steps of one matrix over ``grads``."""
    p, buf = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    rows, cols = p.shape
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        p = p * (1 - lr * wd) - lr * _ns64(u) * max(1.0, rows / cols) ** 0.5
    return p


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_a_float64_reference(shape, nesterov):
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    w = torch.nn.Parameter(start.clone())
    opt = Muon([w], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    assert set(opt.state[w]) == {"momentum_buffer"}
    want = _muon64(start, grads, 0.05, 0.9, 0.1, nesterov)
    torch.testing.assert_close(w.detach().double(), want, rtol=0, atol=5e-6)


def test_muon_steps_vectors_embeddings_and_heads_with_adamw_exactly():
    torch.manual_seed(1)
    emb, head, body = torch.randn(12, 4), torch.randn(3, 4), torch.randn(4, 4)
    bias, col = torch.randn(4), torch.randn(4, 1)
    named = [
        ("embed.weight", emb),
        ("body.weight", body),
        ("head.weight", head),
        ("body.bias", bias),
        ("c", col),
    ]
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    opt = Muon(
        [(n, p) for (n, _), p in zip(named, params, strict=True)],
        lr=0.04,
        adamw_lr_ratio=0.25,
        weight_decay=0.1,
    )
    group = opt.param_groups[0]
    assert [opt.uses_muon(p, group) for p in params] == [False, True, False, False, False]
    assert set(EXCLUDE) >= {"embed", "head"}
    # the AdamW part is torch's AdamW (same betas, eps, decoupled weight decay), bit for bit
    twins = [torch.nn.Parameter(t.clone()) for i, (_, t) in enumerate(named) if i != 1]
    ref = torch.optim.AdamW(twins, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grads = [torch.randn(p.shape) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(twins, [g for i, g in enumerate(grads) if i != 1], strict=True):
            p.grad = g.clone()
        opt.step()
        ref.step()
    for p, t in zip([p for i, p in enumerate(params) if i != 1], twins, strict=True):
        assert torch.equal(p, t)
    # without names only the shape decides; a group flag overrides it
    plain = Muon([torch.nn.Parameter(emb.clone())])
    assert plain.uses_muon(plain.param_groups[0]["params"][0], plain.param_groups[0])
    flagged = Muon([{"params": [torch.nn.Parameter(emb.clone())], "use_muon": False}])
    assert not flagged.uses_muon(flagged.param_groups[0]["params"][0], flagged.param_groups[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(use_muon=1), TypeError, "use_muon must be True, False or None"),
        (dict(exclude="embed"), TypeError, "exclude must be a tuple of non-empty name substrings"),
        (dict(ns_steps=0), ValueError, "ns_steps must be an integer >= 1"),
        (dict(momentum=1.0), ValueError, "momentum must be a finite number"),
        (dict(adamw_betas=(0.9,)), ValueError, r"adamw_betas must be a pair"),
        (dict(lr=-1.0), ValueError, "lr must be a finite number"),
    ],
)
def test_muon_bad_input_fails_clearly(kwargs, error, match):
    with pytest.raises(error, match=match):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_muon_refuses_a_vector_in_a_use_muon_group():
    with pytest.raises(ValueError, match=r"parameter 'b' of shape \(4,\); Muon needs 2-D parameters"):
        Muon([{"params": [("b", torch.nn.Parameter(torch.randn(4)))], "use_muon": True}])


def test_muon_state_dict_round_trips_exactly():
    def run(opt, params, steps):
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    torch.manual_seed(2)
    start = [torch.randn(8, 6), torch.randn(6)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = Muon(params, weight_decay=0.01)
    run(opt, params, range(3))
    saved = copy.deepcopy(opt.state_dict())
    mid = [p.detach().clone() for p in params]
    run(opt, params, range(3, 6))
    again = [torch.nn.Parameter(t) for t in mid]
    opt2 = Muon(again, weight_decay=0.01)
    opt2.load_state_dict(saved)
    run(opt2, again, range(3, 6))
    for a, b in zip(params, again, strict=True):
        assert torch.equal(a, b)


def test_the_study_runner_builds_sparseloco_with_a_muon_inner_optimizer():
    from cokit.train import INNER_OPTIMIZERS, MethodSpec, build_method

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.body = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 10)

        def forward(self, x):
            return self.head(torch.relu(self.body(self.embed(x))))

    assert "muon" in INNER_OPTIMIZERS
    torch.manual_seed(0)
    net = Net()
    spec = MethodSpec(
        "sparseloco",
        lr=0.02,
        weight_decay=0.01,
        options={"inner": "muon", "sync_every": 2, "dense_warmup": 1, "dense_params": ("head",)},
    )
    method = build_method(spec, net)
    opt = method.optimizer
    inner = opt.inner
    assert isinstance(inner, Muon) and inner.param_groups[0]["weight_decay"] == 0.01
    routed = {n: inner.uses_muon(p, inner.param_groups[0]) for n, p in net.named_parameters()}
    assert routed == {
        "embed.weight": False,
        "body.weight": True,
        "body.bias": False,
        "head.weight": False,
        "head.bias": False,
    }
    x = torch.randint(0, 10, (16,))
    for _ in range(3):
        torch.nn.functional.cross_entropy(net(x), x).backward()
        method.step()
        method.zero_grad()
    assert (opt._steps, opt.syncs) == (3, 1)
    assert "head" in repr(settings(opt)["dense_params"])
    with pytest.raises(ValueError, match=r"inner must be one of \('adamw', 'sgd', 'muon'\), got 'lion'"):
        build_method(MethodSpec("sparseloco", lr=1e-3, options={"inner": "lion"}), Net())


def test_the_study_runners_dense_ends_sends_the_input_and_output_layers_dense():
    from cokit.train import MethodSpec, build_method

    net = torch.nn.Sequential(torch.nn.Embedding(10, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
    spec = MethodSpec("sparseloco", lr=1e-3, options={"sync_every": 2, "dense_ends": True})
    opt = build_method(spec, net).optimizer
    assert opt.dense_params == ("0.weight", "2.weight")  # no "emb" in the names: first and last matrix
    dense = {n for b in opt.plan.buckets() for n in b.members if b.dense}
    assert {0, 3} <= dense and 1 not in dense  # the 64x64 body stays compressed
