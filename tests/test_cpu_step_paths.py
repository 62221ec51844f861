"""The CPU (torch) fast paths of the step are bit-identical to the computations they replace.

``ef_encode_fast`` / ``ef_decode_fast`` (reused scratch, the same BLAS calls as the
references' ``torch.matmul``), ``chunk_topk_fast`` (top-k over candidate groups) and
SparseLoCo's CPU inner AdamW (foreach) against the references, on fresh random inputs with odd
shapes, ties, zeros and non-finite values. Called directly: the suite runs the Triton
interpreter on CPU tensors (conftest), not the torch path.
"""

from __future__ import annotations

import pytest
import torch

from cokit.triton_kernels.error_feedback import (
    ef_decode_fast,
    ef_decode_reference,
    ef_encode_fast,
    ef_encode_reference,
)
from cokit.triton_kernels.topk import chunk_topk_fast, chunk_topk_reference

SHAPES = [(128, 192), (37, 53), (100,), (7,), (65, 129), (3, 5, 8), (1, 1), (4096,), (130, 64), (256, 256)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _data(seed: int, shapes=SHAPES, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, s in enumerate(shapes):
        x = torch.randn(s, generator=g)
        if n % 3 == 0:
            x = (x * 3).round() / 3  # many equal magnitudes
        if n % 4 == 1:
            x.view(-1)[: x.numel() // 2] = 0.0
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("chunk", "k", "alpha", "value_dtype"),
    [(64, 32, 1.0, torch.bfloat16), (32, 7, 0.3, torch.float32), (16, 300, 0.5, torch.float16)],
)
def test_ef_encode_fast_is_bit_identical(seed, chunk, k, alpha, value_dtype):
    grads = _data(seed)
    grads[2] = grads[2].to(torch.bfloat16)  # a low-precision gradient
    deltas = _data(seed + 100)
    d_ref = [d.clone() for d in deltas]
    d_new = [d.clone() for d in deltas]
    for step in range(3):  # the buffers carry over, as in training
        ref = ef_encode_reference(d_ref, grads, 0.9, 0.01, chunk, k, alpha=alpha, value_dtype=value_dtype)
        new = ef_encode_fast(d_new, grads, 0.9, 0.01, chunk, k, alpha=alpha, value_dtype=value_dtype)
        assert _same(ref[0], new[0]) and _same(ref[1], new[1]), step
        assert all(_same(a, b) for a, b in zip(d_ref, d_new, strict=True)), step


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("use_sign", [True, False])
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_ef_decode_fast_is_bit_identical(seed, use_sign, ranks, param_dtype):
    chunk, k = 32, 9
    shapes = SHAPES
    payloads = []
    for r in range(ranks):
        deltas = _data(seed * 10 + r, shapes)
        payloads.append(ef_encode_reference(deltas, _data(seed * 10 + r + 50, shapes), 0.9, 1.0, chunk, k))
    indices = torch.stack([p[0] for p in payloads])
    values = torch.stack([p[1] for p in payloads]).to(torch.bfloat16)
    params = [p.to(param_dtype) for p in _data(seed + 7, shapes)]
    p_ref = [p.clone() for p in params]
    p_new = [p.clone() for p in params]
    ef_decode_reference(p_ref, indices, values, chunk, k, 0.01, weight_decay=0.1, use_sign=use_sign)
    ef_decode_fast(p_new, indices, values, chunk, k, 0.01, weight_decay=0.1, use_sign=use_sign)
    assert all(_same(a, b) for a, b in zip(p_ref, p_new, strict=True))


def test_ef_decode_fast_unsorted_or_repeated_positions_take_the_mean():
    """One rank's positions that are not strictly increasing take the reference's mean."""
    chunk, k = 8, 4
    params = [torch.randn(16, 16), torch.randn(24)]
    deltas = [torch.randn(16, 16), torch.randn(24)]
    idx, vals = ef_encode_reference(deltas, [torch.zeros(16, 16), torch.zeros(24)], 1.0, 0.0, chunk, k)
    idx = idx.clone()
    idx[1] = idx[0]  # a repeated position in the first tile
    idx[5], idx[6] = idx[6].clone(), idx[5].clone()  # an unsorted tile
    p_ref = [p.clone() for p in params]
    p_new = [p.clone() for p in params]
    ef_decode_reference(p_ref, idx[None], vals[None], chunk, k, 0.1, use_sign=False)
    ef_decode_fast(p_new, idx[None], vals[None], chunk, k, 0.1, use_sign=False)
    assert all(_same(a, b) for a, b in zip(p_ref, p_new, strict=True))


@pytest.mark.parametrize("seed", range(8))
def test_chunk_topk_fast_is_bit_identical(seed):
    g = torch.Generator().manual_seed(seed)
    n, k = [(4096, 32), (4096, 64), (2048, 5), (1024, 1), (3200, 63), (4096, 127), (48, 2), (4000, 8)][seed]
    x = torch.randn(40, n, generator=g)
    if seed % 2 == 0:
        x = (x * 4).round()  # ties across the cut
    x[3, n // 3] = float("nan")
    x[4, : min(n, 2 * k + 5)] = float("nan")
    x[5] = 0.0
    x[6, ::2] = -0.0
    x[7, 10] = float("inf")
    x[8, 11] = float("-inf")
    x[9] = 1.0  # every magnitude equal
    ref, new = chunk_topk_reference(x, k), chunk_topk_fast(x, k)
    assert _same(ref[0], new[0]) and _same(ref[1], new[1])


def test_sparseloco_cpu_inner_adamw_is_bit_identical_to_the_single_tensor_one():
    """SparseLoCo's default inner AdamW runs foreach on CPU: the same results as torch's CPU
    default (the single-tensor loop)."""
    from cokit.compress import SparseLoCo

    def run(swap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in [(64, 48), (48,), (7, 3), (5,)]]
        opt = SparseLoCo(ps, sync_every=4)
        assert opt.inner.defaults["foreach"] is True
        if swap:
            for group in opt.inner.param_groups:
                group["foreach"] = False
        g = torch.Generator().manual_seed(1)
        for _ in range(9):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach().clone() for p in ps]

    assert all(_same(a, b) for a, b in zip(run(False), run(True), strict=True))
