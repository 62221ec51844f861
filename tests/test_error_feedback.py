"""Fused error-feedback encode/decode vs float64 references, on the ``device`` fixture's
device (the Triton interpreter on CPU, compiled kernels on a GPU)."""

import pytest
import torch
from helpers import DTYPES, SHAPES, LaunchSpy, misaligned, poison, rel_err  # noqa: F401
from tolerances import (
    FP32_EF,
    FP32_EF_ATOL,
    FP32_EF_EVERYTHING_SENT_ATOL,
    SIGN_FLIP_ATOL,
    SIGN_FLIP_SHARE,
    SIXTEEN_BIT_PARAMS,
    SIXTEEN_BIT_VALUES,
)

from cokit.triton_kernels import error_feedback as ef_module
from cokit.triton_kernels.error_feedback import (
    ef_decode,
    ef_decode_reference,
    ef_encode,
    ef_encode_reference,
    payload_layout,
)


@pytest.mark.parametrize("k", [1, 3, 32, 4096])
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.usefixtures("poison")
def test_encode_vs_float64(k, grad_dtype, device):
    grads = [torch.randn(s).to(grad_dtype).to(device) for s in SHAPES]
    deltas = [torch.randn(s, device=device) for s in SHAPES]
    ref_deltas = [d.double() for d in deltas]
    before = [0.9 * d.double() + 0.05 * g.double() for d, g in zip(deltas, grads, strict=True)]
    idx, vals = ef_encode(deltas, grads, beta=0.9, lr=0.05, chunk=64, k=k, alpha=0.8)
    ref_idx, ref_vals = ef_encode_reference(
        ref_deltas,
        [g.double() for g in grads],
        0.9,
        0.05,
        64,
        k,
        alpha=0.8,
        value_dtype=torch.float64,
        dtype=torch.float64,
    )
    layout = payload_layout(SHAPES, 64, k)
    assert idx.shape == (layout.payload_numel,) and idx.dtype == torch.int16
    assert torch.equal(idx.long(), ref_idx.long())
    assert rel_err(vals, ref_vals) < FP32_EF
    for d, r, b in zip(deltas, ref_deltas, before, strict=True):
        assert d.dtype == torch.float32 and torch.isfinite(d).all()
        # relative to the buffer before the update (after it, k = tile size leaves ~0)
        assert (d.double() - r).norm() < FP32_EF * b.norm()


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.usefixtures("poison")
def test_encode_compact_values(value_dtype, device):
    grads, deltas = [torch.randn(96, 128, device=device)], [torch.zeros(96, 128, device=device)]
    ref = [d.clone() for d in deltas]
    _, vals = ef_encode(deltas, grads, beta=0.999, lr=1.0, k=8, value_dtype=value_dtype)
    _, ref_vals = ef_encode_reference(ref, grads, 0.999, 1.0, 64, 8)
    assert vals.dtype == value_dtype
    assert rel_err(vals, ref_vals) < SIXTEEN_BIT_VALUES[value_dtype]
    # the buffer subtracts the unquantized selection
    assert rel_err(deltas[0], ref[0]) < FP32_EF


@pytest.mark.usefixtures("poison")
def test_error_feedback_keeps_what_was_not_sent(device):
    g = torch.randn(64, 64, device=device)
    delta = [torch.zeros(64, 64, device=device)]
    ef_encode(delta, [g], beta=0.0, lr=1.0, k=4096)  # send everything
    assert delta[0].abs().max() < FP32_EF_EVERYTHING_SENT_ATOL
    delta = [torch.zeros(64, 64, device=device)]
    ef_encode(delta, [g], beta=0.0, lr=1.0, k=32)
    # what is left is g minus its 32 largest DCT components: smaller, but not zero
    assert 0 < delta[0].norm() < g.norm()


def gathered_payloads(shapes, k, ranks, device, value_dtype=torch.float32):
    """Payloads of `ranks` ranks; the last rank repeats rank 0's positions (overlap)."""
    idx, vals = [], []
    for r in range(ranks):
        deltas = [torch.randn(s, device=device) for s in shapes]
        grads = [torch.randn(s, device=device) for s in shapes]
        i, v = ef_encode(deltas, grads, beta=0.5, lr=1.0, k=k, value_dtype=value_dtype)
        idx.append(idx[0] if r == ranks - 1 and r > 0 else i)
        vals.append(v)
    return torch.stack(idx), torch.stack(vals)


@pytest.mark.parametrize("use_sign", [True, False])
@pytest.mark.parametrize("k", [1, 3, 32])
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.usefixtures("poison")
def test_decode_vs_float64(ranks, k, use_sign, device):
    idx, vals = gathered_payloads(SHAPES, k, ranks, device)
    params = [torch.randn(s, device=device) for s in SHAPES]
    ref = [p.double() for p in params]
    ef_decode(params, idx, vals, lr=0.01, k=k, weight_decay=0.1, use_sign=use_sign)
    ef_decode_reference(
        ref, idx, vals.double(), 64, k, 0.01, weight_decay=0.1, use_sign=use_sign, dtype=torch.float64
    )
    for p, r in zip(params, ref, strict=True):
        if use_sign:  # a sign may flip where the decoded value is ~0: count mismatches
            assert ((p.double() - r).abs() > SIGN_FLIP_ATOL).float().mean() < SIGN_FLIP_SHARE
        else:
            assert rel_err(p, r) < FP32_EF


@pytest.mark.parametrize("case", ["aligned", "misaligned", "narrow"])
@pytest.mark.usefixtures("poison")
def test_alignment_hints_only_where_they_hold(case, device, monkeypatch):
    """Encode and decode pass ALIGNED exactly when every buffer, gradient and parameter of
    the class is 16-byte aligned with tile widths that are multiples of 16; both builds give
    the float64 result."""
    encode_spy, decode_spy = LaunchSpy(ef_module._ef_encode_kernel), LaunchSpy(ef_module._ef_decode_kernel)
    monkeypatch.setattr(ef_module, "_ef_encode_kernel", encode_spy)
    monkeypatch.setattr(ef_module, "_ef_decode_kernel", decode_spy)
    shape = (48, 40) if case == "narrow" else (64, 128)
    place = misaligned if case == "misaligned" else (lambda t: t)
    delta, grad = place(torch.randn(shape, device=device)), place(torch.randn(shape, device=device))
    ref_delta = [delta.double()]
    idx, vals = ef_encode([delta], [grad], beta=0.9, lr=0.1, k=8)
    ref_idx, ref_vals = ef_encode_reference(
        ref_delta, [grad.double()], 0.9, 0.1, 64, 8, value_dtype=torch.float64, dtype=torch.float64
    )
    assert torch.equal(idx.long(), ref_idx.long()) and rel_err(vals, ref_vals) < FP32_EF
    assert rel_err(delta, ref_delta[0]) < FP32_EF
    param = place(torch.randn(shape, device=device))
    ref_param = [param.double()]
    ef_decode([param], idx[None], vals[None], lr=0.01, k=8, use_sign=False)
    ef_decode_reference(
        ref_param, idx[None], vals[None].double(), 64, 8, 0.01, use_sign=False, dtype=torch.float64
    )
    assert rel_err(param, ref_param[0]) < FP32_EF
    launches = encode_spy.launches + decode_spy.launches
    assert [launch["ALIGNED"] for launch in launches] == [case == "aligned"] * 2


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.usefixtures("poison")
def test_decode_16_bit_values_vs_float64(value_dtype, device):
    """16-bit payload values (what the codecs send) are exact in the one-hot scatter."""
    shapes = [(96, 130), (7,), (40, 33)]
    idx, vals = gathered_payloads(shapes, 5, 3, device, value_dtype)
    params = [torch.randn(s, device=device) for s in shapes]
    ref = [p.double() for p in params]
    ef_decode(params, idx, vals, lr=0.01, k=5, use_sign=False)
    ef_decode_reference(ref, idx, vals.double(), 64, 5, 0.01, use_sign=False, dtype=torch.float64)
    for p, r in zip(params, ref, strict=True):
        assert rel_err(p, r) < FP32_EF


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.usefixtures("poison")
def test_decode_low_precision_params(dtype, device):
    idx, vals = gathered_payloads([(96, 128), (7,)], 8, 2, device, torch.float16)
    params = [torch.randn(96, 128, device=device).to(dtype), torch.randn(7, device=device).to(dtype)]
    ref = [p.double() for p in params]
    ef_decode(params, idx, vals, lr=0.01, k=8, use_sign=False)
    ef_decode_reference(ref, idx, vals.double(), 64, 8, 0.01, use_sign=False, dtype=torch.float64)
    for p, r in zip(params, ref, strict=True):
        assert p.dtype == dtype
        assert rel_err(p, r) < SIXTEEN_BIT_PARAMS  # one rounding to the parameter dtype


@pytest.mark.usefixtures("poison")
def test_decode_is_deterministic(device):
    idx, vals = gathered_payloads([(130, 70), (64,)], 16, 3, device)
    start = [torch.randn(130, 70, device=device), torch.randn(64, device=device)]
    a = [p.clone() for p in start]
    b = [p.clone() for p in start]
    ef_decode(a, idx, vals, lr=0.1, k=16, use_sign=False)
    ef_decode(b, idx, vals, lr=0.1, k=16, use_sign=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.usefixtures("poison")
def test_mean_over_ranks_that_chose_a_position(device):
    # one 1x8 tile; rank 0 picks positions {0, 1}, rank 1 picks {1, 2}
    idx = torch.tensor([[0, 1], [1, 2]], dtype=torch.int16, device=device)
    vals = torch.tensor([[4.0, 2.0], [6.0, 8.0]], device=device)
    p = [torch.zeros(8, device=device)]
    ef_decode(p, idx, vals, lr=1.0, k=2, chunk=8, use_sign=False)
    dense = torch.tensor([[4.0, 4.0, 8.0, 0, 0, 0, 0, 0]], device=device)  # position 1: mean(2, 6)
    from cokit.triton_kernels.dct import dct_decode_reference

    assert torch.allclose(p[0], -dct_decode_reference(dense, (8,), 8), atol=FP32_EF_ATOL)


@pytest.mark.usefixtures("poison")
def test_non_contiguous_buffers_are_updated_in_place(device):
    base = torch.randn(64, 96, device=device)
    delta = torch.zeros(96, 64, device=device).t()  # non-contiguous (64, 96)
    ef_encode([delta], [base], beta=0.0, lr=1.0, k=4)
    ref = [torch.zeros(64, 96, device=device)]
    ef_encode_reference(ref, [base], 0.0, 1.0, 64, 4)
    assert rel_err(delta, ref[0]) < FP32_EF
