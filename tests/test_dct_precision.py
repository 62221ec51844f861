"""Accuracy of the DCT's fp32-class tensor-core dots, measured against float64.

On NVIDIA the DCT and error-feedback kernels run every ``tl.dot`` at
``input_precision="tf32x3"`` (compress_configs_nvidia). The interpreter computes any
precision as an fp32 matmul, so these tests emulate what the tensor cores compute: each fp32
operand is split into a TF32 "big" part (10 explicit mantissa bits, rounded to nearest, ties
away from zero, like ``cvt.rna.tf32.f32``) and a TF32 "small" part of the remainder; TF32
products are exact in fp32, and the three products small*big + big*small + big*big are
accumulated in fp32. sm_80 runs ``"bf16x6"`` (three bf16 terms per operand, six products).
The bound is the fp32 accuracy class, ``FP32_CLASS`` in tests/tolerances.py: relative error
<= 1e-5 on encodes and round trips; plain TF32 misses it, which is why it is not shipped.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import FP32_CLASS

from cokit.triton_kernels.tiling import basis_matrix


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to TF32 (10 explicit mantissa bits), to nearest with ties away from zero."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16_parts(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``x`` as ``n`` bf16 terms (rounded to nearest even), each of what the others leave."""
    parts, rest = [], x.float()
    for _ in range(n):
        parts.append(rest.to(torch.bfloat16).float())
        rest = rest - parts[-1]
    return parts


def dot(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """fp32 ``a @ b`` as a tensor core computes it at ``precision`` ('tf32', 'tf32x3',
    'bf16x6', 'ieee'). bf16x6 (the sm_80 choice): three bf16 terms per operand, the six
    products whose orders add up to at most 2 (i + j <= 2 for terms 0..2), in the kernel's
    order (``dct.dot_fp32``: lo*hi, mid*mid, mid*hi, hi*lo, hi*mid, hi*hi)."""
    if precision == "ieee":
        return a @ b
    if precision == "bf16x6":
        pa, pb = bf16_parts(a, 3), bf16_parts(b, 3)
        pairs = [(2, 0), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]
        out = pa[pairs[0][0]] @ pb[pairs[0][1]]
        for i, j in pairs[1:]:
            out = out + pa[i] @ pb[j]
        return out
    a_big, b_big = to_tf32(a), to_tf32(b)
    if precision == "tf32":
        return a_big @ b_big
    a_small, b_small = to_tf32(a - a_big), to_tf32(b - b_big)
    return a_small @ b_big + a_big @ b_small + a_big @ b_big


def encode(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``B_h x B_w^T`` in the kernel's order: the right-hand dot first."""
    h, w = x.shape[-2:]
    bh, bw = basis_matrix(h, torch.float32, x.device), basis_matrix(w, torch.float32, x.device)
    return dot(bh, dot(x, bw.T.contiguous(), precision), precision)


def decode(y: torch.Tensor, precision: str) -> torch.Tensor:
    h, w = y.shape[-2:]
    bh, bw = basis_matrix(h, torch.float32, y.device), basis_matrix(w, torch.float32, y.device)
    return dot(bh.T.contiguous(), dot(y, bw, precision), precision)


def rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    return (err.double().norm() / ref.double().norm()).item()


def test_tf32_rounding_matches_the_hardware_rule():
    x = torch.tensor([1.0 + 2.0**-11, 1.0 + 2.0**-11 + 2.0**-12, -(1.0 + 3 * 2.0**-11), 1.0 + 2.0**-10])
    # 1 + 2^-11 is half-way: away from zero -> 1 + 2^-10; -(1 + 3*2^-11) -> -(1 + 2^-9)
    assert to_tf32(x).tolist() == [1.0 + 2.0**-10, 1.0 + 2.0**-10, -(1.0 + 2.0**-9), 1.0 + 2.0**-10]


@pytest.mark.parametrize("shape", [(64, 64), (37, 50), (16, 64), (64, 17)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
def test_tf32x3_dct_is_fp32_class(shape, scale):
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    x = torch.randn(8, *shape, generator=gen) * scale
    bh = basis_matrix(shape[0], torch.float64, x.device)
    bw = basis_matrix(shape[1], torch.float64, x.device)
    y64 = bh @ x.double() @ bw.T
    y = encode(x, "tf32x3")
    assert rel(y - y64, y64) <= FP32_CLASS
    back = decode(y, "tf32x3")
    assert rel(back - x, x) <= FP32_CLASS
    y6 = encode(x, "bf16x6")
    assert rel(y6 - y64, y64) <= FP32_CLASS and rel(decode(y6, "bf16x6") - x, x) <= FP32_CLASS
    # plain TF32 is three orders of magnitude worse: not fp32 class
    assert rel(encode(x, "tf32") - y64, y64) > 10 * FP32_CLASS


def test_tf32x3_error_is_near_fp32_not_tf32():
    """The measured numbers quoted in docs/kernels.md (Conventions, Precision: 64x64 tiles, 64 of them)."""
    x = torch.randn(64, 64, 64, generator=torch.Generator().manual_seed(0))
    bh = basis_matrix(64, torch.float64, x.device)
    y64 = bh @ x.double() @ bh.T
    kinds = ("ieee", "tf32x3", "bf16x6", "tf32")
    errs = {p: rel(encode(x, p) - y64, y64) for p in kinds}
    trips = {p: rel(decode(encode(x, p), p) - x, x) for p in kinds}
    for p in ("tf32x3", "bf16x6"):
        assert errs[p] < 4 * errs["ieee"] and trips[p] < 4 * trips["ieee"], (errs, trips)
    assert errs["tf32"] > 100 * errs["tf32x3"], errs
