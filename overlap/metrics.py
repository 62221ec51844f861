"""The overlap metrics of docs/design.md §1.2, from isolated and overlapped times.

With ``T_comp`` and ``T_comm`` measured alone, ``T_seq = T_comp + T_comm`` and ``T_ovl``
measured with both running concurrently:

* ideal                 = ``max(T_comp, T_comm)``
* speedup               = ``T_seq / T_ovl``
* reduction             = ``1 - T_ovl / T_seq``
* fraction of ideal gain = ``(T_seq - T_ovl) / min(T_comp, T_comm)``
* comm hidden           = ``(T_seq - T_ovl) / T_comm``
* compute slowdown      = ``T_comp_under_overlap / T_comp - 1``

Pure arithmetic, no timing: :mod:`cokit.overlap.measure` feeds it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["METRIC_NAMES", "OverlapMetrics", "Spread", "compute_metrics", "summarize"]

#: the derived metrics, in report order.
METRIC_NAMES = (
    "speedup",
    "reduction",
    "fraction_of_ideal_gain",
    "comm_hidden",
    "compute_slowdown",
    "speedup_vs_measured_seq",
)


def _check_time(name: str, value: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid; allowed: a finite number of milliseconds")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} is invalid; allowed: a time > 0 ms")
    return float(value)


@dataclasses.dataclass(frozen=True)
class OverlapMetrics:
    """Times (ms) and the derived metrics of one compute/communication pair."""

    t_comp: float
    t_comm: float
    t_ovl: float
    t_seq: float  # T_comp + T_comm (the definition used by every ratio)
    ideal: float  # max(T_comp, T_comm)
    speedup: float
    reduction: float
    fraction_of_ideal_gain: float
    comm_hidden: float
    compute_slowdown: float | None  # None when T_comp_under_overlap was not measured
    t_comp_under_overlap: float | None = None
    t_seq_measured: float | None = None  # both run back to back, timed as one
    speedup_vs_measured_seq: float | None = None  # t_seq_measured / t_ovl

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)


def compute_metrics(
    t_comp: float,
    t_comm: float,
    t_ovl: float,
    t_comp_under_overlap: float | None = None,
    t_seq_measured: float | None = None,
) -> OverlapMetrics:
    """All metrics of docs/design.md §1.2 from times in milliseconds (exact arithmetic, no rounding).

    Raises ``ValueError`` for non-finite, negative or zero times (``t_comp_under_overlap``
    may be 0: compute that finished instantly).
    """
    t_comp = _check_time("t_comp", t_comp)
    t_comm = _check_time("t_comm", t_comm)
    t_ovl = _check_time("t_ovl", t_ovl)
    t_seq = t_comp + t_comm
    gain = t_seq - t_ovl
    slowdown = None
    if t_comp_under_overlap is not None:
        slowdown = _check_time("t_comp_under_overlap", t_comp_under_overlap, allow_zero=True) / t_comp - 1.0
    vs_measured = None
    if t_seq_measured is not None:
        vs_measured = _check_time("t_seq_measured", t_seq_measured) / t_ovl
    return OverlapMetrics(
        t_comp=t_comp,
        t_comm=t_comm,
        t_ovl=t_ovl,
        t_seq=t_seq,
        ideal=max(t_comp, t_comm),
        speedup=t_seq / t_ovl,
        reduction=1.0 - t_ovl / t_seq,
        fraction_of_ideal_gain=gain / min(t_comp, t_comm),
        comm_hidden=gain / t_comm,
        compute_slowdown=slowdown,
        t_comp_under_overlap=t_comp_under_overlap,
        t_seq_measured=t_seq_measured,
        speedup_vs_measured_seq=vs_measured,
    )


@dataclasses.dataclass(frozen=True)
class Spread:
    """Median and spread of repeated samples: quartiles (``q1``, ``q3``), extremes, count."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @property
    def iqr(self) -> float:
        """Interquartile range ``q3 - q1``."""
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus ``iqr``."""
        return {**dataclasses.asdict(self), "iqr": self.iqr}


def summarize(samples: Sequence[float]) -> Spread:
    """Median, quartiles (inclusive method) and extremes of ``samples`` (at least one)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("summarize needs at least one sample")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(median=statistics.median(xs), q1=q1, q3=q3, min=xs[0], max=xs[-1], n=len(xs))
