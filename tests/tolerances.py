"""The tolerance table: every error bound the kernel and precision tests allow, by name.

Tests import these (``from tolerances import FP32_DCT``) instead of writing the number, so a
bound is chosen once, with its reason, and a test says which bound it holds the code to.
Relative errors are norm-wise (``helpers.rel_err``: ``|out - ref| / |ref|`` against float64)
unless a name says absolute. Tightening a bound is welcome when the measurements allow it;
loosening one needs the reason here to change first.
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------- unit roundoff
#: Unit roundoff of each output dtype (half a spacing at 1.0): the error of rounding a value
#: once to that dtype. The GEMM kernels round their fp32 accumulator to the output once.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}

#: Error added by each term of an fp32-accumulated sum, per unit of ``|a| @ |b|``: a
#: K-long dot product is off by at most ``K * 2^-24`` of its magnitude.
FP32_ACCUMULATION_PER_TERM = 2.0**-24

#: TF32 operand rounding (10 explicit mantissa bits, both operands) in a ``"tf32"`` dot.
TF32_OPERAND = 2.0**-10

#: Factor on the worst-case GEMM bounds (:func:`fp32_accumulation_bound`): a safety margin,
#: since the bound's constant is only first order.
BOUND_MARGIN = 2.0

#: Added to an elementwise bound so an exact zero reference does not divide by zero.
ZERO_GUARD = 1e-30


def fp32_accumulation_bound(
    ref: torch.Tensor, mag: torch.Tensor, k: int, out_dtype: torch.dtype, eps_dot: float = 0.0
) -> torch.Tensor:
    """Elementwise bound on ``|c - ref|`` for a GEMM that accumulates in fp32 and rounds once
    to ``out_dtype``::

        BOUND_MARGIN * (UNIT_ROUNDOFF[out] * |ref| + (K * 2^-24 + eps_dot) * mag) + ZERO_GUARD

    ``mag`` is ``|a| @ |b|`` (plus ``|bias|``) in float64; ``eps_dot`` is
    :data:`TF32_OPERAND` for tf32 dots, else 0."""
    per_mag = k * FP32_ACCUMULATION_PER_TERM + eps_dot
    return BOUND_MARGIN * (UNIT_ROUNDOFF[out_dtype] * ref.abs() + per_mag * mag) + ZERO_GUARD


# ----------------------------------------------------------------------------- DCT
#: float64 DCT basis: ``B @ B.T`` is the identity to this (absolute); sums of at most 64
#: float64 products (unit roundoff 1.1e-16) stay far below it.
BASIS_ORTHONORMAL_ATOL = 1e-12

#: fp32 DCT encode or decode of chunks up to 64 long vs float64 (relative): two fp32 dots of
#: at most 64 terms per coefficient; measured 2.1e-7 on 64x64 tiles (docs/kernels.md), so
#: this leaves a margin of about ten.
FP32_DCT = 2e-6

#: Parseval for an fp32 DCT: ``sum(coeffs^2) / sum(x^2)`` is 1 to this. Squaring doubles the
#: relative error of the coefficients, and fp16/bf16 inputs are summed in fp32.
FP32_PARSEVAL = 1e-5

#: A multi-tensor bucket launch vs one launch per tensor (absolute, fp32 coefficients of
#: unit-variance inputs): the same tile math, possibly another tile class and dot shape.
FP32_BUCKET_VS_SINGLE_ATOL = 1e-6

#: fp32 coefficients decoded to an fp16 tensor (relative): one rounding to fp16, unit
#: roundoff 2^-11 = 4.9e-4, on top of :data:`FP32_DCT`.
FP16_DECODE = 1e-3

#: The fp32 accuracy class of the fp32-class tensor-core dots (``"tf32x3"`` on sm_90+,
#: ``"bf16x6"`` on sm_80), relative, on encodes and round trips: what shipping a dot
#: precision requires. Measured 2.1e-7 (tf32x3) and 0.8e-7 (bf16x6) on 64x64 tiles; plain
#: TF32 (4.1e-4) misses it, which is why it is not shipped.
FP32_CLASS = 1e-5

# ----------------------------------------------------------------------------- error feedback
#: fp32 error-feedback encode (momentum, DCT, top-k values, the buffer left) and decode
#: (parameters after the update) vs float64, relative. Tighter than :data:`FP32_DCT`: the
#: sent values are the largest coefficients of each tile, the buffer is compared against its
#: norm before the update, and decoded parameters move by a small step (lr 0.01) from values
#: that are exact.
FP32_EF = 1e-6

#: An absolute bound at the fp32 error-feedback scale, for small hand-built cases (one 1x8
#: tile) whose exact values are O(1).
FP32_EF_ATOL = 1e-6

#: After sending every coefficient (k = tile size), what the fp32 buffer keeps is rounding
#: only: its largest element stays below this for unit-variance gradients (absolute).
FP32_EF_EVERYTHING_SENT_ATOL = 1e-5

#: Payload values sent as 16 bits vs float64 (relative): one rounding to the value dtype,
#: unit roundoff 2^-11 (fp16) and 2^-8 (bf16), with a margin of about two.
SIXTEEN_BIT_VALUES = {torch.float16: 1e-3, torch.bfloat16: 1e-2}

#: 16-bit parameters after one decode vs float64 (relative): one rounding to the parameter
#: dtype, at the bf16 bound for both fp16 and bf16.
SIXTEEN_BIT_PARAMS = 1e-2

#: Sign decodes: a sign may flip where the decoded value is ~0, so an element counts as
#: changed when it is off by more than this (absolute)...
SIGN_FLIP_ATOL = 1e-6
#: ...and at most this share of the elements may change.
SIGN_FLIP_SHARE = 0.01

# ----------------------------------------------------------------------------- GEMM and linear
#: fp32 results of two equal computations through different graphs (eager vs
#: torch.compile, kernel vs float64 F.linear on small sizes), as ``assert_close`` keywords.
FP32_CLOSE = {"rtol": 1e-5, "atol": 1e-5}

#: The sum over every element of an fp32 GEMM vs torch's: summing M*N entries grows the
#: absolute error, so atol is ten times :data:`FP32_CLOSE`'s.
FP32_SUM_CLOSE = {"rtol": 1e-5, "atol": 1e-4}

#: The bias gradient (``dY`` summed over 6 rows in the dtype) vs float64: up to this many
#: roundings to the dtype (relative), and an fp32-scale absolute floor for sums near zero.
BIAS_GRAD_ROUNDINGS = 4
BIAS_GRAD_ATOL = 1e-5

#: cokit's Linear vs nn.Linear under CPU bf16 autocast: each rounds the fp32 product to bf16
#: once (unit roundoff 2^-8), so they differ by at most two roundings.
BF16_AUTOCAST = 2.0**-7

#: The linear op's GPU branch (faked through the interpreter), forward and backward vs
#: float64 with sums of 37 to 40 terms: fp16 products are exact in the fp32 accumulator and
#: the output rounds once to fp16 (2^-11 = 4.9e-4), so 3e-3 is about six roundings; fp32
#: at :data:`FP32_CLOSE`'s scale. The same number is rtol and atol.
GPU_BRANCH = {torch.float16: 3e-3, torch.float32: 1e-5}

# ----------------------------------------------------------------------------- stochastic rounding
#: Statistical checks of stochastic rounding (mean and share rounded up over the draws) allow
#: this many standard deviations: a correct rounding fails one with probability ~2e-9.
STOCHASTIC_SIGMAS = 6
