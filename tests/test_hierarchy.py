"""The two-level exchange (``DeMo(hierarchy=node_groups())``) on real gloo groups.

World 4 as 2 nodes x 2 ranks: a dense average inside each node, then compressed payloads
between the ranks that share a local rank. The reference is a plain DeMo over the same
cross-node group whose gradients are the node's mean, computed batch by batch. Every
scenario runs in one 4-rank world (tests/gloo_cases.py): one start-up for the module.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_cases import Case, run_cases
from helpers import AGREEMENT_ROW, STATUS_ROW

from cokit.compress import DeMo
from cokit.compress.groups import NodeGroups, node_groups
from cokit.compress.stats import ring_allreduce_bytes

SETTINGS = dict(lr=1e-2, compression_topk=4, compression_chunk=4, compression_decay=0.9)
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 12, generator=g)
    return torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :5]))


def _train(rank: int, world: int, per_node: int, nan_rank: int | None = None):
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these tests check the distributed logic
    groups = node_groups(local_world_size=per_node)
    model, ref = _model(), _model()
    opt = DeMo(model.parameters(), hierarchy=groups, nonfinite="skip", **SETTINGS)
    ref_opt = DeMo(ref.parameters(), process_group=groups.inter, nonfinite="skip", **SETTINGS)
    node = groups.intra_ranks
    for step in range(STEPS):
        _loss(model, rank, step).backward()
        if nan_rank == rank and step == 2:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        grads = None
        for q in node:  # the node's mean gradient, batch by batch
            ref.zero_grad()
            _loss(ref, q, step).backward()
            g = [p.grad.clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        if nan_rank is not None and nan_rank in node and step == 2:
            grads[0][0, 0] = float("nan")
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g / len(node)
        ref_opt.step()
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ref": [p.detach().clone() for p in ref.parameters()],
        "stats": opt.comm_stats.as_dict(),
        "ref_stats": ref_opt.comm_stats.as_dict(),
        "skipped": opt.skipped_steps,
        "grad_bytes": grad_bytes,
    }


def _all_bad_groups(rank: int, world: int) -> dict[str, str]:
    return {case: _bad_groups(rank, world, case) for case in BAD}


@pytest.fixture(scope="module")
def world4() -> dict[str, list]:
    """Every scenario of this module, in one world of 4 ranks (2 nodes x 2)."""
    cases = [
        Case("plain", _train, (2,)),
        Case("nan on rank 1", _train, (2, 1)),
        Case("bad groups", _all_bad_groups),
    ]
    return run_cases(4, cases)


def test_two_nodes_of_two_match_the_node_mean_reference_and_stay_identical(world4):
    results = world4["plain"]
    first = results[0]["params"]
    for out in results:
        for got, want, rank0 in zip(out["params"], out["ref"], first, strict=True):
            assert torch.equal(got, want)
            assert torch.equal(got, rank0)
        stats = out["stats"]
        assert stats["group_size"] == 2 and stats["intra_group_size"] == 2 and stats["world_size"] == 4
        # intra-node: the dense average of every gradient (one ring all-reduce per bucket),
        # the status agreement (one row) and each owner's broadcast of its bucket's
        # parameters (every rank counts the bytes it forwards)
        expected_intra = ring_allreduce_bytes(out["grad_bytes"], 2) + AGREEMENT_ROW + out["grad_bytes"]
        assert stats["step_intra_sent_bytes"] == expected_intra
    # inter-node: the ranks of a node split the buckets, so together they send what the plain
    # DeMo over the cross-node group sends, plus one status exchange each
    for node in ((0, 1), (2, 3)):
        inter = [
            results[r]["stats"]["step_sent_bytes"] - results[r]["stats"]["step_intra_sent_bytes"]
            for r in node
        ]
        assert all(i > STATUS_ROW for i in inter), inter  # both local ranks own a bucket
        assert sum(inter) == results[node[0]]["ref_stats"]["step_sent_bytes"] + STATUS_ROW
        # the dense baseline spans the whole world
        assert stats["step_dense_bytes"] == ring_allreduce_bytes(out["grad_bytes"], 4)


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_node(world4):
    results = world4["nan on rank 1"]
    for out in results:
        assert out["skipped"] == 1
        for got, want in zip(out["params"], out["ref"], strict=True):
            assert torch.equal(got, want)


def _bad_groups(rank: int, world: int, case: str) -> str:
    os.environ["TRITON_INTERPRET"] = "0"  # the torch path: these tests check the distributed logic
    try:
        if case == "indivisible":
            node_groups(local_world_size=3)
        elif case == "no env":
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            node_groups()
        elif case == "overlapping":
            intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
            NodeGroups(intra, dist.new_group(list(range(world))))
        elif case == "uneven":
            intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
            inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1], [3]])
            model = _model()
            opt = DeMo(model.parameters(), hierarchy=NodeGroups(intra, inter))
            before = [p.detach().clone() for p in model.parameters()]
            _loss(model, rank, 0).backward()
            try:
                opt.step()
            finally:
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        elif case == "measuring policy":
            DeMo(_model().parameters(), hierarchy=node_groups(2), policy="bandwidth")
        elif case == "with process_group":
            DeMo(_model().parameters(), hierarchy=node_groups(2), process_group=dist.group.WORLD)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


BAD = {
    "indivisible": "3 ranks per node does not tile the world of 4 ranks",
    "no env": "LOCAL_WORLD_SIZE is not set",
    "overlapping": "may share only this rank",
    "uneven": "the node groups do not tile the world of 4 ranks",
    "with process_group": "pass either process_group= or hierarchy=",
    "measuring policy": "the ranks of a node could decide differently",
}


def test_node_groups_that_do_not_tile_the_world_are_refused(world4):
    for texts in world4["bad groups"]:
        for case, expected in BAD.items():
            assert expected in texts[case], (case, texts[case])
