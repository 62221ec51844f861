"""Low-precision writes (compress/precision.py): stochastic rounding, masters, the warning."""

import math
import uuid
import warnings

import pytest
import torch
from tolerances import STOCHASTIC_SIGMAS

from cokit.compress import precision as prec
from cokit.compress.precision import (
    PRECISIONS,
    LowPrecisionWarning,
    check_precision,
    master_copy,
    rounding_generator,
    stochastic_round,
    warn_if_unmastered,
    write_update,
)

LOW = [torch.bfloat16, torch.float16]
DRAWS = 20_000


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable values of ``dtype`` just below and just above each (finite, in-range)
    float32 value, found with round-to-nearest and nextafter (independently of the code)."""
    c = x.to(dtype)
    up = torch.nextafter(c, torch.full_like(c, math.inf))
    down = torch.nextafter(c, torch.full_like(c, -math.inf))
    below = c.float() <= x
    lo = torch.where(below, c, down)
    hi = torch.where(below, up, c)
    return lo.float(), hi.float()


def log_spread(n: int, lo_exp: int, hi_exp: int, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` float32 values with random signs, log-uniform in magnitude over [2**lo, 2**hi)."""
    e = torch.rand(n, generator=gen) * (hi_exp - lo_exp) + lo_exp
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(e)).to(device)


# Values with a fractional position between neighbours: plain, negative, tiny (subnormal in
# fp16), just below a power of two, and just under the largest finite value.
SAMPLES = {
    torch.bfloat16: [1.0 + 0.3 * 2**-7, -0.1234567, 3.1e-39, 0.9999, -7.77e-5, 3.38e38],
    torch.float16: [1.0 + 0.3 * 2**-10, -0.1234567, 3.7e-6, 1.3e-8, 0.9999, -7.77e-5, 65490.0],
}


# ----------------------------------------------------------------------------- stochastic_round
@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(dtype, device):
    gen = rounding_generator(1, 0, device)
    for value in SAMPLES[dtype]:
        x = torch.full((DRAWS,), value, dtype=torch.float32, device=device)
        lo, hi = (t[0].item() for t in neighbours(x[:1], dtype))
        assert lo < x[0].item() < hi, (value, lo, hi)
        out = stochastic_round(x, dtype, gen).double()
        assert out.dtype == torch.float64
        assert bool(((out == lo) | (out == hi)).all()), value
        p = (x[0].item() - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / DRAWS)
        mean = out.mean().item()
        bound = STOCHASTIC_SIGMAS * sigma
        assert abs(mean - x[0].item()) <= bound, (value, mean, bound)
        share_up = (out == hi).double().mean().item()
        assert abs(share_up - p) <= STOCHASTIC_SIGMAS * math.sqrt(p * (1 - p) / DRAWS), (value, share_up, p)


@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_rounding_only_ever_gives_a_neighbour(dtype, device):
    data = torch.Generator().manual_seed(3)
    hi_exp = 127 if dtype == torch.bfloat16 else 15
    x = log_spread(50_000, -140, hi_exp, data, device)
    lo, hi = neighbours(x, dtype)
    for step in range(3):
        out = stochastic_round(x, dtype, rounding_generator(0, step, device)).float()
        assert bool(((out == lo) | (out == hi)).all())
        assert bool((torch.signbit(out) == torch.signbit(x)).all())


@pytest.mark.parametrize("dtype", LOW)
def test_representable_values_are_kept_exactly(dtype, device):
    data = torch.Generator().manual_seed(4)
    hi_exp = 127 if dtype == torch.bfloat16 else 15
    x = log_spread(20_000, -140, hi_exp, data, device).to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    edges = torch.tensor([tiny, tiny / 2, torch.finfo(dtype).max, -torch.finfo(dtype).max], dtype=dtype)
    x = torch.cat([x, edges.to(device)])
    out = stochastic_round(x.float(), dtype, rounding_generator(0, 0, device))
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_rounding_is_bit_reproducible(dtype, device):
    x = log_spread(10_000, -20, 10, torch.Generator().manual_seed(5), device)
    a = stochastic_round(x, dtype, rounding_generator(7, 3, device))
    b = stochastic_round(x, dtype, rounding_generator(7, 3, device))
    c = stochastic_round(x, dtype, rounding_generator(7, 4, device))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))  # a new step draws anew


@pytest.mark.parametrize("dtype", LOW)
def test_special_values(dtype, device):
    big = torch.finfo(dtype).max
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, big, -big], device=device)
    out = stochastic_round(x, dtype, rounding_generator(0, 0, device)).float()
    assert out[0].item() == 0.0 and not torch.signbit(out[0])
    assert out[1].item() == 0.0 and torch.signbit(out[1])  # -0 stays -0
    assert out[2].item() == math.inf and out[3].item() == -math.inf
    assert math.isnan(out[4].item())
    # NaN payloads at the top of the bit range (0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001) stay NaN
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -8388607], dtype=torch.int32).view(torch.float32)
    nans = nans.repeat(1000).to(device)
    assert bool(torch.isnan(stochastic_round(nans, dtype, rounding_generator(0, 1, device))).all())
    assert out[5].item() == big and out[6].item() == -big
    # Finite values past the largest finite value saturate to it, on every draw (round-to-nearest
    # would give inf from max + half a spacing on).
    past = torch.tensor([big * 1.001, -big * 1.001, 3.4e38, -3.4e38], device=device).repeat(2000)
    for step in range(3):
        sat = stochastic_round(past, dtype, rounding_generator(0, step, device)).float()
        assert bool((sat.abs() == big).all()) and bool((torch.signbit(sat) == torch.signbit(past)).all())


def test_stochastic_round_refuses_wrong_dtypes():
    gen = rounding_generator(0, 0, "cpu")
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(torch.ones(3, dtype=torch.float64), torch.bfloat16, gen)
    with pytest.raises(TypeError, match=r"bfloat16 or torch\.float16"):
        stochastic_round(torch.ones(3), torch.float32, gen)


# ----------------------------------------------------------------------------- small helpers
def test_check_precision():
    for p in PRECISIONS:
        assert check_precision("DeMo", p) == p
    for bad in ("fp32", "Nearest", None, 1):
        with pytest.raises(
            ValueError, match=r"DeMo: precision must be one of 'nearest', 'master', 'stochastic'"
        ):
            check_precision("DeMo", bad)


def test_rounding_generator_is_deterministic_per_seed_and_step():
    def draw(seed, step):
        return torch.randint(0, 1 << 30, (8,), generator=rounding_generator(seed, step, "cpu"))

    assert torch.equal(draw(1, 2), draw(1, 2))
    assert not torch.equal(draw(1, 2), draw(1, 3))
    assert not torch.equal(draw(1, 2), draw(2, 2))
    assert not torch.equal(draw(1, 2), draw(2, 1))  # (seed, step) is not summed
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="int >= 0"):
            rounding_generator(bad, 0, "cpu")
        with pytest.raises(ValueError, match="int >= 0"):
            rounding_generator(0, bad, "cpu")


def test_master_copy_is_a_detached_contiguous_fp32_clone():
    p = torch.randn(6, 4).to(torch.bfloat16).t().requires_grad_()
    m = master_copy(p)
    assert m.dtype == torch.float32 and m.is_contiguous() and not m.requires_grad
    assert m.shape == p.shape and torch.equal(m, p.detach().float())
    m.add_(1.0)
    assert not torch.equal(m, p.detach().float())  # its own storage


# ----------------------------------------------------------------------------- write_update
@pytest.mark.parametrize("dtype", LOW)
def test_write_update_modes(dtype):
    new = torch.randn(64, 32) * 0.1
    p = torch.zeros(64, 32, dtype=dtype, requires_grad=True)
    write_update(p, new, "nearest", master=None, generator=None)
    assert torch.equal(p.detach(), new.to(dtype))

    m = master_copy(p)
    write_update(p, new, "master", master=m, generator=None)
    assert torch.equal(m, new) and torch.equal(p.detach(), new.to(dtype))

    write_update(p, new, "stochastic", master=None, generator=rounding_generator(9, 1, "cpu"))
    want = stochastic_round(new, dtype, rounding_generator(9, 1, "cpu"))
    assert torch.equal(p.detach().view(torch.int16), want.view(torch.int16))


def test_fp32_params_are_copied_exactly_in_every_mode():
    new = torch.randn(100) * 1e-3 + 1.0
    for mode in PRECISIONS:
        p = torch.zeros(100)
        gen = rounding_generator(0, 0, "cpu") if mode == "stochastic" else None
        write_update(p, new, mode, master=None, generator=gen)
        assert torch.equal(p, new), mode


@pytest.mark.parametrize("dtype", LOW)
def test_small_updates_survive_with_master_and_stochastic_but_not_nearest(dtype):
    """100 sign steps of lr=1e-3 on weights of 1.0: each step is under half a spacing (bf16:
    2**-9, fp16: 2**-12 is not, so fp16 uses lr=1e-4), so nearest never moves."""
    lr = 1e-3 if dtype == torch.bfloat16 else 1e-4
    steps, n = 100, 4096
    ends = {}
    for mode in PRECISIONS:
        p = torch.ones(n, dtype=dtype)
        m = master_copy(p) if mode == "master" else None
        for step in range(steps):
            base = m if m is not None else p.float()
            gen = rounding_generator(0, step, "cpu") if mode == "stochastic" else None
            write_update(p, base - lr, mode, master=m, generator=gen)
        ends[mode] = p.float()
    target = 1.0 - steps * lr
    assert bool((ends["nearest"] == 1.0).all())
    assert torch.equal(ends["master"], torch.full((n,), target).to(dtype).float())
    # Per weight the stochastic sum has variance <= steps * spacing**2 / 4 (spacing 2**-8 or
    # 2**-11 below 1); the mean over n weights is within STOCHASTIC_SIGMAS (6) sigma of the target.
    spacing = 2**-8 if dtype == torch.bfloat16 else 2**-11
    bound = STOCHASTIC_SIGMAS * math.sqrt(steps / 4 / n) * spacing
    assert abs(ends["stochastic"].mean().item() - target) <= bound


def _bad_calls():
    """(description, kwargs overrides, exception, message regex) for write_update."""
    p = torch.zeros(4, 3, dtype=torch.bfloat16)
    gen = rounding_generator(0, 0, "cpu")
    good_new = torch.ones(4, 3)
    return (
        p,
        [
            ("precision", {"precision": "fp32"}, ValueError, "precision must be one of"),
            ("new fp64", {"new": good_new.double()}, TypeError, "new_value_fp32 must be float32"),
            ("new bf16", {"new": good_new.bfloat16()}, TypeError, "new_value_fp32 must be float32"),
            ("new shape", {"new": torch.ones(3, 4)}, ValueError, r"shape \(3, 4\), param \(4, 3\)"),
            (
                "new device",
                {"new": torch.ones(4, 3, device="meta")},
                ValueError,
                "on meta but param is on cpu",
            ),
            ("new not a tensor", {"new": [1.0]}, TypeError, "must be a torch.Tensor"),
            ("master missing", {"precision": "master"}, ValueError, "create it once with master_copy"),
            (
                "master bf16",
                {"precision": "master", "master": torch.zeros(4, 3, dtype=torch.bfloat16)},
                TypeError,
                "master must be float32",
            ),
            (
                "master shape",
                {"precision": "master", "master": torch.zeros(12)},
                ValueError,
                "master has shape",
            ),
            ("master in nearest", {"master": torch.zeros(4, 3)}, ValueError, "pass master=None"),
            (
                "generator missing",
                {"precision": "stochastic", "generator": None},
                ValueError,
                "rounding_generator",
            ),
            ("generator type", {"precision": "stochastic", "generator": 3}, TypeError, "torch.Generator"),
        ],
        gen,
        good_new,
    )


@pytest.mark.parametrize("case", range(len(_bad_calls()[1])))
def test_write_update_refuses_bad_arguments_before_writing(case):
    p, cases, gen, good_new = _bad_calls()
    _, over, exc, msg = cases[case]
    kw = {"precision": "nearest", "new": good_new, "master": None, "generator": gen, **over}
    master = kw["master"]
    before_p = p.clone()
    before_m = master.clone() if isinstance(master, torch.Tensor) else None
    with pytest.raises(exc, match=msg):
        write_update(p, kw["new"], kw["precision"], master=master, generator=kw["generator"])
    assert torch.equal(p, before_p)
    if before_m is not None and master.device.type != "meta":
        assert torch.equal(master, before_m)


def test_write_update_refuses_other_param_dtypes_and_stray_masters():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        write_update(
            torch.zeros(3, dtype=torch.float64), torch.ones(3), "nearest", master=None, generator=None
        )
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="only kept for bfloat16/float16"):
        write_update(p, torch.ones(3), "master", master=torch.zeros(3), generator=None)
    assert torch.equal(p, torch.zeros(3))


def test_generator_device_check():
    assert prec._same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not prec._same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not prec._same_device(torch.device("cpu"), torch.device("cuda", 0))
    if torch.cuda.is_available():
        p = torch.zeros(3, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="generator is on cpu"):
            write_update(
                p, torch.ones(3, device="cuda"), "stochastic", master=None, generator=torch.Generator()
            )
        assert not p.any()


# ----------------------------------------------------------------------------- the warning
def _owner() -> str:
    return f"Opt-{uuid.uuid4().hex[:8]}"  # the warning is once per owner and process


def test_warns_once_per_owner_for_low_precision_nearest():
    owner = _owner()
    params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)]
    with pytest.warns(LowPrecisionWarning, match=r"1 of 2 parameters are bfloat16") as rec:
        warn_if_unmastered(owner, params, "nearest")
    text = str(rec[0].message)
    assert owner in text and "precision='master'" in text and "precision='stochastic'" in text
    assert "lost" in text and "lr=1e-3" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unmastered(owner, params, "nearest")  # once only
        other = _owner()
        warn_if_unmastered(other, [torch.zeros(3)], "nearest")  # fp32 only: nothing to say
        warn_if_unmastered(other, params, "master")
        warn_if_unmastered(other, params, "stochastic")
    with pytest.warns(LowPrecisionWarning, match="float16"):
        warn_if_unmastered(other, [torch.zeros(2, dtype=torch.float16)], "nearest")
    with pytest.raises(ValueError, match="precision must be one of"):
        warn_if_unmastered(_owner(), params, "bf16")


def test_the_numbers_the_warning_cites():
    """The warning says: sign steps of lr=1e-3 freeze bf16 weights with |w| > 0.5 (62% of
    N(0, 1)) and lr=1e-4 freezes |w| > 1/32 (12% of N(0, 0.02)). Check them."""
    gen = torch.Generator().manual_seed(0)

    def frozen(w: torch.Tensor, lr: float) -> torch.Tensor:
        w = w.to(torch.bfloat16)
        sign = torch.where(torch.rand(w.shape, generator=gen) < 0.5, -1.0, 1.0)
        return (w.float() - lr * sign).to(torch.bfloat16) == w

    w = (
        torch.linspace(-4, 4, 100_001).to(torch.bfloat16).float()
    )  # at exact powers of two a step moves one way only
    f = frozen(w, 1e-3)
    assert bool(f[w.abs() > 0.5].all()) and not bool(f[w.abs() < 0.5].any())
    f = frozen(w, 1e-4)
    assert bool(f[w.abs() > 2**-5].all()) and not bool(f[w.abs() < 2**-5].any())
    share = frozen(torch.randn(200_000, generator=gen), 1e-3).float().mean().item()
    assert 0.60 < share < 0.64
    share = frozen(torch.randn(200_000, generator=gen) * 0.02, 1e-4).float().mean().item()
    assert 0.10 < share < 0.14


def test_fp16_round_up_probability_is_exact():
    """P(up) = threshold / 2**31 equals (|x| - lower) / spacing exactly (as fractions) for every
    |x| >= 2**-32, and overshoots it by less than 2**-31 below."""
    from fractions import Fraction

    x = log_spread(3000, -40, 16, torch.Generator().manual_seed(6), "cpu")
    x = x[x.abs() < 65504]
    lo, hi = neighbours(x, torch.float16)
    q, spacing, threshold = prec._fp16_split(x)
    for xi, l, h, t, qi, s in zip(
        x.tolist(), lo.tolist(), hi.tolist(), threshold.tolist(), q.tolist(), spacing.tolist(), strict=True
    ):
        lower = min(abs(l), abs(h))
        assert Fraction(qi) * Fraction(s) == Fraction(lower)
        want = (Fraction(abs(xi)) - Fraction(lower)) / Fraction(abs(h - l))
        got = Fraction(t, 1 << 31)
        if abs(xi) >= 2.0**-32:
            assert got == want, xi
        else:
            assert 0 <= got - want < Fraction(1, 1 << 31), xi
