"""Tiled DCT kernels vs a float64 reference, on the ``device`` fixture's device (the Triton
interpreter on CPU, compiled kernels on a GPU)."""

import pytest
import torch
from helpers import DTYPES, SHAPES, LaunchSpy, misaligned, poison, rel_err  # noqa: F401
from tolerances import (
    BASIS_ORTHONORMAL_ATOL,
    FP16_DECODE,
    FP32_BUCKET_VS_SINGLE_ATOL,
    FP32_DCT,
    FP32_PARSEVAL,
)

from cokit.triton_kernels import dct as dct_module
from cokit.triton_kernels import tiling
from cokit.triton_kernels.dct import (
    dct_decode,
    dct_decode_multi,
    dct_decode_reference,
    dct_encode,
    dct_encode_multi,
    dct_encode_reference,
)


def test_chunk_side_is_largest_divisor_at_most_target():
    assert tiling.chunk_side(130, 64) == 26
    assert tiling.chunk_side(128, 64) == 64
    assert tiling.chunk_side(67, 64) == 1  # a prime: tile side 1
    assert tiling.chunk_side(7, 64) == 7
    t = tiling.TensorTiling.of((16, 3, 3, 3), 64)
    assert (t.rows, t.cols, t.h, t.w, t.n_tiles) == (16, 27, 16, 27, 1)


def test_basis_is_orthonormal():
    for n in (1, 5, 64):
        b = tiling.basis_matrix(n, torch.float64)
        assert torch.allclose(b @ b.T, torch.eye(n, dtype=torch.float64), atol=BASIS_ORTHONORMAL_ATOL)


def test_reference_matches_direct_dct_formula():
    x = torch.randn(6, 10, dtype=torch.float64)
    y = dct_encode_reference(x, chunk=64, dtype=torch.float64).reshape(6, 10)
    n0, n1 = torch.arange(6.0, dtype=torch.float64), torch.arange(10.0, dtype=torch.float64)
    k0, k1 = 2, 3
    direct = (
        (
            x
            * torch.cos(torch.pi * (2 * n0[:, None] + 1) * k0 / 12)
            * torch.cos(torch.pi * (2 * n1[None, :] + 1) * k1 / 20)
        ).sum()
        * (2 / 6) ** 0.5
        * (2 / 10) ** 0.5
    )
    assert torch.allclose(y[k0, k1], direct)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.usefixtures("poison")
def test_encode_decode_vs_float64(shape, dtype, device):
    x = torch.randn(shape).to(dtype).to(device)
    coeffs = dct_encode(x, chunk=64)
    ref = dct_encode_reference(x.double(), 64, torch.float64)
    assert coeffs.dtype == torch.float32 and coeffs.shape == ref.shape
    assert rel_err(coeffs, ref) < FP32_DCT
    # Parseval: an orthonormal transform keeps the sum of squares
    assert abs(coeffs.double().square().sum() / x.double().square().sum() - 1) < FP32_PARSEVAL
    back = dct_decode(coeffs, shape, chunk=64)
    assert back.shape == x.shape
    assert rel_err(back, x.double()) < FP32_DCT
    assert rel_err(back, dct_decode_reference(coeffs.double(), shape, 64, torch.float64)) < FP32_DCT


@pytest.mark.parametrize("chunk", [1, 5, 16, 32])
@pytest.mark.usefixtures("poison")
def test_other_chunk_targets(chunk, device):
    x = torch.randn(40, 24, device=device)
    coeffs = dct_encode(x, chunk)
    assert rel_err(coeffs, dct_encode_reference(x.double(), chunk, torch.float64)) < FP32_DCT
    assert rel_err(dct_decode(coeffs, x.shape, chunk), x) < FP32_DCT


@pytest.mark.usefixtures("poison")
def test_prime_rows_make_one_d_tiles(device):
    x = torch.randn(67, 48, device=device)  # 67 is prime: tiles are 1 x 48 rows
    coeffs = dct_encode(x, 64)
    assert coeffs.shape == (67, 48)
    assert rel_err(coeffs, dct_encode_reference(x.double(), 64, torch.float64)) < FP32_DCT


@pytest.mark.usefixtures("poison")
def test_decode_to_low_precision(device):
    x = torch.randn(32, 48, device=device)
    back = dct_decode(dct_encode(x), x.shape, dtype=torch.float16)
    assert back.dtype == torch.float16
    assert rel_err(back, x) < FP16_DECODE


@pytest.mark.usefixtures("poison")
def test_multi_tensor_bucket_equals_single(device):
    xs = [torch.randn(s, device=device) for s in SHAPES] + [torch.randn(33, device=device).half()]
    multi = dct_encode_multi(xs, 64)
    for x, c in zip(xs, multi, strict=True):
        assert torch.allclose(c, dct_encode(x, 64), rtol=0, atol=FP32_BUCKET_VS_SINGLE_ATOL)
    backs = dct_decode_multi(multi, [x.shape for x in xs], 64)
    for x, b in zip(xs, backs, strict=True):
        assert rel_err(b, x.float()) < FP32_DCT


def test_bucket_uses_one_launch_per_tile_class():
    plan = tiling.tile_plan([(64, 64), (128, 64), (64, 128), (64,), (128,)], 64)
    # three 64x64 tensors share one 2-D class; the two 1-D tensors share one 1-D class
    assert len(plan.classes) == 2
    assert sorted(len(c.tensors) for c in plan.classes) == [2, 3]


@pytest.mark.usefixtures("poison")
def test_non_contiguous_input(device):
    x = torch.randn(96, 64, device=device).t()  # (64, 96), transposed view
    assert not x.is_contiguous()
    assert rel_err(dct_encode(x), dct_encode_reference(x.double(), 64, torch.float64)) < FP32_DCT


def test_alignment_rule():
    """A launch class may promise ALIGN-aligned addresses only when every tensor's data is
    16-byte aligned and every tile width (so every row stride) is a multiple of 16."""
    square, narrow, one_d = (tiling.TensorTiling.of(s, 64) for s in ((64, 128), (48, 40), (128,)))
    assert (narrow.w, one_d.one_d, one_d.w) == (40, True, 64)
    x = torch.zeros(64 * 128)
    assert tiling.aligned([square, one_d], [x, x[:128]])
    assert not tiling.aligned([square], [misaligned(x)])
    assert not tiling.aligned([square, narrow], [x, x])


@pytest.mark.parametrize("case", ["aligned", "misaligned", "narrow"])
@pytest.mark.usefixtures("poison")
def test_alignment_hints_only_where_they_hold(case, device, monkeypatch):
    """The launcher passes ALIGNED exactly when :func:`tiling.aligned` holds for the class,
    and both builds give the float64 result."""
    spy = LaunchSpy(dct_module._dct_kernel)
    monkeypatch.setattr(dct_module, "_dct_kernel", spy)
    x = torch.randn((48, 40) if case == "narrow" else (64, 128), device=device)
    if case == "misaligned":
        x = misaligned(x)
    coeffs = dct_encode(x)
    back = dct_decode(misaligned(coeffs) if case == "misaligned" else coeffs, x.shape)
    assert [launch["ALIGNED"] for launch in spy.launches] == [case == "aligned"] * 2
    assert rel_err(coeffs, dct_encode_reference(x.double(), 64, torch.float64)) < FP32_DCT
    assert rel_err(back, x) < FP32_DCT


def test_pointer_tables_are_cached_by_pointer_values():
    from cokit.triton_kernels import tiling

    a, b, c = torch.zeros(3), torch.zeros(5), torch.zeros(7)
    first = tiling.pointer_table([[a, b], [b, c]], torch.device("cpu"))
    assert first.tolist() == [[a.data_ptr(), b.data_ptr()], [b.data_ptr(), c.data_ptr()]]
    assert tiling.pointer_table([[a, b], [b, c]], torch.device("cpu")) is first  # no rebuild, no copy
    other = tiling.pointer_table([[a, c], [b, c]], torch.device("cpu"))
    assert other is not first and other.tolist() == [
        [a.data_ptr(), b.data_ptr()],
        [c.data_ptr(), c.data_ptr()],
    ]
