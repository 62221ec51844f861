"""More membership changes of SparseLoCo on torchft: a late joiner, a partition, two deaths.

One scenario (a module fixture) on the network testbed (cokit.bench.netbed): three network
namespaces joined by veth pairs to a bridge, the lighthouse in the bridge's namespace, one
replica group (tests/ft_worker.py) per namespace, each with its own address and host name:

1. replicas 0 and 1 train; replica 2 joins late: it is healed and, after its first round, all
   three hold the same bytes;
2. replica 2's link goes down in the middle of a period: 0 and 1 go on without it within the
   timeouts; the link comes back: replica 2 rejoins, is healed and is bit-identical again;
3. replica 2 is SIGKILLed, 0 and 1 go on; then replica 1 is SIGKILLed: replica 0, alone with a
   minimum quorum of 2, waits in its next quorum; replica 1 restarts (a process started ahead,
   waiting, so that it joins at once): both go on, bit-identical.

A lone replica's two outcomes, the quorum timeout's clear error (minimum quorum 2) and going
on alone (minimum 1), are tested in this process with an in-process lighthouse. Every wait is
bounded and driven by the replicas' logs, not by sleeps.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")

from torchft.coordination import LighthouseServer

from cokit.bench import netbed
from cokit.compress import SparseLoCo
from cokit.compress.ft import FaultTolerant
from cokit.compress.ft_group import QuorumGloo, replica_manager
from tests.test_ft import HEARTBEAT_MS, LIGHTHOUSE, Run, _wait

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HUB_IP = f"{netbed.SUBNET}.254"  # the bridge's address, in the hub namespace: the lighthouse's
PORT = 29510  # the lighthouse's, in a namespace of its own: no other process there
LIGHTHOUSE_ARGS = ("--min_replicas", "2", "--quorum_tick_ms", "50", "--join_timeout_ms", "1000")
LIGHTHOUSE_ARGS += ("--heartbeat_timeout_ms", str(HEARTBEAT_MS))
#: namespaces need a profile that builds them; its partition clock runs only in Testbed.spawn,
#: which this test does not use (it cuts one link itself)
PROFILE = netbed.LinkProfile("ft-cut", partition=netbed.Partition(at_s=0.0, for_s=1.0))


#: the facts printed: durations in seconds, and the rounds the survivors dropped at the cut
SHOWN = ("_heal", "_continue", "_wait", "_rounds", "startup", "seconds")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _listening(pid: int, port: int) -> bool:
    """``pid`` (in its network namespace) has a TCP socket listening on ``port``."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def _inside(bed: netbed.Testbed, rank: int) -> tuple[str, ...]:
    """Run in rank ``rank``'s namespace with its address as host name (gloo binds, and
    torchft's checkpoint server advertises, the host name's address)."""
    ns = bed.rank_namespaces[rank]
    return (
        "ip",
        "netns",
        "exec",
        ns,
        "unshare",
        "--uts",
        "sh",
        "-c",
        f'hostname {bed.address(rank)} && exec "$@"',
        "sh",
    )


def _after(rows: list[dict], t: float) -> list[dict]:
    return [r for r in rows if r["t"] > t]


@pytest.fixture(scope="module")
def testbed():
    ok, why = netbed.available()
    if not ok:
        pytest.skip(f"the partition scenario needs network namespaces: {why}")
    for tool in ("unshare", "hostname"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed: each namespaced replica needs a host name of its own")
    if not Path(LIGHTHOUSE).exists():
        pytest.skip("the torchft_lighthouse binary is missing")
    with netbed.Testbed(PROFILE, world_size=3) as bed:
        assert bed.hub_namespace is not None
        _ip("-n", bed.hub_namespace, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        yield bed


@pytest.fixture(scope="module")
def scenario(testbed: netbed.Testbed, tmp_path_factory: pytest.TempPathFactory):
    bed, hub = testbed, testbed.hub_namespace
    assert hub is not None
    folder = tmp_path_factory.mktemp("ft-netbed")
    run = Run(f"http://{HUB_IP}:{PORT}", folder)
    facts: dict[str, float] = {"started": time.time()}
    with open(folder / "lighthouse.log", "w") as out:
        lighthouse = subprocess.Popen(
            ["ip", "netns", "exec", hub, LIGHTHOUSE, *LIGHTHOUSE_ARGS, "--bind", f"{HUB_IP}:{PORT}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    go_c, go_b2 = folder / "go-c", folder / "go-b2"

    def start(name: str, rank: int, *extra: str):
        return run.start(name, rank, "--host", bed.address(rank), *extra, prefix=_inside(bed, rank))

    try:
        _wait(lambda: _listening(lighthouse.pid, PORT), "the lighthouse to listen", lighthouse)
        a, b = start("a", 0), start("b", 1)
        c = start("c", 2, "--go-file", str(go_c))
        b2 = start("b2", 1, "--go-file", str(go_b2))  # replica 1's restart, warm ahead
        live = (a, b)
        # 1. replica 2 joins late
        for n in "ab":
            _wait(lambda n=n: len(run.syncs(n, world=2)) >= 2, f"{n} to sync twice in a quorum of 2", *live)
        _wait(lambda: run.rows("c", "ready"), "replica 2 to be ready", *live, c)
        go_c.touch()
        facts["late"] = time.time()
        _wait(lambda: run.syncs("c"), "the late replica to heal and sync", *live, c)
        joined = run.syncs("c")[0]["sync"]
        facts["late_heal"] = run.syncs("c")[0]["t"] - facts["late"]
        for n in "ab":
            _wait(
                lambda n=n: [r for r in run.syncs(n) if r["sync"] == joined],
                f"{n} to log sync {joined}",
                *live,
            )
        # 2. replica 2's link goes down in the middle of a period, and comes back
        live = (a, b, c)
        _ip("-n", hub, "link", "set", "p2", "down")
        facts["cut"] = time.time()
        for n in "ab":
            _wait(lambda n=n: run.syncs(n, facts["cut"], world=2), f"{n} to sync without replica 2", *live)
        facts["cut_continue"] = max(run.syncs(n, facts["cut"], world=2)[0]["t"] for n in "ab") - facts["cut"]
        before = [r["dropped"] for r in run.syncs("a") if r["t"] < facts["cut"]][-1]
        facts["cut_dropped_rounds"] = run.syncs("a", facts["cut"])[0]["dropped"] - before
        _ip("-n", hub, "link", "set", "p2", "up")
        facts["back"] = time.time()
        _wait(
            lambda: run.syncs("c", facts["back"], world=3), "replica 2 to rejoin after the partition", *live
        )
        facts["back_heal"] = run.syncs("c", facts["back"], world=3)[0]["t"] - facts["back"]
        # 3. replica 2 dies, then replica 1; replica 0 waits alone until replica 1 restarts
        c.send_signal(signal.SIGKILL)
        c.wait(timeout=30)
        facts["kill_c"] = time.time()
        live = (a, b)
        for n in "ab":
            _wait(lambda n=n: run.syncs(n, facts["kill_c"], world=2), f"{n} to sync without replica 2", *live)
        facts["kill_c_continue"] = max(run.syncs(n, facts["kill_c"])[0]["t"] for n in "ab") - facts["kill_c"]
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=30)
        facts["kill_b"] = time.time()
        _wait(lambda: run.rows("a")[-1]["event"] == "quorum", "replica 0 to wait for a quorum", a)
        facts["alone"] = max(run.rows("a")[-1]["t"], facts["kill_b"])  # waiting since
        go_b2.touch()
        facts["restart"] = time.time()
        live = (a, b2)
        for n in ("a", "b2"):
            _wait(
                lambda n=n: run.syncs(n, facts["restart"], world=2), f"{n} to sync after the restart", *live
            )
        facts["lone_wait"] = run.syncs("a", facts["restart"])[0]["t"] - facts["alone"]
        facts["restart_heal"] = run.syncs("b2")[0]["t"] - facts["restart"]
        # everyone left stops at the same sync
        run.stop.write_text(str(max(r["sync"] for n in ("a", "b2") for r in run.syncs(n)) + 2))
        for name, p in (("a", a), ("b2", b2)):
            _wait(lambda p=p: p.poll() is not None, f"{name} to finish", *live)
        facts["seconds"] = time.time() - facts["started"]
        facts["startup"] = min(r["t"] for n in "ab" for r in run.rows(n, "start")) - facts["started"]
        shown = {k: round(v, 2) for k, v in facts.items() if k.endswith(SHOWN)}
        print(f"\nft netbed scenario (seconds): {json.dumps(shown)}; load average {os.getloadavg()}")
        yield run, facts
    finally:
        run.kill_all()
        lighthouse.kill()
        lighthouse.wait(timeout=30)


def _same_bytes_as(run: Run, name: str, others: tuple[str, ...]) -> int:
    """Assert that after every sync ``name`` committed, ``others`` logged the same weights;
    the number of syncs compared."""
    mine = run.syncs(name)
    for row in mine:
        theirs = {r["weights"] for n in others for r in run.syncs(n) if r["sync"] == row["sync"]}
        assert theirs == {row["weights"]}, (name, row["sync"])
    return len(mine)


def test_a_late_joiner_is_healed_and_bit_identical_after_its_first_round(scenario) -> None:
    run, facts = scenario
    first = run.syncs("c")[0]
    assert first["heals"] == 1 and first["world"] == 3 and first["t"] > facts["late"], first
    assert first["sync"] > 2  # the others had synced without it
    assert _same_bytes_as(run, "c", ("a", "b")) >= 2


def test_a_partitioned_replica_is_left_behind_then_rejoins_and_heals(scenario) -> None:
    run, facts = scenario
    codes = {name: p.returncode for name, p in run.procs}
    assert codes["c"] == -signal.SIGKILL, codes  # it lived through the partition until killed
    assert not run.rows("c", "error"), run.rows("c", "error")
    # the survivors went on within the timeouts, without a dropped-round hang or an abort
    assert facts["cut_continue"] < 30, facts
    cut = [r["sync"] for r in run.syncs("a", facts["cut"]) if r["t"] < facts["back"]]
    assert cut and not [r for r in run.syncs("c") if facts["cut"] < r["t"] < facts["back"]]
    # back: healed a second time, and identical to the others after every sync
    back = run.syncs("c", facts["back"], world=3)[0]
    assert back["heals"] == 2 and back["sync"] > max(cut), (back, cut)
    _same_bytes_as(run, "c", ("a", "b"))


def test_two_replicas_die_one_after_the_other_and_the_survivor_waits_for_a_restart(scenario) -> None:
    run, facts = scenario
    codes = {name: p.returncode for name, p in run.procs}
    assert codes["a"] == 0 and codes["b2"] == 0 and codes["b"] == -signal.SIGKILL, codes
    # alone with a minimum quorum of 2, replica 0 committed nothing until replica 1 was back
    assert not [r for r in run.syncs("a") if facts["kill_b"] < r["t"] < facts["restart"]]
    assert not _after(run.rows("a", "error"), 0.0)
    restarted = run.syncs("b2")[0]
    assert restarted["heals"] == 1 and restarted["world"] == 2, restarted
    assert _same_bytes_as(run, "b2", ("a",)) >= 2
    assert run.syncs("a")[-1]["weights"] == run.syncs("b2")[-1]["weights"]


# ----------------------------------------------------------------------------- a lone replica


def _lone_replica(min_replicas: int, quorum_timeout_s: float, steps: int) -> tuple[FaultTolerant, float]:
    """One replica group in this process, with an in-process lighthouse that needs
    ``min_replicas``: it runs ``steps`` steps (syncs every 2nd); (its optimizer, seconds)."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=100, quorum_tick_ms=20
    )
    timeout = datetime.timedelta(seconds=5)
    group = QuorumGloo(timeout=timeout)
    manager, _store = replica_manager(
        group,
        lighthouse.address(),
        "replica_0",
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s),
        min_replicas=min_replicas,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ft = FaultTolerant(manager, SparseLoCo(model.parameters(), sync_every=2, topk=2, chunk=2), group)
    start = time.monotonic()
    try:
        for _ in range(steps):
            ft.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            ft.step()
    finally:
        seconds = time.monotonic() - start
        manager.shutdown(wait=False)
        lighthouse.shutdown()
    return ft, seconds


def test_a_lone_replica_with_a_minimum_quorum_of_2_stops_with_a_clear_error_at_the_quorum_timeout() -> None:
    # what replica 0 above would have done had replica 1 not come back within its quorum timeout
    started = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"no quorum of 2 replicas formed within 1 s .*Restart the missing"
    ):
        _lone_replica(2, 1.0, steps=2)  # the quorum is taken at the sync step, the 2nd
    assert time.monotonic() - started < 30


def test_a_lone_replica_goes_on_alone_with_a_minimum_quorum_of_1() -> None:
    ft, _ = _lone_replica(1, 1.0, steps=4)
    assert ft.rounds == 2 and ft.dropped_rounds == 0
    assert ft.quorum is not None and ft.quorum.world_size == 1
