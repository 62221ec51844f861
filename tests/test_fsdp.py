"""DeMo on FSDP2 and HSDP (DTensor parameters) over real gloo groups.

The reference (tests/fsdp_workers.py) is a plain DeMo stepping the same shard slices with
the gradients FSDP would reduce-scatter; DeMo on the DTensor shards must match it exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_gloo
from tests.fsdp_workers import bad_setups, dcp_run, nonfinite_shard, train_and_reference

pytest.importorskip("torch.distributed.fsdp")

STEPS = 8


def _exact(results) -> None:
    for out in results:
        for got, want in zip(out["local"], out["expected"], strict=True):
            assert torch.equal(got, want), f"rank {out['rank']}: max diff {(got - want).abs().max()}"


def test_fsdp2_matches_demo_on_the_shards():
    results = run_gloo(2, train_and_reference, 1, STEPS)
    _exact(results)
    shapes = [[tuple(t.shape) for t in out["local"]] for out in results]
    assert shapes[0] != shapes[1], "uneven shards expected (7 and 5 rows over 2 ranks)"
    for out in results:
        assert out["losses"][-1] < out["losses"][0]
        stats = out["stats"]
        # nothing is exchanged over the mesh but the status agreement: 1 byte per parameter
        # from the other rank (ring all-gather), every step
        assert stats["step_intra_sent_bytes"] == 4 == stats["step_sent_bytes"]
        assert stats["group_size"] == 1 and stats["intra_group_size"] == 2


def test_hsdp_2x2_matches_reference_and_replicas_are_identical():
    results = run_gloo(4, train_and_reference, 2, STEPS)
    _exact(results)
    by_position = {}
    for out in results:
        by_position.setdefault(out["shard"], []).append(out["local"])
    for shard, replicas in by_position.items():
        assert len(replicas) == 2
        for a, b in zip(*replicas, strict=True):
            assert torch.equal(a, b), f"shard {shard}: replicas differ"
    for out in results:
        stats = out["stats"]
        assert stats["group_size"] == 2 and stats["intra_group_size"] == 2 and stats["world_size"] == 4
        intra, total = stats["step_intra_sent_bytes"], stats["step_sent_bytes"]
        assert intra == 4  # shard-group status agreement
        assert total - intra > 4  # the replicate exchange carries payloads too
        # plus the first step's layout check: one int64 crc from the other rank
        assert stats["total_intra_sent_bytes"] == STEPS * intra + 8


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_a_nonfinite_shard_on_one_rank_stops_every_rank(mode):
    results = run_gloo(2, nonfinite_shard, mode)
    for out in results:
        assert out["unchanged"]
        if mode == "skip":
            assert out["error"] is None and out["skipped"] == 1
        else:
            assert out["error"] is not None and "on rank 1" in out["error"]


BAD = {
    4: {
        "replicate placement": "Replicate() on mesh dimension 'replicate'",
        "group overlaps mesh": "the exchange group must hold one rank per shard position",
    },
    2: {
        "mixed": "give DeMo either only DTensor parameters",
        "overlap_backward": "overlap_backward=True works with plain data parallel only",
        "hierarchy": "hierarchy= is for plain data parallel",
    },
}


@pytest.mark.parametrize("world", sorted(BAD))
def test_bad_fsdp_setups_are_refused(world):
    for texts in run_gloo(world, bad_setups, list(BAD[world])):
        for case, expected in BAD[world].items():
            assert expected in texts[case], (case, texts[case])


@pytest.mark.parametrize(("world", "replicas"), [(2, 1), (4, 2)])
def test_dcp_save_kill_load_continue_matches_an_uninterrupted_run(tmp_path, world, replicas):
    folder = str(tmp_path / "ckpt")
    uninterrupted = run_gloo(world, dcp_run, replicas, folder, 3, 6, False)
    resumed = run_gloo(world, dcp_run, replicas, folder, 3, 6, True)  # fresh processes
    for whole, again in zip(uninterrupted, resumed, strict=True):
        assert again["steps"] == whole["steps"] == 6
        for a, b in zip(whole["local"] + whole["deltas"], again["local"] + again["deltas"], strict=True):
            assert torch.equal(a, b)
