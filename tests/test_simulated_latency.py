"""Simulated latency (cokit.compress.simulate) on real gloo groups over loopback: it delays
collectives by seeded draws and changes no parameter and no byte count."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_gloo
from helpers import byte_counts

from cokit.bench.netbed import Testbed, apply_simulated_latency
from cokit.compress import DeMo
from cokit.compress.comm import Communicator
from cokit.compress.simulate import LatencyModel, SimulatedLatencyCommunicator, simulate_latency

MEAN_MS, JITTER_MS = 50.0, 20.0


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 130)
        self.b = torch.nn.Linear(130, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(rank: int, steps: int, latency: tuple[float, float, int] | None, overlap: bool = False, env=False):
    """DeMo steps from a fixed start; returns (params, stats, delays, added_s)."""
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 24, generator=g)
    y = x.sum(1, keepdim=True)
    opt = DeMo(model.parameters(), lr=3e-3, compression_topk=8, full_sync_every=2, overlap_backward=overlap)
    comm = None
    if env:
        comm = apply_simulated_latency(opt)
    elif latency is not None:
        comm = simulate_latency(opt, *latency)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    delays = None if comm is None else list(comm.delays)
    added = None if comm is None else comm.added_s
    return params, byte_counts(opt.comm_stats.as_dict()), delays, added


def _runs(rank: int, world: int, steps: int):
    os.environ["TRITON_INTERPRET"] = "0"  # torch path: fast, same results
    return {
        "plain": _train(rank, steps, None),
        "seed0": _train(rank, steps, (MEAN_MS, JITTER_MS, 0)),
        "seed0_again": _train(rank, steps, (MEAN_MS, JITTER_MS, 0)),
        "seed1": _train(rank, steps, (MEAN_MS, JITTER_MS, 1)),
        "overlap_plain": _train(rank, steps, None, overlap=True),
        "overlap_seed0": _train(rank, steps, (MEAN_MS, JITTER_MS, 0), overlap=True),
    }


@pytest.mark.distributed
def test_simulated_latency_changes_nothing_but_time():
    results = run_gloo(2, _runs, 4, timeout=300)
    model = LatencyModel(MEAN_MS, JITTER_MS, 0)
    low, high = model.bounds_s
    for rank, runs in enumerate(results):
        params, stats, _, _ = runs["plain"]
        for name in ("seed0", "seed0_again", "seed1"):
            other, other_stats, delays, added = runs[name]
            assert all(torch.equal(a, b) for a, b in zip(params, other, strict=True)), (
                f"rank {rank}: {name} changed params"
            )
            assert other_stats == stats, f"rank {rank}: {name} changed byte counts"
            # every step's collectives were delayed: layout check, status, buckets, full syncs
            assert len(delays) >= 4 * 2
            assert all(low <= d <= high for d in delays), delays
            assert 0 < added <= sum(delays) + 1e-6
        op, op_stats, _, _ = runs["overlap_plain"]
        lat, lat_stats, _, _ = runs["overlap_seed0"]
        assert all(torch.equal(a, b) for a, b in zip(op, lat, strict=True)) and lat_stats == op_stats
        delays0 = runs["seed0"][2]
        assert runs["seed0_again"][2] == delays0  # same seed, same delays
        assert runs["seed1"][2] != delays0
        assert delays0 == model.draws(rank, len(delays0))  # what the seed says, in order
    assert results[0]["seed0"][2] != results[1]["seed0"][2]  # independent per rank
    assert torch.equal(results[0]["plain"][0][0], results[1]["plain"][0][0])  # ranks agree


def _testbed_run(rank: int, world: int, steps: int):
    os.environ["TRITON_INTERPRET"] = "0"
    return _train(rank, steps, None, env=True), _train(rank, steps, None)


@pytest.mark.distributed
def test_latency_profile_applies_through_the_testbed():
    with Testbed("latency-50ms-sim", world_size=2) as bed:
        assert "simulated" in bed.profile.describe()
        results = bed.spawn(_testbed_run, 3, timeout=300)
    for with_latency, plain in results:
        assert all(torch.equal(a, b) for a, b in zip(with_latency[0], plain[0], strict=True))
        assert with_latency[1] == plain[1]
        assert with_latency[2] and 0 < with_latency[3] <= sum(with_latency[2]) + 1e-6
        assert plain[2] is None  # outside the latency run, nothing is wrapped


def test_latency_model_draws_are_seeded_and_bounded():
    m = LatencyModel(10.0, 30.0, seed=3)
    assert m.bounds_s == (0.0, 0.04)  # clipped at 0
    a = m.draws(0, 200)
    assert a == LatencyModel(10.0, 30.0, seed=3).draws(0, 200)
    assert a != m.draws(1, 200) and a != LatencyModel(10.0, 30.0, seed=4).draws(0, 200)
    assert min(a) == 0.0 and max(a) <= 0.04
    assert all(d == 0.005 for d in LatencyModel(5.0).draws(0, 5))
    assert "simulated" in m.describe()


def test_no_process_group_adds_no_delay():
    opt = DeMo([torch.nn.Parameter(torch.randn(8, 8))], lr=0.01)
    comm = simulate_latency(opt, 200.0, 0.0, seed=0)
    assert opt.comm is comm and comm.label == "simulated" and comm.owner == "DeMo.step"
    opt.param_groups[0]["params"][0].grad = torch.randn(8, 8)
    opt.step()
    assert comm.delays == [] and comm.added_s == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mean_ms": -1.0}, "mean_ms must be >= 0"),
        ({"mean_ms": float("nan")}, "finite"),
        ({"mean_ms": 5.0, "jitter_ms": -2.0}, "jitter_ms must be >= 0"),
        ({"mean_ms": 5.0, "seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_latency_is_refused(kwargs, match):
    opt = DeMo([torch.nn.Parameter(torch.randn(4))], lr=0.01)
    before = opt.comm
    with pytest.raises(ValueError, match=match):
        simulate_latency(opt, **kwargs)
    assert opt.comm is before  # nothing changed


def test_wrapping_needs_a_communicator_and_happens_once():
    with pytest.raises(TypeError, match="needs an object with a cokit Communicator"):
        simulate_latency(object(), 5.0)
    opt = DeMo([torch.nn.Parameter(torch.randn(4))], lr=0.01)
    first = simulate_latency(opt, 5.0)
    with pytest.raises(ValueError, match="already simulates latency"):
        simulate_latency(opt, 5.0)
    assert opt.comm is first
    assert isinstance(first, Communicator) and isinstance(first, SimulatedLatencyCommunicator)
