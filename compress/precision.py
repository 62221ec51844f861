"""Writing optimizer updates into bf16/fp16 parameters without losing the small ones.

An optimizer computes each new weight in fp32 and then stores it in the parameter's dtype.
With round-to-nearest (``precision="nearest"``) an update smaller than half the spacing of
the bf16 numbers around a weight is lost: bf16 keeps 8 significant bits, so a weight ``w``
does not move under an update below about ``|w| * 2**-9``. Measured with a sign update of
``lr`` (the DeMo rule): at ``lr=1e-3`` every weight with ``|w| > 0.5`` is frozen (a
LayerNorm gain of 1, 62% of an N(0, 1) embedding); at ``lr=1e-4`` every ``|w| > 1/32``
(12% of N(0, 0.02) weights, 50% of nn.Linear(256, ·)'s init, 7% of the text workload's
transformer); at ``lr=3e-5`` about 55% of that transformer. The two remedies:

* ``"master"``: keep an fp32 master copy of each low-precision parameter (optimizer state
  ``"master"``), compute the new value from it and store its rounding in the parameter;
  nothing is lost, at 4 extra bytes per parameter.
* ``"stochastic"``: round the fp32 value to one of its two neighbouring representable values
  at random, up with probability equal to the distance from the lower one divided by the
  spacing. The expected stored value equals the fp32 value, so small updates survive on
  average; no extra memory. The draw comes from a :func:`rounding_generator` seeded by
  ``(seed, step)``, so replicas seeded alike round alike (bit-reproducible).

For float32 parameters every mode is an exact copy.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable

import torch

from cokit.compress.dtensor import is_dtensor

__all__ = [
    "PRECISIONS",
    "LowPrecisionWarning",
    "check_precision",
    "master_copy",
    "rounding_generator",
    "stochastic_round",
    "warn_if_unmastered",
    "write_update",
]

PRECISIONS = ("nearest", "master", "stochastic")

LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, *LOW_PRECISION)

# Owners that were already warned in this process (warn_if_unmastered warns once per owner).
_WARNED: set[str] = set()

# bf16 is the top 16 bits of fp32: adding 16 random low bits and clearing them rounds.
_BF16_LOW = 1 << 16
_BF16_KEEP = -(1 << 16)  # int32 0xFFFF0000
_INF_BITS = 0x7F800000
# fp16 decisions compare a 31-bit uniform integer with the fraction scaled by 2**31.
_FP16_BITS = 31


class LowPrecisionWarning(UserWarning):
    """bf16/fp16 parameters are written with round-to-nearest: small updates are lost."""


def check_precision(owner: str, value: object) -> str:
    """``value`` when it is one of :data:`PRECISIONS`; ``ValueError`` naming them otherwise."""
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(
            f"{owner}: precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got "
            f"{value!r} ('nearest': plain rounding, 'master': fp32 master weights, "
            "'stochastic': unbiased stochastic rounding)"
        )
    return value


def warn_if_unmastered(owner: str, params: Iterable[torch.Tensor], precision: str) -> None:
    """Warn once per ``owner`` (per process) when ``precision == "nearest"`` and some parameter
    is bf16/fp16: with round-to-nearest small updates are silently lost to rounding."""
    check_precision(owner, precision)
    if precision != "nearest" or owner in _WARNED:
        return
    params = list(params)
    low = [p for p in params if p.dtype in LOW_PRECISION]
    if not low:
        return
    _WARNED.add(owner)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in low})
    warnings.warn(
        f"{owner}: {len(low)} of {len(params)} parameters are {'/'.join(dtypes)} and "
        "precision='nearest' rounds each new weight to the nearest representable value, so an "
        "update smaller than half the spacing there is lost (bf16: below about |w| * 2**-9). "
        "Measured for bf16 with a sign update: at lr=1e-3 every weight with |w| > 0.5 never moves (a "
        "LayerNorm gain of 1, 62% of an N(0, 1) embedding); at lr=1e-4 every |w| > 1/32 (12% of "
        "N(0, 0.02) weights). Pass precision='master' (fp32 master weights, 4 bytes per "
        "parameter) or precision='stochastic' (unbiased stochastic rounding, no extra memory)",
        LowPrecisionWarning,
        stacklevel=3,
    )


def master_copy(param: torch.Tensor) -> torch.Tensor:
    """An fp32, contiguous copy of ``param`` (detached): the master weights of ``"master"``."""
    return torch.empty_like(param, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(
        param.detach()
    )


def rounding_generator(seed: int, step: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded from ``(seed, step)`` only: every replica that passes the
    same pair draws the same rounding bits (same device type), every step draws new ones."""
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rounding_generator: {name} must be an int >= 0, got {value!r}")
    digest = hashlib.blake2b(f"cokit-rounding:{seed}:{step}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits: valid on every backend
    return gen


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``x`` (float32) rounded at random to ``dtype`` (bf16 or fp16), unbiased.

    Each finite value goes to one of its two neighbours in ``dtype`` (itself when it is
    representable), away from zero with probability (|x| - |lower|) / spacing, lower being
    the neighbour nearer zero. ``±0``, ``±inf`` and NaN stay what they are; a finite value
    beyond the largest finite value of ``dtype`` becomes that value (saturates: a weight never
    turns into inf by a coin flip). Returns a ``dtype`` tensor; the draw uses ``generator``
    only, so the result is bit-reproducible."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: x must be float32, got {x.dtype}")
    if dtype not in LOW_PRECISION:
        raise TypeError(f"stochastic_round: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return _stochastic_fp32(x, dtype, generator).to(dtype)  # exact: values are representable


def _stochastic_fp32(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """:func:`stochastic_round`'s values, still as float32 (each exactly representable in
    ``dtype``), so that a caller can copy them into a parameter in one pass."""
    x = x.contiguous()
    out = _round_bf16(x, generator) if dtype == torch.bfloat16 else _round_fp16(x, generator)
    big = torch.finfo(dtype).max
    return torch.where(torch.isfinite(x), out.clamp(-big, big), x)  # saturate; inf, NaN as given


def _round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """bf16 is fp32 with the low 16 bits cleared. Adding a uniform integer r in [0, 2**16) to
    the bits and clearing them carries into the kept bits exactly when r >= 2**16 - low, i.e.
    with probability low / 2**16. Between two neighbouring bf16 values the fp32 values are
    evenly spaced (one binade; a carry out of the mantissa lands on the next binade's first
    value, the upper neighbour), so that probability is (|x| - lower) / spacing: unbiased.
    Sign-magnitude bits make it symmetric for negative values; subnormals work the same."""
    # Positive NaN bit patterns are capped at inf's so that the sum cannot overflow int32
    # (the caller puts inf and NaN back); every other pattern is at most inf's or negative.
    bits = x.view(torch.int32).clamp(max=_INF_BITS)
    r = torch.randint(0, _BF16_LOW, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    return ((bits + r) & _BF16_KEEP).view(torch.float32)


def _round_fp16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round up (away from zero) when a uniform 31-bit integer is below the threshold of
    :func:`_fp16_split`: with probability threshold / 2**31 = (|x| - lower) / spacing."""
    q, spacing, threshold = _fp16_split(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
    r = torch.randint(0, 1 << _FP16_BITS, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    up = (r < threshold).to(torch.float32)
    return torch.copysign((q + up) * spacing, x)


def _fp16_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, spacing, threshold)`` with ``|x| = (q + f) * spacing``: fp16's spacing around |x|
    is 2**(e - 10) (e = floor(log2 |x|), at least -14: subnormals); |x| / spacing is exact in
    fp32 (a power-of-two scaling), as is f = its fraction; ``threshold = ceil(f * 2**31)``.
    Exact (f * 2**31 is an integer) for |x| >= 2**-32: f has at most 31 fraction bits there.
    Below that (2**8 times under fp16's smallest subnormal) P(up) is f rounded up to a
    multiple of 2**-31: a bias under 2**-55 in absolute value."""
    a = x.abs()
    _, ex = torch.frexp(a)  # a = m * 2**ex, m in [0.5, 1): floor(log2 a) = ex - 1
    spacing_exp = (ex - 1).clamp(min=-14) - 10  # in [-24, 117]: a normal fp32 power of two
    inv = ((127 - spacing_exp) << 23).view(torch.float32)  # exactly 2**-spacing_exp
    scaled = a * inv  # exact: at most 2**11, at least 2**-125
    q = torch.floor(scaled)
    f = scaled - q  # exact, in [0, 1)
    threshold = torch.ceil(f * float(1 << _FP16_BITS)).to(torch.int32)  # exact scaling, < 2**31
    spacing = ((spacing_exp + 127) << 23).view(torch.float32)
    return q, spacing, threshold


def write_update(
    param: torch.Tensor,
    new_value_fp32: torch.Tensor,
    precision: str,
    *,
    master: torch.Tensor | None,
    generator: torch.Generator | None,
) -> None:
    """Store ``new_value_fp32`` in ``param`` (in place) the way ``precision`` says.

    ``"nearest"``: ``param.copy_(new)``. ``"master"``: ``master.copy_(new)`` then
    ``param.copy_(master)``; the caller computed ``new`` from ``master``, which bf16/fp16
    parameters need (float32 ones take ``master=None``). ``"stochastic"``: unbiased stochastic
    rounding of ``new`` with ``generator`` (see :func:`stochastic_round`). float32 parameters:
    every mode is an exact copy. ``generator`` is only drawn from by "stochastic" (otherwise
    ignored). Every argument is checked before anything is written."""
    where = "write_update"
    check_precision(where, precision)
    for name, t in (("param", param), ("new_value_fp32", new_value_fp32), ("master", master)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and is_dtensor(t):
            raise TypeError(
                f"{where}: {name} is a DTensor: pass its local shard (cokit.compress.dtensor.local)"
            )
    if param.dtype not in PARAM_DTYPES:
        raise TypeError(f"{where}: param must be float32, bfloat16 or float16, got {param.dtype}")
    if new_value_fp32.dtype != torch.float32:
        raise TypeError(
            f"{where}: new_value_fp32 must be float32 (compute the update in fp32), "
            f"got {new_value_fp32.dtype}"
        )
    _same_place(where, "new_value_fp32", new_value_fp32, param)
    low = param.dtype in LOW_PRECISION
    if master is not None and not (low and precision == "master"):
        raise ValueError(
            f"{where}: a master is only kept for bfloat16/float16 parameters with precision='master' "
            f"(param is {param.dtype}, precision={precision!r}): pass master=None"
        )
    if low and precision == "master":
        if master is None:
            raise ValueError(
                f"{where}: precision='master' needs the fp32 master of this {param.dtype} parameter: "
                "create it once with master_copy(param) and keep it in the optimizer state"
            )
        if master.dtype != torch.float32:
            raise TypeError(f"{where}: master must be float32 (use master_copy(param)), got {master.dtype}")
        _same_place(where, "master", master, param)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}")
    if low and precision == "stochastic":
        if generator is None:
            raise ValueError(
                f"{where}: precision='stochastic' needs a generator: pass "
                "rounding_generator(seed, step, param.device)"
            )
        if not _same_device(generator.device, param.device):
            raise ValueError(
                f"{where}: the generator is on {generator.device} but param is on {param.device}: "
                "create it with rounding_generator(seed, step, param.device)"
            )
    with torch.no_grad():
        if param.dtype not in LOW_PRECISION or precision == "nearest":
            param.copy_(new_value_fp32)
        elif precision == "master":
            assert master is not None  # checked above
            master.copy_(new_value_fp32)
            param.copy_(master)
        else:
            assert generator is not None  # checked above
            param.copy_(_stochastic_fp32(new_value_fp32, param.dtype, generator))


def _same_place(where: str, name: str, t: torch.Tensor, param: torch.Tensor) -> None:
    if t.shape != param.shape:
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, param {tuple(param.shape)}")
    if t.device != param.device:
        raise ValueError(f"{where}: {name} is on {t.device} but param is on {param.device}: move it there")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (``cuda`` is ``cuda:current``)."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None or b.index is None:
        return True
    return a.index == b.index
