"""DeMo on FSDP2 and HSDP (DTensor parameters) over real gloo groups.

The reference (tests/fsdp_workers.py) is a plain DeMo stepping the same shard slices with
the gradients FSDP would reduce-scatter; DeMo on the DTensor shards must match it exactly.
The scenarios of one world size share one spawned world (tests/gloo_cases.py); the DCP
resume runs in a second one: fresh processes.
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp_workers import bad_setups, dcp_run, nonfinite_shard, train_and_reference
from tests.gloo_cases import Case, run_cases
from tests.helpers import AGREEMENT_ROW, STATUS_ROW

pytest.importorskip("torch.distributed.fsdp")

STEPS = 8
DCP = dict(save_at=3, steps=6)
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
WORLDS = {2: 1, 4: 2}  # world size: replicas (FSDP2 on 2 ranks, HSDP 2 x 2)


def _dcp(replicas: int, folder: str, resume: bool) -> Case:
    return Case(
        "resumed" if resume else "dcp", dcp_run, (replicas, folder, DCP["save_at"], DCP["steps"], resume)
    )


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, dict[str, list]]:
    """Each world size's scenarios in one world, then the DCP resume in fresh processes. The
    error-mode non-finite case goes last: it raises on purpose."""
    out = {}
    for world, replicas in WORLDS.items():
        folder = str(tmp_path_factory.mktemp(f"dcp{world}") / "ckpt")
        cases = [Case("train", train_and_reference, (replicas, STEPS)), _dcp(replicas, folder, False)]
        cases.append(Case("bad", bad_setups, (list(BAD[world]),)))
        if world == 2:
            cases += [Case(f"nonfinite {mode}", nonfinite_shard, (mode,)) for mode in ("skip", "error")]
        out[world] = run_cases(world, cases)
        out[world].update(run_cases(world, [_dcp(replicas, folder, True)]))  # fresh processes
    return out


def _exact(results) -> None:
    for out in results:
        for got, want in zip(out["local"], out["expected"], strict=True):
            assert torch.equal(got, want), f"rank {out['rank']}: max diff {(got - want).abs().max()}"


def test_fsdp2_matches_demo_on_the_shards(worlds):
    results = worlds[2]["train"]
    _exact(results)
    shapes = [[tuple(t.shape) for t in out["local"]] for out in results]
    assert shapes[0] != shapes[1], "uneven shards expected (7 and 5 rows over 2 ranks)"
    for out in results:
        assert out["losses"][-1] < out["losses"][0]
        stats = out["stats"]
        # nothing is exchanged over the mesh but the status agreement: one row from the other
        # rank (ring all-gather), every step
        assert stats["step_intra_sent_bytes"] == AGREEMENT_ROW == stats["step_sent_bytes"]
        assert stats["group_size"] == 1 and stats["intra_group_size"] == 2


def test_hsdp_2x2_matches_reference_and_replicas_are_identical(worlds):
    results = worlds[4]["train"]
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
        assert intra == AGREEMENT_ROW  # shard-group status agreement
        assert total - intra > STATUS_ROW  # the replicate exchange carries payloads too
        assert stats["total_intra_sent_bytes"] == STEPS * intra  # the rows carry the layout check


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_a_nonfinite_shard_on_one_rank_stops_every_rank(worlds, mode):
    results = worlds[2][f"nonfinite {mode}"]
    for out in results:
        assert out["unchanged"]
        if mode == "skip":
            assert out["error"] is None and out["skipped"] == 1
        else:
            assert out["error"] is not None and "on rank 1" in out["error"]


@pytest.mark.parametrize("world", sorted(BAD))
def test_bad_fsdp_setups_are_refused(worlds, world):
    for texts in worlds[world]["bad"]:
        for case, expected in BAD[world].items():
            assert expected in texts[case], (case, texts[case])


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_dcp_save_kill_load_continue_matches_an_uninterrupted_run(worlds, world):
    uninterrupted, resumed = worlds[world]["dcp"], worlds[world]["resumed"]
    for whole, again in zip(uninterrupted, resumed, strict=True):
        assert again["steps"] == whole["steps"] == DCP["steps"]
        for a, b in zip(whole["local"] + whole["deltas"], again["local"] + again["deltas"], strict=True):
            assert torch.equal(a, b)
