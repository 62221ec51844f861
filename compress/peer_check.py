"""Validation of the bytes peers send, before anything is decoded or applied.

A gathered payload is the same bytes on every rank, so every rank finds the same fault and
raises the same :class:`~cokit.compress.agreement.PeerDataError`, naming the rank that sent it,
the bucket, the tensor and what was wrong, without another collective. Checked per selection:

- every position lies inside its tile (an out-of-range position would index another tile's
  memory on the Triton path and raise deep inside torch on the CPU path);
- positions increase strictly inside each tile (every encoder emits them so; a repeated
  position would be added twice);
- every value is finite (a NaN from a peer would turn whole tiles to zero through ``sign``).

Lengths need no check here: sizes are agreed before any payload collective
(:mod:`cokit.compress.agreement`), and each rank's slice of an all-gather has the agreed size.
Dense all-reduces are checked for finite results; a sum cannot name its sender. The cost is
one vectorized pass over the selection (about 1/100 of the gradient elements at DeMo's
defaults); ``python -m cokit.bench.payload_validation`` measures it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cokit.compress.agreement import PeerDataError
from cokit.compress.payload import PayloadCodec

__all__ = ["UNCHANGED", "check_dense", "check_selection"]

#: what a round that stopped at a peer's bad data had changed, unless its front end says more
UNCHANGED = "no parameter changed"


def check_selection(
    codec: PayloadCodec,
    indices: torch.Tensor,
    values: torch.Tensor,
    *,
    owner: str,
    bucket: str,
    rank_of: Callable[[int], int],
    names: Sequence[str] | None = None,
    changed: str = UNCHANGED,
) -> None:
    """Raise :class:`PeerDataError` unless every rank's selection ``(world, P)`` is well formed;
    ``changed`` says what the round had changed by then.

    The common case is a few vectorized passes in the indices' own dtype and one reduction of
    the values; only a payload with a fault is searched for the first faulty slot."""
    biggest = max((t.tile_numel for t in codec.plan.tilings), default=0)
    fits = indices.dtype.is_floating_point is False and biggest <= torch.iinfo(indices.dtype).max
    sizes, continues = codec.slot_bounds(indices.device, indices.dtype if fits else torch.int64)
    fine = not bool((indices >= sizes).any()) and not (indices.numel() and int(indices.min()) < 0)
    if fine and indices.shape[1] > 1:
        fine = not bool(((indices[:, 1:] <= indices[:, :-1]) & continues).any())
    if fine:
        peak = values.abs().amax() if values.numel() else values.new_zeros(())
        if bool(torch.isfinite(peak)):
            return
    idx = indices.long()
    problems = (idx < 0) | (idx >= sizes.long())
    if idx.shape[1] > 1:
        problems[:, 1:] |= (idx[:, 1:] <= idx[:, :-1]) & continues
    what = "position"
    if not bool(problems.any()):
        problems = ~torch.isfinite(values)
        what = "value"
    rank, slot = (int(v) for v in problems.nonzero()[0])
    tensor, tile = _locate(codec, slot)
    t = codec.plan.tilings[tensor]
    label = (
        names[tensor] if names is not None and tensor < len(names) else f"tensor {tensor} {tuple(t.shape)}"
    )
    if what == "value":
        fault = f"a non-finite value ({float(values[rank, slot])})"
    elif 0 <= int(idx[rank, slot]) < t.tile_numel:
        fault = f"position {int(idx[rank, slot])} twice or out of order"
    else:
        fault = f"position {int(idx[rank, slot])}, outside the tile's {t.tile_numel} positions"
    raise PeerDataError(
        f"{owner}: rank {rank_of(rank)} sent a malformed payload in {bucket}: {fault} in tile {tile} of "
        f"{label} (slot {slot}); {changed}. That rank runs other code or settings, or "
        "its memory or link corrupts data: fix or remove it, then restart every rank from the last "
        "checkpoint (validate_payload=False skips this check for a fleet you trust)"
    )


def check_dense(mean: torch.Tensor, *, owner: str, bucket: str, changed: str = UNCHANGED) -> None:
    """Raise :class:`PeerDataError` if an all-reduce of finite inputs came back non-finite;
    ``changed`` says what the round had changed by then."""
    if mean.numel() and not bool(torch.isfinite(mean).all()):
        raise PeerDataError(
            f"{owner}: the dense all-reduce of {bucket} came back non-finite although every rank "
            "reported finite inputs: a peer sent corrupt data (a sum cannot say which) or the sum "
            f"overflowed its dtype; {changed}. Restart every rank from the last checkpoint"
        )


def _locate(codec: PayloadCodec, slot: int) -> tuple[int, int]:
    """(tensor index, tile index) of a payload slot."""
    plan = codec.plan
    for n, (t, off) in enumerate(zip(plan.tilings, plan.payload_offsets, strict=True)):
        ke = t.k_eff(plan.k)
        if off <= slot < off + t.n_tiles * ke:
            return n, (slot - off) // ke
    return len(plan.tilings) - 1, 0
