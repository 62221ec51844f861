"""The hand-split ``"bf16x6"`` dots (``dct.dot_fp32``, the sm_80 configs) run for real.

On CPU the compression kernels normally use the interpreter's one fixed config (``"ieee"``
dots), so the bf16x6 path, the one sm_80 GPUs take, would only ever be compiled, never run.
Here the interpreter runs the real DCT and error-feedback kernels with the sm_80 config: the
fp32 operands split into bf16 terms in the kernel, six bf16 dots in their own regions,
fp32 accumulation. The interpreter stores bf16 as its raw 16 bits and multiplies those in
``tl.dot``; the ``bf16x6`` fixture decodes the bits to the bf16 values first, which is what
the tensor cores multiply (bf16 products are exact in fp32). The interpreter rounds fp32 to
bf16 by truncation where the GPU rounds to nearest even; either way the three terms leave
less than 2^-24 of each operand out. Results are checked against
float64 at the fp32 accuracy class, ``FP32_CLASS`` in tests/tolerances.py (relative error
<= 1e-5).
"""

import numpy as np
import pytest
import torch
import triton.language as tl
from helpers import SHAPES, poison, rel_err  # noqa: F401
from tolerances import FP32_CLASS

from cokit.triton_kernels import compress_config, dct
from cokit.triton_kernels.error_feedback import (
    ef_decode,
    ef_decode_reference,
    ef_encode,
    ef_encode_reference,
)


@pytest.fixture
def bf16x6(monkeypatch, device):
    """Kernels launched in this test take the sm_80 config (8 warps, ``"bf16x6"``)."""
    if device.type != "cpu":
        pytest.skip("a GPU runs its own configs; this checks the bf16x6 path in the interpreter")
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def as_fp32(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        bits = t.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def bf16_aware_dot(self, a, b, d, *args):
        return create_dot(self, as_fp32(a), as_fp32(b), d, *args)

    monkeypatch.setattr(builder, "create_dot", bf16_aware_dot)
    sm80 = compress_config.KernelConfig(num_warps=8, num_stages=1, dot_precision="bf16x6")
    monkeypatch.setattr(compress_config, "interpreter_config", lambda kernel: sm80)


@pytest.mark.parametrize("shape", [(64, 64), (37, 50), (130, 70), (5000,), (16, 3, 3, 3)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
@pytest.mark.usefixtures("poison", "bf16x6")
def test_bf16x6_dct_round_trip_is_fp32_class(shape, scale, device):
    x = torch.randn(shape, device=device) * scale
    y = dct.dct_encode(x, 64)
    y64 = dct.dct_encode_reference(x.double(), 64)
    assert rel_err(y, y64) <= FP32_CLASS
    assert rel_err(dct.dct_decode(y, shape, 64), x.double()) <= FP32_CLASS


@pytest.mark.usefixtures("poison", "bf16x6")
def test_bf16x6_error_feedback_matches_float64(device):
    grads = [torch.randn(s, device=device) for s in SHAPES]
    deltas = [torch.randn(s, device=device) for s in SHAPES]
    ref = [d.double() for d in deltas]
    before = [0.9 * d.double() + 0.05 * g.double() for d, g in zip(deltas, grads, strict=True)]
    idx, vals = ef_encode(deltas, grads, beta=0.9, lr=0.05, chunk=64, k=32, alpha=0.8)
    ref_idx, ref_vals = ef_encode_reference(
        ref,
        [g.double() for g in grads],
        0.9,
        0.05,
        64,
        32,
        alpha=0.8,
        value_dtype=torch.float64,
        dtype=torch.float64,
    )
    assert torch.equal(idx.long(), ref_idx.long())
    assert rel_err(vals, ref_vals) <= FP32_CLASS
    for d, r, b in zip(deltas, ref, before, strict=True):
        assert (d.double() - r).norm() <= FP32_CLASS * b.norm()

    params = [torch.randn(s, device=device) for s in SHAPES]
    ref_params = [p.double() for p in params]
    other = [torch.randn(s, device=device) for s in SHAPES]
    idx2, vals2 = ef_encode(other, [torch.randn(s, device=device) for s in SHAPES], beta=0.5, lr=1.0, k=32)
    gathered_idx, gathered_vals = torch.stack([idx, idx2]), torch.stack([vals, vals2])
    ef_decode(params, gathered_idx, gathered_vals, lr=0.01, k=32, weight_decay=0.1, use_sign=False)
    ef_decode_reference(
        ref_params,
        gathered_idx,
        gathered_vals.double(),
        64,
        32,
        0.01,
        weight_decay=0.1,
        use_sign=False,
        dtype=torch.float64,
    )
    for p, r in zip(params, ref_params, strict=True):
        assert rel_err(p, r) <= FP32_CLASS
