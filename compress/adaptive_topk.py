"""SparseLoCo's ``adaptive_topk``: the same budget of values per sync, redistributed among the
compressed tensors by the share of each error buffer's energy its selection captured.

Each sync measures, per compressed tensor, the captured share (:func:`captured_share`); every
rank's shares are averaged in rank order (:func:`average_shares`, which refuses a peer's
shares outside [0, 1]) and turned into the next sync's k per tensor by
:func:`redistribute_topk`, the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cokit.compress.agreement import PeerDataError
from cokit.triton_kernels._checks import check_number

__all__ = [
    "ADAPTIVE_RANGE",
    "average_shares",
    "captured_share",
    "check_adaptive_range",
    "k_limits",
    "redistribute_topk",
]

#: ``adaptive_range`` when ``adaptive_topk`` is on and no range is given
ADAPTIVE_RANGE = (0.25, 4.0)
#: the smallest weight (missed energy share) :func:`redistribute_topk` gives a tensor, so that a
#: tensor whose selection captured everything still takes part in the normalization
MIN_WEIGHT = 1e-3


def check_adaptive_range(
    value: object, adaptive: bool, topk: object, where: str
) -> tuple[float, float] | None:
    """``adaptive_range`` as two floats ``0 < low <= 1 <= high`` (None when the option is off)."""
    if not adaptive:
        if value is not None:
            raise ValueError(f"{where}: adaptive_range={value!r} needs adaptive_topk=True")
        return None
    if topk is None:
        raise ValueError(
            f"{where}: adaptive_topk=True redistributes the top-k budget; it needs topk (not None, DiLoCo)"
        )
    if value is None:
        return ADAPTIVE_RANGE
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{where}: adaptive_range must be a pair (low, high), got {value!r}")
    low = check_number("adaptive_range[0]", value[0], 0.0, 1.0, low_open=True, where=where)
    high = check_number("adaptive_range[1]", value[1], 1.0, where=where)
    return low, high


def k_limits(topk: int, tile_numel: int, k_range: tuple[float, float]) -> tuple[int, int]:
    """The smallest and largest k of a tensor whose tiles hold ``tile_numel`` values."""
    low = min(tile_numel, max(1, math.ceil(k_range[0] * topk - 1e-9)))
    return low, min(tile_numel, max(low, math.floor(k_range[1] * topk + 1e-9)))


def redistribute_topk(
    captured: list[float],
    tiles: list[int],
    tile_numels: list[int],
    topk: int,
    k_range: tuple[float, float] = ADAPTIVE_RANGE,
    current: list[int] | None = None,
) -> list[int]:
    """``adaptive_topk``'s rule: the k of each compressed tensor for the next sync.

    Tensor ``i`` has ``tiles[i]`` tiles of ``tile_numels[i]`` values, and its last selection,
    of ``current[i]`` values per tile (default ``topk``), captured the share ``captured[i]`` of
    its error buffer's energy (averaged over the ranks). The budget is the static one,
    ``B = sum_i tiles[i] * min(topk, tile_numels[i])`` values. Each tensor gets a real target
    ``x_i = clamp(lam * w_i, low_i, high_i)``, with the weight
    ``w_i = current[i] * max(1 - captured[i], 1e-3)``: the energy it missed, times the k it
    missed it with. Without that factor the rule swings (more k captures more, so the next
    sync gives less); with it, a tensor whose missed share falls like ``1 / k`` keeps its
    weight wherever its k is, so the allocation settles. ``lam`` is the one for which
    ``sum_i tiles[i] * x_i = B`` (found by bisection, to the last bit); ``low_i, high_i`` are
    ``ceil(low * topk), floor(high * topk)`` of ``k_range``, within ``[1, tile_numels[i]]``.
    Then ``k_i = floor(x_i)``, and what is left of ``B`` goes as ``+1`` steps to the tensors of
    largest fractional part first (ties: larger weight, then lower index), repeated while a step
    fits below ``high_i`` and within ``B``. So ``sum_i tiles[i] * k_i <= B`` always; of two
    tensors with the same limits, the one that missed more energy never gets the smaller target;
    and the result depends only on the arguments (plain float arithmetic, alike on every rank).
    """
    n = len(captured)
    if not (len(tiles) == len(tile_numels) == n):
        raise ValueError(
            f"redistribute_topk: captured, tiles and tile_numels have {n}, {len(tiles)} and "
            f"{len(tile_numels)} entries; give one of each per tensor"
        )
    if not all(isinstance(t, int) and t >= 1 for t in (*tiles, *tile_numels, topk)):
        raise ValueError("redistribute_topk: tiles, tile_numels and topk must be positive integers")
    if not all(isinstance(f, (int, float)) and 0.0 <= f <= 1.0 for f in captured):
        raise ValueError(f"redistribute_topk: every captured share must be in [0, 1], got {captured!r}")
    if not 0.0 < k_range[0] <= 1.0 <= k_range[1]:
        raise ValueError(
            f"redistribute_topk: k_range must be (low, high), 0 < low <= 1 <= high, got {k_range!r}"
        )
    ks_now = [topk] * n if current is None else list(current)
    if len(ks_now) != n or not all(isinstance(k, int) and k >= 1 for k in ks_now):
        raise ValueError(
            f"redistribute_topk: current must be one positive integer k per tensor, got {current!r}"
        )
    if n == 0:
        return []
    limits = [k_limits(topk, size, k_range) for size in tile_numels]
    budget = sum(t * min(topk, size) for t, size in zip(tiles, tile_numels, strict=True))
    weights = [k * max(1.0 - float(f), MIN_WEIGHT) for k, f in zip(ks_now, captured, strict=True)]

    def targets(lam: float) -> list[float]:
        return [min(max(lam * w, float(lo)), float(hi)) for w, (lo, hi) in zip(weights, limits, strict=True)]

    def total(xs: list[float]) -> float:
        return sum(t * x for t, x in zip(tiles, xs, strict=True))

    # total(targets(lam)) grows with lam, from sum tiles * low <= B to sum tiles * high >= B
    below, above = 0.0, max(hi / w for w, (_, hi) in zip(weights, limits, strict=True))
    for _ in range(200):
        mid = (below + above) / 2
        if mid in (below, above):
            break
        if total(targets(mid)) <= budget:
            below = mid
        else:
            above = mid
    xs = targets(below)
    ks = [max(lo, min(hi, math.floor(x))) for x, (lo, hi) in zip(xs, limits, strict=True)]
    left = budget - sum(t * k for t, k in zip(tiles, ks, strict=True))
    order = sorted(range(n), key=lambda i: (-(xs[i] - math.floor(xs[i])), -weights[i], i))
    grown = True
    while grown and left > 0:
        grown = False
        for i in order:
            if ks[i] < limits[i][1] and tiles[i] <= left:
                ks[i] += 1
                left -= tiles[i]
                grown = True
    return ks


def captured_share(coeffs: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """The share of ``coeffs``' energy (sum of squares, float64) in ``picked`` (1 when there is
    no energy at all: nothing was missed), as a 0-d float64 tensor in [0, 1]."""
    whole = torch.linalg.vector_norm(coeffs.reshape(-1), dtype=torch.float64) ** 2
    got = torch.linalg.vector_norm(picked.reshape(-1), dtype=torch.float64) ** 2
    return (got / whole).nan_to_num(1.0).clamp(0.0, 1.0)


def average_shares(gathered: torch.Tensor, owner: str, rank_of: Callable[[int], int]) -> list[float]:
    """Every rank's captured-energy shares ``(world, tensors)`` -> their mean over the ranks, in
    rank order (the same float sums on every rank); a peer's share that is not finite or not in
    [0, 1] raises :class:`PeerDataError` naming its global rank."""
    gathered = gathered.cpu()
    ok = (torch.isfinite(gathered) & (gathered >= 0) & (gathered <= 1)).all(dim=1)
    if not bool(ok.all()):
        r = int((~ok).nonzero()[0, 0])
        raise PeerDataError(
            f"{owner}: rank {rank_of(r)} sent captured-energy shares outside [0, 1] (adaptive_topk): "
            "its process runs other code, or its memory is corrupt"
        )
    rows = gathered.double().tolist()
    shares = [0.0] * gathered.shape[1]
    for row in rows:
        shares = [s + x for s, x in zip(shares, row, strict=True)]
    return [s / len(rows) for s in shares]
