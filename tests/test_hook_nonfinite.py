"""The DDP hook with a non-finite gradient on one rank, empty parameters, bad settings: every rank
must take the same path, or the next collectives pair wrongly.

The 2-rank scenarios share one spawned world (tests/gloo_cases.py, fixture ``world2``).
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_gloo
from gloo_cases import Case, run_cases
from helpers import AGREEMENT_ROW, byte_counts

from cokit.compress.hooks import DCTTopKState, dct_topk_hook

STEPS, BAD_STEP = 6, 3


class _Net(torch.nn.Module):
    def __init__(self, empty: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(24, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.b = torch.nn.Linear(64, 1)
        self.empty = torch.nn.Parameter(torch.zeros(0, 5)) if empty else None

    def forward(self, x):
        out = self.b(torch.relu(self.norm(self.a(x))))
        return out if self.empty is None else out + self.empty.sum()


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 24, generator=g)
    return x, x[:, :1] * 2


def _ddp(nonfinite: str, empty: bool = False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    # find_unused_parameters keeps DDP's small buckets when it rebuilds them: two buckets here
    net = DDP(_Net(empty), bucket_cap_mb=0.004, find_unused_parameters=True)
    state = DCTTopKState(topk=8, chunk=16, warmup_steps=1, nonfinite=nonfinite)
    net.register_comm_hook(state, dct_topk_hook)
    return net, state


def _buffers(state: DCTTopKState) -> list[torch.Tensor]:
    return [d.clone() for _, layout in sorted(state._layouts.items()) for d in layout.deltas]


def _train(rank: int, world: int, nonfinite: str, inject: bool, leave_out: bool):
    """SGD with GradScaler (scale pinned to 1: the same arithmetic as without it). With
    ``inject``, rank 1's step BAD_STEP gets an inf in the first weight's gradient only (a
    compressed tensor, alone in its DDP bucket);
    with ``leave_out`` that step does not happen at all, on any rank."""
    os.environ["TRITON_INTERPRET"] = "0"
    x, y = _data(rank)
    net, state = _ddp(nonfinite)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    out: dict = {"finite_grads": [], "errors": []}
    for step in range(STEPS):
        if leave_out and step == BAD_STEP:
            continue
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        poison = float("inf") if inject and rank == 1 and step == BAD_STEP else 0.0
        loss = loss + poison * net.module.a.weight.sum()  # adds exactly 0 on the other steps
        before = _buffers(state)
        try:
            scaler.scale(loss).backward()
        except RuntimeError as exc:
            out["errors"].append(str(exc))
        out["finite_grads"].append(all(torch.isfinite(p.grad).all() for p in net.parameters()))
        if step == BAD_STEP:
            out["buffers_unchanged"] = all(
                torch.equal(a, b) for a, b in zip(before, _buffers(state), strict=True)
            )
        if not out["errors"] or step != BAD_STEP:
            scaler.step(opt)
            scaler.update(1.0)
    out["params"] = [p.detach().clone() for p in net.parameters()]
    out["buffers"] = _buffers(state)
    out["skipped"] = state.skipped_steps
    out["n_buckets"] = len(state._layouts)
    return out


def _empty_param(rank: int, world: int):
    os.environ["TRITON_INTERPRET"] = "0"
    x, y = _data(rank)
    out = []
    for empty in (False, True):
        net, state = _ddp("error", empty)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        params = [p.detach().clone() for n, p in net.module.named_parameters() if n != "empty"]
        out.append((params, state.comm_stats.total_sent_bytes))
    return out


@pytest.fixture(scope="module")
def world2() -> dict[str, list]:
    """The 2-rank scenarios in one world; the one that raises on purpose goes last."""
    return run_cases(
        2,
        [
            Case("skip", _train, ("skip", True, False)),
            Case("without the step", _train, ("skip", False, True)),
            Case("empty", _empty_param),
            Case("error", _train, ("error", True, False)),
        ],
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_skip_one_rank_inf_leaves_every_buffer_and_equals_a_run_without_that_step(world2):
    bad, reference = world2["skip"], world2["without the step"]
    for rank, r in enumerate(bad):
        assert r["n_buckets"] == 2  # the bad weight is in one bucket: the other one is dropped too
        assert r["finite_grads"] == [step != BAD_STEP for step in range(STEPS)]  # NaN on every rank
        assert r["buffers_unchanged"] and r["skipped"] == 1 and not r["errors"]
        assert all(torch.isfinite(b).all() for b in r["buffers"])
        for a, b in zip(r["params"], bad[0]["params"], strict=True):
            assert torch.equal(a, b)  # ranks bit-identical
        for a, b in zip(r["buffers"], reference[rank]["buffers"], strict=True):
            assert torch.equal(a, b)  # every rank's error buffers as if the step never happened
        for a, b in zip(r["params"], reference[0]["params"], strict=True):
            assert torch.equal(a, b)  # GradScaler skipped the step on every rank


@pytest.mark.distributed
@pytest.mark.slow
def test_error_one_rank_inf_raises_on_every_rank_and_changes_no_buffer(world2):
    results = world2["error"]
    for r in results:
        assert len(r["errors"]) == 1, r["errors"]  # raised from backward() on every rank
        message = r["errors"][0]
        assert "FloatingPointError: DCTTopKState: non-finite gradient in DDP bucket 1 on rank 1" in message
        assert "no error buffer changed" in message
        assert r["buffers_unchanged"] and r["skipped"] == 0
        assert all(r["finite_grads"][BAD_STEP + 1 :])  # training goes on after the error
        assert all(torch.isfinite(b).all() for b in r["buffers"])
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.distributed
@pytest.mark.slow
def test_an_empty_parameter_in_a_hook_bucket_sends_nothing(world2):
    for plain, with_empty in world2["empty"]:
        assert all(torch.equal(a, b) for a, b in zip(plain[0], with_empty[0], strict=True))
        assert with_empty[1] == plain[1]


def _flag_bytes(rank: int, world: int):
    """One bucket, everything dense (every coefficient in fp32 is more than the dense all-reduce):
    the bytes are the all-reduce of the gradients and the flags."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["TRITON_INTERPRET"] = "0"
    net = DDP(torch.nn.Linear(5, 3))  # 18 values
    state = DCTTopKState(topk=4096, chunk=8, value_dtype=torch.float32)
    net.register_comm_hook(state, dct_topk_hook)
    net(torch.ones(2, 5)).sum().backward()
    return byte_counts(state.comm_stats.as_dict())


@pytest.mark.distributed
@pytest.mark.slow
def test_the_nonfinite_flags_ride_in_the_dense_all_reduce():
    world = 3
    for stats in run_gloo(world, _flag_bytes):
        # the iteration's status row, then a ring all-reduce of (18 gradients + 3 flags) fp32
        # values; dense baseline: 18 values
        assert (
            stats["step_sent_bytes"]
            == (world - 1) * AGREEMENT_ROW + 2 * (world - 1) * (18 + world) * 4 // world
        )
        assert stats["step_dense_bytes"] == 2 * (world - 1) * 18 * 4 // world


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"decay": True}, ValueError, r"decay must be a finite number in \[0.0, 1.0\]"),
        ({"process_group": "x"}, TypeError, "process_group must be None .* ProcessGroup"),
        ({"warmup_steps": True}, ValueError, "warmup_steps must be an integer >= 0"),
        ({"iteration": -1}, ValueError, "iteration must be an integer >= 0"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of 'error', 'skip'"),
        ({"topk": True}, ValueError, "topk must be an integer >= 1"),
        ({"timeout": 0}, ValueError, "timeout must be > 0"),
        ({"validate_payload": 1}, TypeError, "validate_payload must be True or False"),
    ],
)
def test_bad_hook_settings_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        DCTTopKState(**kwargs)
