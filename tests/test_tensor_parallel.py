"""cokit.overlap.tensor_parallel on real gloo process groups (world 2 and 3).

Every rank builds the same dense ``nn.Linear`` layers (same seed, same inputs: what one process
would compute), shards them with ``from_linear``, runs the tensor-parallel forward and backward
on its part of the problem, and compares the output and the input, weight and bias gradients
with the matching part of the dense fp32 result. Each case runs on every rank and every rank's
verdicts are checked. All cases of a world size run in ONE spawned world (gloo_cases), so the
process start-up is paid twice for the whole file.

Poison: the workers turn on ``torch.use_deterministic_algorithms`` (warn only), under which torch
fills every ``torch.empty`` with NaN. The schedules build their outputs and gather buffers
with ``torch.empty`` (the layers have no ``out=``), so a row, chunk or feature slice that
a schedule fails to write stays NaN and fails the finiteness check.

Bounds (never bitwise: CPU BLAS picks its blocking from the shape, so the chunked GEMMs of the
schedules and the dense GEMM round differently). :func:`error_bounds` propagates, per element,
a bound on |computed - exact| through the network, in float64 from the exact values:

* a GEMM of reduction length K whose result is also summed over W ranks, plus a bias, puts
  every product through at most K + W + 1 roundings, so it lies within
  ``gamma_{K+W+1} * (|a| @ |b| + |bias|)`` of the exact value (Higham, Accuracy and Stability
  of Numerical Algorithms, §3.1; gamma_n = n u / (1 - n u), u = 2^-24), whatever the order of
  the additions (BLAS blocking, chunking, gloo's reduction). Input errors ``e_a`` (of an
  earlier layer) add ``e_a @ |b|`` (the weights are exact: the same on both sides);
* the weight gradient ``g^T @ a`` is a GEMM of reduction length M (the rows), the bias
  gradient a sum of M rows (gamma_M);
* GELU: |gelu'| <= 1.13 and |gelu''| <= 0.8 (their maxima, 1.129 at x = sqrt 2 and 2 phi(0)),
  and each evaluation of gelu or gelu' adds at most 8 u (resp. 16 u) of its inputs' size.

Both the tensor-parallel and the dense result are computed evaluations, so they differ by at
most twice the bound. The bounds are a few K u relative to the magnitudes (|x| @ |W|), far
below what a missing or duplicated rank, chunk or bias would change.
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_cases import Case, run_cases

pytestmark = pytest.mark.distributed

U = 2.0**-24
GELU_D1, GELU_D2 = 1.13, 0.8  # max |gelu'|, max |gelu''|
IN, HID = 12, 18  # divisible by 2 and 3 where sharded


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def error_bounds(x, weights, biases, r, world):
    """Per-element bounds (float64) on |computed - exact| of the output and of the gradients
    of ``loss = sum(net(x) * r)`` for ``net`` = linear, gelu, linear, ... (``weights[i]`` is
    ``(out, in)``, ``biases[i]`` or None); see the module docstring for each rule."""
    x = x.double().reshape(-1, x.shape[-1])
    M = x.shape[0]
    a, ea = x, torch.zeros_like(x)
    acts, pre = [], []
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        w = w.detach().double()
        bd = b.detach().double() if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
        h = a @ w.T + bd
        eh = ea @ w.abs().T + _gamma(w.shape[1] + world + 1) * ((a.abs() + ea) @ w.abs().T + bd.abs())
        acts.append((a, ea))
        pre.append((h, eh))
        if i < len(weights) - 1:
            a = torch.nn.functional.gelu(h)
            ea = GELU_D1 * eh + 8 * U * (a.abs() + h.abs() + eh)
    out = {"y": pre[-1][1]}
    g, eg = r.double().reshape(-1, r.shape[-1]), torch.zeros(M, r.shape[-1], dtype=torch.float64)
    for i in reversed(range(len(weights))):
        a, ea = acts[i]
        w = weights[i].detach().double()
        out[f"w{i}"] = (
            eg.T @ (a.abs() + ea) + g.abs().T @ ea + _gamma(M + 1) * (g.abs() + eg).T @ (a.abs() + ea)
        )
        out[f"b{i}"] = eg.sum(0) + _gamma(M) * (g.abs() + eg).sum(0)
        ga = g @ w
        ega = eg @ w.abs() + _gamma(w.shape[0] + world + 1) * (g.abs() + eg) @ w.abs()
        if i == 0:
            out["x"] = ega
            break
        h, eh = pre[i - 1]
        xh = h / 2**0.5
        d = 0.5 * (1 + torch.erf(xh)) + h * torch.exp(-0.5 * h * h) / (2 * torch.pi) ** 0.5
        gh = ga * d
        eg = GELU_D1 * ega + (ga.abs() + ega) * (GELU_D2 * eh + 16 * U) + U * gh.abs()
        g = gh
    return out


def _case(
    rank,
    world,
    kind,
    *,
    sp=False,
    bias=True,
    chunks=2,
    path="torch",
    gather_output=False,
    input_is_parallel=True,
    x_grad=True,
    seed=0,
):
    """One tensor-parallel problem: ``kind`` is 'column', 'row' or 'mlp' (column, gelu, row).
    Returns {tensor name: (within bound, max |diff| / bound, elements compared)}."""
    from torch import nn

    from cokit.overlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from cokit.triton_kernels.backend import kernel_path

    os.environ["TRITON_INTERPRET"] = "1" if path == "interpreter" else "0"
    assert kernel_path("cpu") == path
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty -> NaN: the poison
    W = world
    dims = {"column": [(IN, HID)], "row": [(HID, IN)], "mlp": [(IN, HID), (HID, IN)]}[kind]
    torch.manual_seed(seed)
    dense = [nn.Linear(i, o, bias=bias) for i, o in dims]
    lead = (3 * W, 5) if sp else (3, 5)  # rows odd: 15 (45 at world 3 with sp)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, dims[0][0], generator=gen)
    r = torch.randn(*lead, dims[-1][1], generator=gen)

    # the dense fp32 reference (what one process computes)
    xd = x.clone().requires_grad_(True)
    h = dense[0](xd)
    for layer in dense[1:]:
        h = layer(torch.nn.functional.gelu(h))
    (h * r).sum().backward()

    rows = slice(rank * lead[0] // W, (rank + 1) * lead[0] // W)

    def feats(n):
        return slice(rank * n // W, (rank + 1) * n // W)

    kw = {"sequence_parallel": sp, "chunks": chunks}
    if kind == "column":
        tp = [ColumnParallelLinear.from_linear(dense[0], gather_output=gather_output, **kw)]
        x_region = (rows,) if sp else (...,)
        y_region = (...,) if gather_output else (..., feats(HID))
    elif kind == "row":
        tp = [RowParallelLinear.from_linear(dense[0], input_is_parallel=input_is_parallel, **kw)]
        x_region = (..., feats(HID)) if input_is_parallel else (...,)
        y_region = (rows,) if sp else (...,)
    else:
        tp = [ColumnParallelLinear.from_linear(dense[0], **kw), RowParallelLinear.from_linear(dense[1], **kw)]
        x_region = (rows,) if sp else (...,)
        y_region = (rows,) if sp else (...,)
    xt = x[x_region].clone().requires_grad_(x_grad)
    yt = tp[0](xt)
    for layer in tp[1:]:
        yt = layer(torch.nn.functional.gelu(yt))
    (yt * r[y_region]).sum().backward()

    bounds = error_bounds(x, [d.weight.detach() for d in dense], [d.bias for d in dense], r, W)
    out = {}

    def check(name, got, want, bound):
        bound = 2 * bound  # two evaluations, each within bound of the exact value
        diff = (got.double() - want.double()).abs()
        ok = got.shape == want.shape and bool(torch.isfinite(got).all()) and bool((diff <= bound).all())
        out[name] = (ok, float((diff / bound).max()), got.numel())

    full = lambda t: t.reshape(*lead, t.shape[-1])  # noqa: E731 - rows back to the input's lead dims
    check("y", yt.detach(), h.detach()[y_region], full(bounds["y"])[y_region])
    if x_grad:
        check("grad_x", xt.grad, xd.grad[x_region], full(bounds["x"])[x_region])
    else:
        out["grad_x_none"] = (xt.grad is None, 0.0, 0)
    for i, (t, d) in enumerate(zip(tp, dense, strict=True)):
        wsl = (feats(d.out_features),) if t.partition_dim == 0 else (slice(None), feats(d.in_features))
        check(f"grad_w{i}", t.weight.grad, d.weight.grad[wsl], bounds[f"w{i}"][wsl])
        if bias:
            bsl = wsl[0] if t.partition_dim == 0 else slice(None)
            check(f"grad_b{i}", t.bias.grad, d.bias.grad[bsl], bounds[f"b{i}"][bsl])
        else:
            out[f"no_bias{i}"] = (t.bias is None, 0.0, 0)
        # sharding and gathering move data without arithmetic: exact
        out[f"dense_weight{i}"] = (torch.equal(t.dense_weight(), d.weight.detach()), 0.0, d.weight.numel())
    return out


def _init_and_copies(rank, world):
    """Seeded construction equals a seeded nn.Linear, sharded; to_linear/dense_bias gather it back."""
    from torch import nn

    from cokit.overlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = {}
    for cls, name in ((ColumnParallelLinear, "column"), (RowParallelLinear, "row")):
        torch.manual_seed(7)
        ref = nn.Linear(IN, HID)
        torch.manual_seed(7)
        tp = cls(IN, HID)
        dense = tp.to_linear()
        out[name] = (
            torch.equal(dense.weight, ref.weight)
            and torch.equal(dense.bias, ref.bias)
            and torch.equal(tp.dense_bias(), ref.bias.detach())
            and tuple(tp.weight.shape) == ((HID // world, IN) if name == "column" else (HID, IN // world))
        )
        out[name + "_repr"] = repr(tp)
    return out


def _errors(rank, world):
    """Bad construction and bad inputs: ValueError/TypeError with a clear message, raised
    before any collective (every rank raises the same, so nothing hangs)."""
    from torch import nn

    from cokit.overlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    os.environ["TRITON_INTERPRET"] = "0"
    W = world
    huge = 1 << 22  # 2^22 x (2^23 + 1) fp32 weights: ~140 TB, were anything allocated first
    col = ColumnParallelLinear(IN, HID)
    row = RowParallelLinear(HID, IN, sequence_parallel=True)
    row_full = RowParallelLinear(HID, IN)
    col_sp = ColumnParallelLinear(IN, HID, sequence_parallel=True)
    cases = {
        "col_world": lambda: ColumnParallelLinear(huge, huge * W + 1),
        "row_world": lambda: RowParallelLinear(huge * W + 1, huge),
        "from_linear_world": lambda: RowParallelLinear.from_linear(nn.Linear(6 * W + 1, 4)),
        "last_dim": lambda: col(torch.randn(4, IN - 1)),
        "row_last_dim": lambda: row_full(torch.randn(4, HID)),  # the full width, not this rank's
        "dtype": lambda: col(torch.randn(4, IN, dtype=torch.float16)),
        "device": lambda: col(torch.randn(4, IN, device="meta")),
        "sp_rows": lambda: row(torch.randn(2 * W + 1, 3, HID // W)),
        "sp_1d": lambda: col_sp(torch.randn(IN)),
        "empty": lambda: col(torch.randn(0, IN)),
        "layer_dtype": lambda: ColumnParallelLinear(IN, HID, dtype=torch.float64),
        "chunks": lambda: ColumnParallelLinear(IN, HID, chunks=0),
        "not_linear": lambda: ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1)),
        "from_linear_kw": lambda: ColumnParallelLinear.from_linear(nn.Linear(IN, HID), dtype=torch.float16),
        "not_tensor": lambda: col([1.0] * IN),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    return out


# the problems of every world (name -> kind and options); torch path unless said
CASES = {
    "column": ("column", {}),
    "column_nobias_gather_c3": ("column", {"bias": False, "gather_output": True, "chunks": 3}),
    "column_sp": ("column", {"sp": True}),
    "column_sp_nobias_c1": ("column", {"sp": True, "bias": False, "chunks": 1}),
    "row": ("row", {}),
    "row_nobias_full_input_c1": ("row", {"bias": False, "input_is_parallel": False, "chunks": 1}),
    "row_sp_c3": ("row", {"sp": True, "chunks": 3}),
    "row_sp_no_x_grad": ("row", {"sp": True, "x_grad": False}),
    "mlp": ("mlp", {}),
    "mlp_nobias_c3": ("mlp", {"bias": False, "chunks": 3}),
    "mlp_sp_c3": ("mlp", {"sp": True, "chunks": 3}),
    "mlp_sp_nobias": ("mlp", {"sp": True, "bias": False}),
    "mlp_sp_interpreter": ("mlp", {"sp": True, "path": "interpreter"}),
}


def _case_by_name(rank, world, name):
    kind, options = CASES[name]
    return _case(rank, world, kind, **options)


def _run(world):
    cases = [Case(name, _case_by_name, (name,)) for name in CASES]
    cases += [Case("init", _init_and_copies), Case("errors", _errors)]
    return run_cases(world, cases)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    return request.param, _run(request.param)


def test_outputs_and_gradients_match_dense_on_every_rank(world):
    W, res = world
    for name in CASES:
        assert len(res[name]) == W
        for rank, verdicts in enumerate(res[name]):
            bad = {k: v for k, v in verdicts.items() if not v[0]}
            assert not bad, f"world {W}, rank {rank}, case {name}: {bad}"
            kind = CASES[name][0]
            layers = 2 if kind == "mlp" else 1
            bias = CASES[name][1].get("bias", True)
            # y, grad_x, per layer: grad_w, grad_b (or no_bias), dense_weight
            assert len(verdicts) == 2 + 3 * layers, verdicts.keys()
            assert ("grad_b0" in verdicts) == bias


def test_init_equals_nn_linear_and_gathers_back(world):
    W, res = world
    for rank_res in res["init"]:
        assert rank_res["column"] and rank_res["row"]
        assert (
            f"world_size={W}" in rank_res["column_repr"]
            and f"shard=({HID // W}, {IN})" in rank_res["column_repr"]
        )


def test_bad_input_errors(world):
    W, res = world
    for err in res["errors"]:
        assert all(v is not None for v in err.values()), [k for k, v in err.items() if v is None]
        kind, msg = err["col_world"]
        assert kind == "ValueError" and f"out_features={(1 << 22) * W + 1}" in msg
        assert f"world size {W}" in msg and f"multiple of {W}" in msg
        assert "in_features" in err["row_world"][1] and f"world size {W}" in err["row_world"][1]
        assert f"in_features={6 * W + 1}" in err["from_linear_world"][1]
        assert f"in_features={IN}" in err["last_dim"][1]
        assert "in_features / world_size" in err["row_last_dim"][1]
        assert "dtype" in err["dtype"][1] and "float16" in err["dtype"][1]
        assert "meta" in err["device"][1]
        assert "multiple of" in err["sp_rows"][1] and f"{2 * W + 1} rows" in err["sp_rows"][1]
        assert "dim 0" in err["sp_1d"][1]
        assert "empty" in err["empty"][1]
        assert "not supported" in err["layer_dtype"][1]
        assert "chunks" in err["chunks"][1]
        assert err["not_linear"][0] == "TypeError" and "nn.Linear" in err["not_linear"][1]
        assert err["from_linear_kw"][0] == "TypeError" and "dtype" in err["from_linear_kw"][1]
        assert err["not_tensor"][0] == "TypeError"


def test_world_one_without_distributed():
    """No process group: world 1, the same GEMMs, no communication (main process, torch path)."""
    from torch import nn

    from cokit.overlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(3)
    d1, d2 = nn.Linear(IN, HID), nn.Linear(HID, IN)
    col, row = ColumnParallelLinear.from_linear(d1), RowParallelLinear.from_linear(d2, sequence_parallel=True)
    x = torch.randn(4, 3, IN)
    r = torch.randn(4, 3, IN)
    xd, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yd = d2(torch.nn.functional.gelu(d1(xd)))
    yt = row(torch.nn.functional.gelu(col(xt)))
    (yd * r).sum().backward()
    (yt * r).sum().backward()
    b = error_bounds(x, [d1.weight.detach(), d2.weight.detach()], [d1.bias, d2.bias], r, 1)
    for got, want, bound in (
        (yt, yd, b["y"].reshape(yd.shape)),
        (xt.grad, xd.grad, b["x"].reshape(x.shape)),
        (col.weight.grad, d1.weight.grad, b["w0"]),
        (row.weight.grad, d2.weight.grad, b["w1"]),
        (row.bias.grad, d2.bias.grad, b["b1"]),
    ):
        assert ((got.detach().double() - want.detach().double()).abs() <= 2 * bound).all()
    assert col.world_size == 1 and not col.comm.distributed
