"""The network testbed (cokit.bench.netbed): DeMo over shaped, lossy and cut links gives the
parameters of loopback, the rate limit is real, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from cokit.bench import netbed
from cokit.compress import DeMo
from tests.helpers import byte_counts

STEPS, STEP_SLEEP_S = 6, 0.4
slow_distributed = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def namespaces():
    ok, why = netbed.available()
    if not ok:
        pytest.skip(f"network namespaces are not permitted here: {why}")


def _ours() -> list[str]:
    """Namespaces this test process made that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"cokit-{os.getpid()}-")]


class _Net(torch.nn.Module):
    """~130k parameters: a dense full sync is 0.5 MB, enough to fill a 10 Mbit/s queue."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 1024)
        self.b = torch.nn.Linear(1024, 64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(rank: int, world: int, steps: int, sleep_s: float):
    """DeMo from a fixed start; sleeps (computes nothing) per step so training outlasts the
    partition's start. Returns the parameters and the wall-clock end of training."""
    os.environ["TRITON_INTERPRET"] = "0"  # torch path: fast, same results
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 64, generator=g)
    y = torch.sin(x)
    opt = DeMo(model.parameters(), lr=3e-3, compression_topk=8, full_sync_every=2, timeout=120.0)
    netbed.training_started()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(sleep_s)
        opt.step()
    return (
        [p.detach().clone() for p in model.parameters()],
        time.time(),
        byte_counts(opt.comm_stats.as_dict()),
    )


@pytest.fixture(scope="module")
def loopback_result():
    with netbed.Testbed("loopback", world_size=2) as bed:
        return bed.spawn(_train, STEPS, STEP_SLEEP_S, timeout=300)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and len(a) == len(b)


def _assert_like_loopback(results, loopback_result) -> None:
    """Every rank ends with loopback's parameters (bitwise) and byte counts."""
    for rank, ((params, _, comm), (ref, _, ref_comm)) in enumerate(
        zip(results, loopback_result, strict=True)
    ):
        assert _same(params, ref), f"rank {rank}: parameters differ from loopback"
        assert comm == ref_comm


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.usefixtures("namespaces")
def test_lossy_10mbit_link_gives_loopback_parameters(loopback_result):
    with netbed.Testbed("10mbit-drops", world_size=2) as bed:
        results = bed.spawn(_train, STEPS, STEP_SLEEP_S, timeout=300)
        stats = bed.stats
    assert _ours() == []
    _assert_like_loopback(results, loopback_result)
    # The traffic went through the shaped links (both ends), and the small queue dropped packets.
    assert len(stats) == 2
    assert min(s["bytes"] for s in stats.values()) >= loopback_result[0][2]["total_sent_bytes"]
    assert sum(s["drops"] for s in stats.values()) > 0, stats


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.usefixtures("namespaces")
def test_partition_stalls_training_and_changes_nothing(loopback_result):
    with netbed.Testbed("partition-5s", world_size=2) as bed:
        results = bed.spawn(_train, STEPS, STEP_SLEEP_S, timeout=300)
        partitions = bed.partitions
    assert _ours() == []
    _assert_like_loopback(results, loopback_result)
    ((signalled, down, up),) = partitions
    p = netbed.PROFILES["partition-5s"].partition
    assert down - signalled >= p.at_s - 0.05 and up - down >= p.for_s - 0.05
    # Training was still running when the links came back: the partition stalled it.
    assert max(end for _, end, _ in results) > up


def _allgather_seconds(rank: int, world: int, nbytes: int) -> float:
    import torch.distributed as dist

    dist.all_gather_single(torch.empty(world * 8), torch.zeros(8))  # connections warm
    chunk = torch.full((nbytes // 4,), float(rank))
    out = torch.empty(world * chunk.numel())
    dist.barrier()
    start = time.perf_counter()
    dist.all_gather_single(out, chunk)
    seconds = time.perf_counter() - start
    assert torch.equal(out.view(world, -1)[:, 0], torch.arange(world, dtype=out.dtype))
    return seconds


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.usefixtures("namespaces")
@pytest.mark.parametrize("world, nbytes", [(2, 2 * 2**20), (3, 2**20)])
def test_rate_limit_is_real(world, nbytes):
    """Every rank must receive (world - 1) * nbytes through its 10 Mbit/s downlink, which
    no schedule can do faster than the rate allows (less the bucket it starts with)."""
    with netbed.Testbed("loopback", world_size=world) as bed:
        fast = bed.spawn(_allgather_seconds, nbytes, timeout=120)
    profile = netbed.PROFILES["10mbit"]
    with netbed.Testbed(profile, world_size=world) as bed:
        shaped = bed.spawn(_allgather_seconds, nbytes, timeout=120)
        assert len(bed.links) == (2 if world == 2 else 2 * world)  # veth pair, or ports on a bridge
    assert _ours() == []
    floor = ((world - 1) * nbytes - profile.burst_bytes) * 8 / profile.rate_bps
    print(
        f"world {world}: {nbytes} B all-gather: loopback {max(fast):.3f} s, 10mbit {min(shaped):.3f} s "
        f"(physics floor {floor:.2f} s)"
    )
    assert min(shaped) >= floor


@pytest.mark.usefixtures("namespaces")
def test_everything_is_removed_on_errors_and_stale_namespaces_go():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"cokit-{dead.pid}-0-r0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with pytest.raises(KeyboardInterrupt), netbed.Testbed("10mbit", world_size=3) as bed:
        names = set(bed.rank_namespaces) | {bed.hub_namespace}
        assert names <= set(_ours()) and len(names) == 4
        assert stale not in netbed._netns_names()  # a dead pid's namespace is cleaned
        raise KeyboardInterrupt  # as Ctrl-C would
    assert _ours() == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.usefixtures("namespaces")
def test_partition_without_signal_is_an_error():
    profile = netbed.LinkProfile("cut", partition=netbed.Partition(at_s=0.0, for_s=0.5))
    with netbed.Testbed(profile, world_size=2) as bed, pytest.raises(RuntimeError, match="training_started"):
        bed.spawn(_rank_only, timeout=120)
    assert _ours() == []


def _rank_only(rank: int, world: int) -> int:
    return rank


def test_profiles_and_bad_input():
    assert set(netbed.PROFILES) == {
        "loopback",
        "100mbit",
        "10mbit",
        "10mbit-drops",
        "latency-50ms-sim",
        "partition-5s",
    }
    assert not netbed.PROFILES["loopback"].namespaces and not netbed.PROFILES["latency-50ms-sim"].namespaces
    assert netbed.PROFILES["10mbit"].rate_bps == 10e6
    assert "simulated" in netbed.PROFILES["latency-50ms-sim"].describe()
    assert "simulated" not in netbed.PROFILES["10mbit-drops"].describe()
    with pytest.raises(ValueError, match="choose one of: loopback"):
        netbed.get_profile("1mbit")
    with pytest.raises(ValueError, match="rate must be like '10mbit'"):
        netbed.LinkProfile("x", rate="10 Mbps")
    with pytest.raises(ValueError, match="limit_bytes must be an integer >= 1600"):
        netbed.LinkProfile("x", rate="1mbit", limit_bytes=100)
    with pytest.raises(ValueError, match="for_s > 0"):
        netbed.Partition(1.0, 0.0)
    with pytest.raises(ValueError, match="world_size must be an integer from 2"):
        netbed.Testbed("loopback", world_size=1)
    with pytest.raises(RuntimeError, match="inside `with Testbed"):
        netbed.Testbed("loopback").spawn(_rank_only)
    assert netbed.apply_simulated_latency(object()) is None  # outside a testbed: nothing to do
