"""Validation of what peers send (cokit.compress.peer_check): every kind of malformed payload is
found and named (rank, tensor, tile, slot), and a well-formed one passes, whatever the codec."""

from __future__ import annotations

import pytest
import torch

from cokit.compress.agreement import PeerDataError
from cokit.compress.payload import get_codec
from cokit.compress.peer_check import check_dense, check_selection
from cokit.triton_kernels.error_feedback import ef_encode, payload_layout

SHAPES = [(64, 96), (130,), (7, 5)]


def _gathered(codec_name: str, world: int, k: int = 8, shapes=SHAPES, chunk: int = 64):
    """Every rank's real selection (ef_encode of random buffers), through the codec's wire."""
    plan = payload_layout(shapes, chunk, k)
    codec = get_codec(codec_name)(plan, torch.bfloat16)
    wires = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        deltas = [torch.zeros(s) for s in shapes]
        grads = [torch.randn(s, generator=g) for s in shapes]
        idx, vals = ef_encode(
            deltas, grads, beta=0.9, lr=1.0, chunk=chunk, k=k, value_dtype=codec.encode_dtype
        )
        wires.append(codec.to_wire(idx, vals))
    gathered = [torch.stack([w[i] for w in wires]) for i in range(len(codec.wire))]
    indices, values = codec.from_wire(gathered)
    return codec, indices.clone(), values.clone()


def _check(codec, indices, values):
    check_selection(
        codec, indices, values, owner="test", bucket="bucket 3", rank_of=lambda r: 10 + r, names=None
    )


@pytest.mark.parametrize("codec_name", ["reference", "compact", "sign", "int2"])
def test_a_well_formed_payload_passes_and_each_fault_is_named(codec_name):
    codec, indices, values = _gathered(codec_name, world=3)
    _check(codec, indices, values)
    plan = codec.plan
    k0, n0 = plan.tilings[0].k_eff(plan.k), plan.tilings[0].tile_numel
    cases = {
        "outside": (1, 5, n0 + 3, None, f"position {n0 + 3}, outside the tile's {n0} positions"),
        "negative": (2, 0, -4, None, "position -4, outside the tile"),
        "repeated": (0, 1, None, None, "twice or out of order"),
        "nan": (1, k0 + 2, None, float("nan"), "a non-finite value (nan)"),
        "inf": (2, 0, None, float("inf"), "a non-finite value (inf)"),
    }
    for name, (rank, slot, index, value, says) in cases.items():
        bad_idx, bad_val = indices.clone(), values.clone()
        if name == "repeated":
            bad_idx[rank, slot] = bad_idx[rank, slot - 1]
        if index is not None:
            bad_idx[rank, slot] = index
        if value is not None:
            bad_val[rank, slot] = value
        with pytest.raises(
            PeerDataError, match=f"test: rank {10 + rank} sent a malformed payload in bucket 3"
        ) as exc:
            _check(codec, bad_idx, bad_val)
        assert says in str(exc.value), (name, str(exc.value))
        assert slot < plan.tilings[0].n_tiles * k0  # every case's slot is in tensor 0
        assert f"in tile {slot // k0} of tensor 0 (64, 96) (slot {slot})" in str(exc.value), str(exc.value)


def test_positions_out_of_order_inside_a_tile_are_refused_but_tile_starts_may_drop():
    codec, indices, values = _gathered("compact", world=1)
    k = codec.plan.tilings[0].k_eff(codec.plan.k)
    swapped = indices.clone()
    swapped[0, [2, 3]] = swapped[0, [3, 2]]
    with pytest.raises(PeerDataError, match="twice or out of order"):
        _check(codec, swapped, values)
    # a tile's first position may be below the last one of the tile before: no fault there
    restart = indices.clone()
    restart[0, k] = 0
    _check(codec, restart, values)


def test_the_largest_int16_tile_is_checked_without_overflow():
    """A 128x256 tile has 32768 positions, the most int16 indices carry: its bound does not fit
    int16, and the check must not wrap around."""
    codec, indices, values = _gathered("compact", world=2, k=4, shapes=[(128, 256)], chunk=256)
    assert indices.dtype == torch.int16 and codec.plan.tilings[0].tile_numel == 32768
    _check(codec, indices, values)
    indices[1, 0] = -1
    with pytest.raises(PeerDataError, match="position -1"):
        _check(codec, indices, values)


def test_a_dense_result_must_be_finite():
    check_dense(torch.ones(5), owner="o", bucket="bucket 0")
    with pytest.raises(PeerDataError, match="o: the dense all-reduce of bucket 0 came back non-finite"):
        check_dense(torch.tensor([1.0, float("nan")]), owner="o", bucket="bucket 0")
