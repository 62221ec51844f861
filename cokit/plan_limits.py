"""The ranges of ``cokit plan``'s inputs, checked in one place for the CLI and the API alike.

:data:`LIMITS` holds each input's range and what to give; :func:`check_input` raises
:class:`PlanInputError` (a ``ValueError``) naming the input, the range, the value and the
option that sets it. Its own module so that :mod:`cokit.model_shapes` (which :mod:`cokit.plan`
imports) can check a parameter count too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["LIMITS", "MAX_PARAMS", "Limit", "PlanInputError", "check_input"]

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def _rate_text(bits_per_s: float) -> str:
    """``2.5e10`` -> ``"25gbit"`` (tc's decimal units, as ``--bandwidth`` takes them)."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def _as_number(value: Any) -> int | float | None:
    """``value`` as a Python int (any integral type: numpy's too) or float (any real), else
    None (a bool, text, None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _finite(value: float) -> bool:
    """Whether a number is finite (integers always are, even beyond float's range)."""
    return isinstance(value, int) or math.isfinite(value)


def _number_text(value: float) -> str:
    """``1048576`` -> ``"1,048,576"``, ``0.5`` -> ``"0.5"``, ``10**30`` -> ``"1e+30"``, an
    integer beyond float's range -> ``"about 10**400"``."""
    if isinstance(value, int):
        v = value
        if abs(v) < 10**16:
            return f"{v:,}"
        if abs(v) < 10**300:
            return f"{float(v):g}"
        return f"{'-' if v < 0 else ''}about 10**{int(abs(v).bit_length() * math.log10(2))}"
    if abs(value) < 1e16 and float(value).is_integer():
        return f"{int(value):,}"
    return f"{float(value):g}"


@dataclasses.dataclass(frozen=True)
class Limit:
    """The range one plan input may take, and what to give when it is outside.

    ``low`` to ``high`` inclusive (``low`` excluded when ``low_open``), an integer when
    ``integer``; ``choices``, when given, the only values. ``flag`` is the ``cokit plan``
    option that sets it (``flag_scale``: the option's value is the input times it, e.g.
    milliseconds for seconds); ``rate``: shown as a rate like ``25gbit``.
    """

    low: float
    high: float
    integer: bool
    advice: str
    flag: str | None = None
    flag_scale: float = 1.0
    low_open: bool = False
    rate: bool = False
    choices: tuple[int, ...] = ()

    def allows(self, value: Any, high: float | None = None) -> bool:
        """Whether ``value`` is in range (``high`` overrides :attr:`high`)."""
        number = _as_number(value)
        if number is None or (self.integer and not isinstance(number, int)) or not _finite(number):
            return False
        if self.choices:
            return number in self.choices
        top = self.high if high is None else high
        return (self.low < number if self.low_open else self.low <= number) and number <= top

    def describe(self, high: float | None = None, cli: bool = False) -> str:
        """The range in words, e.g. ``an integer from 2 to 1,048,576``."""
        scale = self.flag_scale if cli else 1.0
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))

        def show(v: float) -> str:
            return _rate_text(v) if self.rate else _number_text(v * scale)

        top = self.high if high is None else high
        kind = "an integer" if self.integer else "a rate" if self.rate else "a finite number"
        if self.low_open:
            return f"{kind} above {show(self.low)} and at most {show(top)}"
        return f"{kind} from {show(self.low)} to {show(top)}"


#: the largest parameter count planned: a bare count is laid out as 4096x4096 matrices, and
#: the payload layout is built tensor by tensor (10T parameters: ~600k tensors, under a minute)
MAX_PARAMS = 10**13
#: every input's range (keys: the API's argument or field names)
LIMITS: dict[str, Limit] = {
    "params": Limit(
        1,
        MAX_PARAMS,
        True,
        "give the model's parameter count, e.g. 124M, 7B or 1.8T",
        "--params",
    ),
    "world": Limit(2, 2**20, True, "give the ranks (GPUs) in all; one rank exchanges nothing", "--world"),
    "ranks_per_node": Limit(1, 1024, True, "give the ranks (GPUs) in one node, e.g. 8", "--ranks-per-node"),
    "bits_per_s": Limit(
        1e3,
        1e15,
        False,
        "give each rank's link rate like 100mbit, 25gbit or 400gbit",
        "--bandwidth",
        rate=True,
    ),
    "latency_s": Limit(
        0,
        10,
        False,
        "give the one-way latency of one hop",
        "--latency-ms",
        flag_scale=1e3,
    ),
    "efficiency": Limit(
        0, 1, False, "give the link's goodput / line rate (0.94 for TCP)", "--efficiency", low_open=True
    ),
    "burst_bytes": Limit(0, 10**15, True, "give the shaper's burst in bytes (0: no burst)", "--burst-bytes"),
    "samples_per_step": Limit(1, 10**9, True, "give the samples each rank takes per step", "--batch"),
    "dataset_samples": Limit(1, 10**15, True, "give the samples in one epoch", "--dataset-size"),
    "tokens_per_sample": Limit(
        1,
        10**9,
        True,
        "give the tokens in one sample (its sequence length), or a measured --compute-ms",
        "--tokens-per-sample",
    ),
    "tokens_per_step": Limit(
        1,
        10**15,
        True,
        "give the tokens one rank computes per step (tokens per sample x samples), or a measured compute_ms",
        "--tokens-per-sample x --batch",
    ),
    "compute_ms": Limit(
        0,
        1e9,
        False,
        "give the measured forward + backward + optimizer time of one step, in milliseconds",
        "--compute-ms",
    ),
    "mfu": Limit(
        0,
        1,
        False,
        "give the share of the GPU's peak the model reaches (0.4 is typical)",
        "--mfu",
        low_open=True,
    ),
    "price_per_hour": Limit(
        0, 1e6, False, "give the price of one GPU for an hour, or leave it out", "--price-per-hour"
    ),
    "exposed": Limit(
        0,
        1,
        False,
        "give the measured share of communication left exposed after overlap, e.g. 0.6",
        "--exposed",
    ),
    "demo_topk": Limit(
        1,
        2**20,
        True,
        "give DeMo's coefficients kept per chunk (default 32; a chunk holds chunk**2)",
        "--demo-topk",
    ),
    "sparseloco_topk": Limit(
        1,
        2**20,
        True,
        "give SparseLoCo's coefficients kept per chunk (default 64; a chunk holds chunk**2)",
        "--sparseloco-topk",
    ),
    "demo_chunk": Limit(1, 1024, True, "give DeMo's DCT chunk side (default 64)"),
    "sparseloco_chunk": Limit(1, 1024, True, "give SparseLoCo's DCT chunk side (default 64)"),
    "sync_every": Limit(1, 10**6, True, "give SparseLoCo's steps between syncs (default 5)", "--sync-every"),
    "grad_itemsize": Limit(
        1,
        8,
        True,
        "give the gradient dtype's element size in bytes (4: fp32, 2: bf16)",
        "--grad-dtype",
        choices=(1, 2, 4, 8),
    ),
    "bucket_cap_mb": Limit(
        0, 1e6, False, "give the exchange's bucket cap in MiB (default 25)", low_open=True
    ),
}


class PlanInputError(ValueError):
    """A plan input outside its :data:`LIMITS` range. The message names the input (``owner:
    name``), the range, the value given and what to give; :meth:`cli_message` says the same
    with ``cokit plan``'s option."""

    def __init__(self, owner: str, name: str, value: Any, high: float | None = None, key: str = "") -> None:
        self.owner, self.name, self.value, self.high, self.key = owner, name, value, high, key
        super().__init__(self._text(f"{owner}: {name}" + (f"[{key!r}]" if key else ""), cli=False))

    def _text(self, label: str, cli: bool) -> str:
        limit = LIMITS[self.name]
        value = _as_number(self.value)
        if value is None:
            shown = repr(self.value)
        elif limit.rate and 0 < value < 1e300:
            shown = _rate_text(float(value))
        elif cli and limit.flag_scale != 1.0 and abs(value) < 1e300:
            shown = _number_text(float(value) * limit.flag_scale)
        else:
            shown = _number_text(value)
        return f"{label} must be {limit.describe(self.high, cli)}, got {shown}; {limit.advice}"

    def cli_message(self, flags: Mapping[str, str] | None = None) -> str:
        """The message with the option that sets the input (``flags`` overrides
        :attr:`Limit.flag`, e.g. ``--intra-bandwidth`` for a second link; an empty flag keeps
        the API's wording)."""
        flag = (flags or {}).get(self.name, LIMITS[self.name].flag)
        if not flag:
            return str(self)
        return self._text(flag + (f" ({self.key})" if self.key else ""), cli=True)


def check_input(owner: str, name: str, value: Any, *, high: float | None = None, key: str = "") -> None:
    """Raise :class:`PlanInputError` unless ``value`` is in ``LIMITS[name]``'s range (``high``:
    a tighter top, e.g. a top-k's chunk**2; ``key``: which entry of a per-method mapping)."""
    if not LIMITS[name].allows(value, high):
        raise PlanInputError(owner, name, value, high, key)
