"""Axis decisions of the dashboard: log or linear, which steps are syncs, the shared step range,
and a y range that a first-step outlier (compile, warm-up) does not flatten.

Each takes plain arrays (what a panel is about to plot), so the panels stay declarative and
the decisions are testable on their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

#: a positive range spanning more than this factor (max / min) is drawn on a log axis
LOG_SPAN = 10.0
#: a run whose bytes per step are zero on more than this share of its steps syncs now and then
SYNC_ZERO_SHARE = 0.5
#: the first point is an outlier when above this many times the later points' 99th percentile
OUTLIER_FACTOR = 2.0


def _finite(values: Iterable[np.ndarray]) -> np.ndarray:
    arrays = [np.asarray(v, dtype=float).ravel() for v in values]
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    return flat[np.isfinite(flat)]


def log_axis(values: Iterable[np.ndarray], span: float = LOG_SPAN) -> bool:
    """Whether the positive finite ``values`` (every line of one axis) span more than ``span``
    (max / min): a linear axis would flatten the small ones onto the floor."""
    v = _finite(values)
    v = v[v > 0]
    return bool(v.size) and float(v.max()) > span * float(v.min())


def sync_steps(sent: np.ndarray) -> np.ndarray | None:
    """A boolean mask of the steps that sent bytes, when most steps (more than
    :data:`SYNC_ZERO_SHARE` of those recorded) sent none: a SparseLoCo/DiLoCo-like run whose
    bytes come in syncs. None for a run that sends every step, or never."""
    sent = np.asarray(sent, dtype=float)
    known = np.isfinite(sent)
    if not known.any():
        return None
    syncs = known & (sent > 0)
    zeros = int((known & (sent == 0)).sum())
    if not syncs.any() or zeros <= SYNC_ZERO_SHARE * int(known.sum()):
        return None
    return syncs


def step_range(steps: Iterable[np.ndarray]) -> list[float] | None:
    """The x range every step-axis panel starts from (and returns to on reset): first to last
    step over all runs, padded by 1 % (at least half a step) so end markers are whole."""
    v = _finite(steps)
    if not v.size:
        return None
    lo, hi = float(v.min()), float(v.max())
    pad = max(0.5, 0.01 * (hi - lo))
    return [lo - pad, hi + pad]


def first_step_range(
    ys: Sequence[np.ndarray], *, from_zero: bool = False
) -> tuple[list[float], float] | None:
    """The initial y range of a time plot whose first point is an outlier, and that point.

    ``ys`` are the plotted lines (first point = first step). When the largest first point is
    above :data:`OUTLIER_FACTOR` times the 99th percentile of the later points, returns
    (the 1st-99th percentile of the later points, padded; from 0 with ``from_zero``, for a
    stacked plot) and the largest first point; else None (plotly's autorange is fine). The
    point stays in the data: hover shows it once the axis is autoscaled.
    """
    firsts, rest = [], []
    for y in ys:
        v = np.asarray(y, dtype=float)
        v = v[np.isfinite(v)]
        if v.size:
            firsts.append(float(v[0]))
            rest.append(v[1:])
    later = _finite(rest)
    if not firsts or later.size < 3:
        return None
    lo, hi = (float(p) for p in np.percentile(later, [1, 99]))
    first = max(firsts)
    if first <= OUTLIER_FACTOR * hi or first <= 0:
        return None
    pad = 0.15 * (hi - lo) or 0.05 * abs(hi) or 1.0
    return [0.0 if from_zero else lo - pad, hi + pad], first
