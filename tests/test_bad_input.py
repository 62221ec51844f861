"""Every bad input gets a clear error naming the argument."""

import pytest
import torch

from cokit.triton_kernels.dct import dct_decode, dct_encode, dct_encode_multi
from cokit.triton_kernels.error_feedback import ef_decode, ef_encode
from cokit.triton_kernels.topk import chunk_topk


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.arange(6), "dtype float32, float16 or bfloat16"),
        (torch.randn(4, dtype=torch.complex64), "dtype float32"),
        (torch.randn(4, dtype=torch.float64), "dtype float32"),
        (torch.randn(4, 4).to_sparse(), "dense"),
        (torch.randn(0, 3), "empty"),
        ([1.0, 2.0], "torch.Tensor"),
    ],
)
def test_encode_rejects_bad_tensors(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        dct_encode(bad)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_bad_chunk(chunk):
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        dct_encode(torch.randn(8), chunk)


@pytest.mark.parametrize("k", [0, -1, 1.5])
def test_bad_k(k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        chunk_topk(torch.randn(2, 8), k)


def test_topk_needs_2d():
    with pytest.raises(ValueError, match=r"coeffs must be 2-D"):
        chunk_topk(torch.randn(8), 2)


def test_decode_shape_mismatch():
    with pytest.raises(ValueError, match=r"coeffs\[0\] has shape \(1, 4096\).*expected \(4, 3072\)"):
        dct_decode(torch.randn(1, 4096), (96, 128))


def test_multi_needs_list_and_one_device():
    with pytest.raises(TypeError, match="non-empty list"):
        dct_encode_multi(torch.randn(4))
    with pytest.raises(TypeError, match="non-empty list"):
        dct_encode_multi([])
    meta = torch.randn(4, device="meta")
    with pytest.raises(ValueError, match="one device"):
        dct_encode_multi([torch.randn(4), meta])


def test_unsupported_device():
    with pytest.raises(ValueError, match=r"cuda .* or cpu"):
        dct_encode(torch.randn(4, device="meta"))


def test_encode_argument_checks():
    d, g = [torch.zeros(8, 8)], [torch.randn(8, 8)]
    with pytest.raises(ValueError, match=r"beta must be a finite number in \[0.0, 1.0\]"):
        ef_encode(d, g, beta=1.5, lr=0.1)
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0\.0, got nan"):
        ef_encode(d, g, beta=0.9, lr=float("nan"))
    with pytest.raises(TypeError, match=r"deltas\[0\] must have dtype float32"):
        ef_encode([torch.zeros(8, 8).half()], g, beta=0.9, lr=0.1)
    with pytest.raises(ValueError, match=r"deltas\[0\] has shape \(8, 4\) but grads\[0\] has \(8, 8\)"):
        ef_encode([torch.zeros(8, 4)], g, beta=0.9, lr=0.1)
    with pytest.raises(ValueError, match=r"got 1 deltas but 2 grads"):
        ef_encode(d, g * 2, beta=0.9, lr=0.1)
    with pytest.raises(TypeError, match="value_dtype"):
        ef_encode(d, g, beta=0.9, lr=0.1, value_dtype=torch.int8)


def _payload(device):
    params = [torch.randn(8, 8, device=device)]
    idx, vals = ef_encode(
        [torch.zeros(8, 8, device=device)], [torch.randn(8, 8, device=device)], beta=0.0, lr=1.0, k=4
    )
    return params, idx[None].clone(), vals[None].clone()


def test_decode_payload_checks(device):
    params, idx, vals = _payload(device)
    with pytest.raises(ValueError, match=r"payload has 3 slots per rank.*need 4"):
        ef_decode(params, idx[:, :3], vals[:, :3], lr=0.1, k=4)
    with pytest.raises(ValueError, match="indices and values must both be"):
        ef_decode(params, idx, vals[:, :3], lr=0.1, k=4)
    bad = idx.clone()
    bad[0, 2] = 64
    with pytest.raises(ValueError, match=r"payload index 64 of rank 0 \(slot 2\) is out of range \[0, 64\)"):
        ef_decode(params, bad, vals, lr=0.1, k=4)
    bad[0, 2] = -1
    with pytest.raises(ValueError, match="out of range"):
        ef_decode(params, bad, vals, lr=0.1, k=4)
    dup = idx.clone()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(ValueError, match="repeats a position"):
        ef_decode(params, dup, vals, lr=0.1, k=4)
    with pytest.raises(TypeError, match="indices must be int16, int32 or int64"):
        ef_decode(params, idx.float(), vals, lr=0.1, k=4)
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0\.0"):
        ef_decode(params, idx, vals, lr=0.1, k=4, weight_decay=-1.0)
    before = params[0].clone()
    with pytest.raises(ValueError):
        ef_decode(params, bad, vals, lr=0.1, k=4)
    assert torch.equal(params[0], before)  # nothing written on a rejected payload
