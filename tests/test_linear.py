"""cokit.triton_kernels.linear.linear (``F.linear`` on the Triton GEMM) and cokit.overlap.layers.Linear
vs a float64 reference (on the ``device`` fixture: the GPU when there is one, else the Triton
interpreter on CPU); autograd, the cokit::linear op (opcheck, torch.compile), autocast,
``from_linear``, configs and every bad input."""

from __future__ import annotations

import os

import pytest
import torch
from tolerances import (
    BF16_AUTOCAST,
    BIAS_GRAD_ATOL,
    BIAS_GRAD_ROUNDINGS,
    FP32_CLOSE,
    UNIT_ROUNDOFF,
    fp32_accumulation_bound,
)

import cokit.triton_kernels.linear as L
from cokit.overlap.layers import Linear
from cokit.triton_kernels import gemm as G
from cokit.triton_kernels.gemm_config import GemmConfig
from cokit.triton_kernels.linear import linear

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (in_features, out_features, batch dims): odd sizes (masked tiles), N-D and 1-D inputs
SHAPES = [(17, 33, (2, 3)), (17, 33, ()), (40, 5, (7,))]
SMALL = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_stages=1)


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    """GEMMs tuned on a GPU write their winners to a throwaway cache, not ~/.cache/cokit."""
    if "COKIT_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cokit-cache"))


@pytest.fixture
def gemm_calls(monkeypatch) -> list[dict]:
    """Every GEMM the linear op launches writes into a NaN-poisoned output (so an unwritten
    element fails the check) and is recorded here: its operand shapes and keywords."""
    calls: list[dict] = []
    real_gemm = G.gemm

    def poisoned_gemm(a, b, bias=None, **kw):
        calls.append({"a": tuple(a.shape), "b": tuple(b.shape), **kw})
        out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=a.dtype, device=a.device)
        return real_gemm(a, b, bias, out=out, **kw)

    monkeypatch.setattr(G, "gemm", poisoned_gemm)
    return calls


def _check(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``c`` equals ``a @ b (+ bias)`` (float64) within the fp32-accumulation bound
    ``2 * (eps_out * |ref| + K * 2^-24 * (|a| @ |b| + |bias|))`` (``tolerances.
    fp32_accumulation_bound``, as tests/test_gemm.py)."""
    ref = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    assert c.shape == ref.shape, (c.shape, ref.shape)
    assert torch.isfinite(c).all(), "output not fully written (NaN poison left)"
    tol = fp32_accumulation_bound(ref, mag, a.shape[1], c.dtype)
    worst = ((c.double() - ref).abs() / tol).max().item()
    assert worst <= 1.0, f"error exceeds bound by {worst:.2f}x"


def _inputs(in_f, out_f, batch, dtype, device, bias=True, grad=False):
    x = torch.randn(*batch, in_f, device=device).to(dtype).requires_grad_(grad)
    w = torch.randn(out_f, in_f, device=device).to(dtype).requires_grad_(grad)
    b = torch.randn(out_f, device=device).to(dtype).requires_grad_(grad) if bias else None
    return x, w, b


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}to{s[1]}-batch{'x'.join(map(str, s[2]))}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_linear_vs_float64(dtype, shape, bias, device, gemm_calls):
    in_f, out_f, batch = shape
    x, w, b = _inputs(in_f, out_f, batch, dtype, device, bias)
    y = linear(x, w, b)
    assert y.shape == (*batch, out_f) and y.dtype == dtype and y.device == x.device
    assert len(gemm_calls) == 1 and gemm_calls[0]["a"] == (max(1, x.numel() // in_f), in_f)
    _check(y.reshape(-1, out_f), x.reshape(-1, in_f), w.t(), b)
    # the same shape as torch's F.linear (1-D input: a 1-D output)
    assert y.shape == torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).shape


def test_linear_empty_dims(device):
    """Like F.linear: an empty batch gives an empty output; in_features=0 gives the bias."""
    w, b = torch.randn(6, 4, device=device), torch.randn(6, device=device)
    assert linear(torch.randn(0, 3, 4, device=device), w, b).shape == (0, 3, 6)
    out = linear(torch.randn(2, 0, device=device), torch.randn(6, 0, device=device), b)
    torch.testing.assert_close(out, b.expand(2, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_grads_vs_float64(dtype, device, gemm_calls):
    """dX = dY W, dW = dY^T X (both through the kernel, checked against float64), db = sum dY."""
    x, w, b = _inputs(17, 33, (2, 3), dtype, device, grad=True)
    y = linear(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    assert len(gemm_calls) == 3  # forward, dX, dW
    g2, x2 = g.reshape(-1, 33), x.detach().reshape(-1, 17)
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    _check(x.grad.reshape(-1, 17), g2, w.detach())
    _check(w.grad, g2.t(), x2)
    torch.testing.assert_close(
        b.grad.double(),
        g2.double().sum(0),
        rtol=BIAS_GRAD_ROUNDINGS * UNIT_ROUNDOFF[dtype],
        atol=BIAS_GRAD_ATOL,
    )


def test_linear_gradcheck_no_bias_1d(device):
    """1-D input without bias: the grads equal float64 F.linear's (autograd.grad)."""
    x, w, _ = _inputs(20, 9, (), torch.float32, device, bias=False, grad=True)
    gx, gw = torch.autograd.grad(linear(x, w).square().sum(), (x, w))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rx, rw = torch.autograd.grad(torch.nn.functional.linear(x64, w64).square().sum(), (x64, w64))
    torch.testing.assert_close(gx.double(), rx, **FP32_CLOSE)
    torch.testing.assert_close(gw.double(), rw, **FP32_CLOSE)


# ---------------------------------------------------------------------- the op
def test_linear_opcheck(device):
    x, w, b = _inputs(20, 7, (9,), torch.float32, device, grad=True)
    torch.library.opcheck(torch.ops.cokit.linear.default, (x, w, b, "", "ieee", False))
    spec = SMALL.replace(persistent=True, num_sms=2).spec()
    torch.library.opcheck(
        torch.ops.cokit.linear.default, (x.detach().t().contiguous().t(), w, None, spec, "tf32", True)
    )


def _model(device: torch.device) -> torch.nn.Module:
    return torch.nn.Sequential(
        Linear(17, 33, device=device), torch.nn.ReLU(), Linear(33, 5, bias=False, device=device, config=SMALL)
    )


def test_torch_compile_fullgraph_equals_eager(device):
    model = _model(device)
    x = torch.randn(2, 3, 17, device=device)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager, **FP32_CLOSE)
    out.sum().backward()
    for p, ref in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, ref, **FP32_CLOSE)
    # dynamic batch dims and an N-D input through one graph
    dyn = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in ((4, 17), (2, 5, 17)):
        x = torch.randn(*shape, device=device)
        torch.testing.assert_close(dyn(x), model(x), **FP32_CLOSE)


def test_autocast_cpu_bf16_matches_nn_linear():
    """Under CPU bf16 autocast the output is bf16, as nn.Linear's, and close to it; the fp32
    parameters get fp32 grads."""
    ref = torch.nn.Linear(17, 33)
    mod = Linear.from_linear(ref)
    x = torch.randn(4, 17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = ref(x), mod(x)
        # mixed fp16/fp32 operands are cast first, as F.linear's (no dtype-mismatch error)
        mixed = linear(x.half(), ref.weight, ref.bias)
        assert mixed.dtype == torch.nn.functional.linear(x.half(), ref.weight, ref.bias).dtype
    assert want.dtype == got.dtype == mixed.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_AUTOCAST, atol=BF16_AUTOCAST)
    got.float().sum().backward()
    assert mod.weight.grad is not None and mod.weight.grad.dtype == torch.float32
    # outside autocast: fp32 again
    assert mod(x).dtype == torch.float32


# ---------------------------------------------------------------------- the module
def test_init_matches_nn_linear_and_from_linear(device):
    torch.manual_seed(3)
    ref = torch.nn.Linear(17, 33, device=device)
    torch.manual_seed(3)
    mod = Linear(17, 33, device=device)
    assert torch.equal(mod.weight, ref.weight) and torch.equal(mod.bias, ref.bias)
    assert [n for n, _ in mod.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(2, 3, 17, device=device)
    torch.testing.assert_close(mod(x), ref(x), **FP32_CLOSE)
    shared = Linear.from_linear(ref, config=SMALL)
    assert shared.weight is ref.weight and shared.bias is ref.bias and shared.config == SMALL
    torch.testing.assert_close(shared(x), ref(x), **FP32_CLOSE)
    # state dicts are interchangeable
    other = Linear(17, 33, device=device)
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.weight, ref.weight)
    nobias = Linear.from_linear(torch.nn.Linear(4, 2, bias=False, dtype=torch.float16))
    assert nobias.bias is None and nobias.weight.dtype == torch.float16
    assert repr(nobias) == "Linear(in_features=4, out_features=2, bias=False)"
    assert "config='BLOCK_M=16" in repr(shared)
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Linear, got Conv1d"):
        Linear.from_linear(torch.nn.Conv1d(2, 2, 1))


def test_old_ops_path_warns_and_gives_the_same_ops():
    """``cokit.ops`` is the old path of the functional ops: it works for one release, with a
    DeprecationWarning that names the new home and points at the caller's line."""
    import cokit.ops

    with pytest.warns(
        DeprecationWarning, match=r"cokit\.ops\.linear moved to cokit\.triton_kernels\.linear"
    ) as w:
        assert cokit.ops.linear is linear
    assert w[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"cokit\.triton_kernels\.gemm\.matmul"):
        from cokit.ops import matmul
    assert matmul is G.matmul
    with pytest.raises(AttributeError, match="has no attribute 'gemm'"):
        cokit.ops.gemm  # noqa: B018


# ---------------------------------------------------------------------- configs
def test_given_config_is_used_forward_and_backward(device, gemm_calls):
    cfg = SMALL.replace(persistent=True, num_sms=2)
    x, w, b = _inputs(17, 33, (5,), torch.float32, device, grad=True)
    y = linear(x, w, b, config=cfg)
    _check(y.detach(), x.detach(), w.detach().t(), b.detach())
    y.sum().backward()
    assert [c["config"] for c in gemm_calls] == [cfg] * 3
    assert all(c["persistent"] is None for c in gemm_calls)  # the config decides the form
    linear(x, w, persistent=True)
    assert gemm_calls[-1]["config"] is None and gemm_calls[-1]["persistent"] is True


def test_invalid_config_raises(device):
    x, w, b = _inputs(17, 33, (5,), torch.float32, device)
    with pytest.raises(ValueError, match="BLOCK_M=24 is invalid"):
        linear(x, w, b, config=GemmConfig(BLOCK_M=24))
    with pytest.raises(ValueError, match="num_sms=2 applies to the persistent form only"):
        Linear(17, 33, device=device, config=GemmConfig(num_sms=2))(x)


# ---------------------------------------------------------------------- bad input
_W = (6, 4)
BAD = [
    ("weight 1-D", dict(w=(4,)), ValueError, r"weight must be 2-D \(out_features, in_features\)"),
    ("weight 3-D", dict(w=(6, 4, 1)), ValueError, "weight must be 2-D"),
    ("last dim", dict(x=(3, 5)), ValueError, r"input.shape\[-1\] must equal in_features=4"),
    ("0-D input", dict(x=()), ValueError, "input must have at least 1 dimension"),
    ("bias shape", dict(b=(4,)), ValueError, r"bias must have shape \(6,\)"),
    ("bias 2-D", dict(b=(1, 6)), ValueError, r"bias must have shape \(6,\)"),
    ("weight dtype", dict(w_dtype=torch.float16), ValueError, "input and weight must have the same dtype"),
    ("bias dtype", dict(b_dtype=torch.bfloat16), ValueError, "input and bias must have the same dtype"),
    ("fp64", dict(dtype=torch.float64), ValueError, "dtype torch.float64 is not supported"),
    ("int", dict(dtype=torch.int32), ValueError, "dtype torch.int32 is not supported"),
    ("weight device", dict(w_device="meta"), ValueError, "input and weight must be on the same device"),
    ("bias device", dict(b_device="meta"), ValueError, "input and bias must be on the same device"),
    ("precision", dict(precision="fp8"), ValueError, "precision='fp8' is invalid; allowed: ieee, tf32"),
    ("config type", dict(config="BLOCK_M=16"), TypeError, "config must be a GemmConfig or None, got str"),
    ("persistent", dict(config=GemmConfig(), persistent=True), ValueError, "persistent=True contradicts"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_any_work(case, device, monkeypatch):
    _, kw, exc, match = case
    dtype = kw.get("dtype", torch.float32)

    def make(key, default):
        return torch.zeros(
            kw.get(key, default), dtype=kw.get(f"{key}_dtype", dtype), device=kw.get(f"{key}_device", device)
        )

    x, w, b = make("x", (3, 4)), make("w", _W), make("b", (6,))

    def no_work(*args, **kwargs):
        raise AssertionError("the op ran on bad input")

    monkeypatch.setattr(L, "_linear_op", no_work)
    opts = {k: kw[k] for k in ("config", "precision", "persistent") if k in kw}
    with pytest.raises(exc, match=match):
        linear(x, w, b, **opts)


def test_non_tensors_raise_type_error(device):
    w = torch.zeros(6, 4, device=device)
    with pytest.raises(TypeError, match=r"input must be a torch\.Tensor, got list"):
        linear([1.0, 2.0, 3.0, 4.0], w)
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor, got NoneType"):
        linear(torch.zeros(4, device=device), None)
    with pytest.raises(TypeError, match=r"bias must be a torch\.Tensor or None, got float"):
        linear(torch.zeros(4, device=device), w, 0.0)


# ---------------------------------------------------------------------- the torch path
@pytest.fixture
def torch_path(monkeypatch) -> None:
    """CPU tensors without the interpreter: the GEMM would run torch code, so linear and Linear
    call F.linear; the op must not run (it would only add its dispatch and copies)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def no_op(*args, **kwargs):
        raise AssertionError("cokit::linear ran where the torch path takes F.linear")

    monkeypatch.setattr(L, "_linear_op", no_op)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}to{s[1]}-batch{'x'.join(map(str, s[2]))}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_torch_path_is_f_linear_within_the_kernel_bound(dtype, shape, bias, torch_path):
    """On the torch path the functional and the module are F.linear: the same values (bitwise)
    and grads as nn.Linear, within the fp32-accumulation bound of the kernel's float64 check."""
    in_f, out_f, batch = shape
    x, w, b = _inputs(in_f, out_f, batch, dtype, "cpu", bias)
    y = linear(x, w, b)
    assert y.shape == (*batch, out_f) and y.dtype == dtype
    _check(y.reshape(-1, out_f), x.reshape(-1, in_f), w.t(), b)
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    ref = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    mod = Linear.from_linear(ref, config=SMALL)  # a config changes nothing on the torch path
    xg = x.detach().requires_grad_()
    out = mod(xg)
    assert torch.equal(out, ref(xg))
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, xg, g)
    (want,) = torch.autograd.grad(ref(xg), xg, g)
    assert torch.equal(got, want)


def test_torch_path_follows_the_interpreter_setting_per_call(monkeypatch, gemm_calls):
    """The setting is read at every call, as kernel_path reads it: switching it switches the
    path of an existing layer (the op under the interpreter, F.linear without)."""
    mod = Linear(17, 33)
    x = torch.randn(4, 17)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod(x)
    assert len(gemm_calls) == 1
    for off in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", off)
        mod(x)
        linear(x, mod.weight, mod.bias)
    monkeypatch.delenv("TRITON_INTERPRET")
    mod(x)
    assert len(gemm_calls) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    linear(x, mod.weight)
    assert len(gemm_calls) == 2


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_torch_path_refuses_bad_input_like_the_kernel_path(case, torch_path):
    """The same errors as on the kernel path, functional and module alike (F.linear's own
    refusals are explained by linear's checks)."""
    _, kw, exc, match = case
    dtype = kw.get("dtype", torch.float32)

    def make(key, default):
        return torch.zeros(
            kw.get(key, default), dtype=kw.get(f"{key}_dtype", dtype), device=kw.get(f"{key}_device", "cpu")
        )

    x, w, b = make("x", (3, 4)), make("w", _W), make("b", (6,))
    opts = {k: kw[k] for k in ("config", "precision", "persistent") if k in kw}
    with pytest.raises(exc, match=match):
        linear(x, w, b, **opts)
    if "x" in kw or dtype == torch.float64 or opts:  # what a module's input or options can get wrong
        mod = Linear(4, 6, dtype=dtype)
        with pytest.raises(exc, match=match):
            for key, value in opts.items():
                setattr(mod, key, value)
            mod(x)


def test_torch_path_checks_options_once_when_set(torch_path):
    """A layer's options are checked when set, not per call: a bad one raises at the next
    forward (the same error as the kernel path), a good one puts the fast path back."""
    mod = Linear(17, 33)
    x = torch.randn(5, 17)
    mod.config = GemmConfig(BLOCK_M=24)
    with pytest.raises(ValueError, match="BLOCK_M=24 is invalid"):
        mod(x)
    mod.config = GemmConfig(num_sms=2)
    with pytest.raises(ValueError, match="num_sms=2 applies to the persistent form only"):
        mod(x)
    mod.config = SMALL
    mod.precision = "fp8"
    with pytest.raises(ValueError, match="precision='fp8' is invalid"):
        mod(x)
    mod.precision = "tf32"
    mod.persistent = True
    with pytest.raises(ValueError, match="persistent=True contradicts"):
        mod(x)
    mod.persistent = False
    torch.testing.assert_close(mod(x), torch.nn.functional.linear(x, mod.weight, mod.bias))
    assert repr(mod).endswith("precision='tf32')")
    with pytest.raises(ValueError, match=r"dtype torch\.float64 is not supported"):
        mod.double()(x.double())  # the kernels' dtypes on every path, F.linear's or not


def test_torch_path_autocast_and_compile(torch_path):
    """Autocast casts as F.linear's (it is F.linear); torch.compile traces F.linear (no op)."""
    ref = torch.nn.Linear(17, 33)
    mod = Linear.from_linear(ref)
    x = torch.randn(4, 17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mod(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref(x))
        assert linear(x.half(), ref.weight, ref.bias).dtype == torch.bfloat16
    compiled = torch.compile(torch.nn.Sequential(mod, torch.nn.ReLU()), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), torch.relu(ref(x)), rtol=1e-6, atol=1e-6)
