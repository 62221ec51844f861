"""The launcher's one-host spawns listen on loopback only (docs/design.md §0, the launcher).

torch's TCP store listens on every interface whatever ``MASTER_ADDR`` says, and gloo binds its
pair sockets to the address of the host name unless told an interface: a spawned world must
do neither. The check reads this process's listening TCP sockets from /proc inside each rank.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import sys
import tempfile

import pytest

from cokit import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} addresses: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of this process in the LISTEN state."""
    mine = _socket_inodes()
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)  # header
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in mine:  # TCP_LISTEN
                    host, port = local.split(":")
                    out.append((str(_address(host)), int(port, 16)))
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _listening(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)  # the pairs are connected and used
    return {
        "sum": float(t[0]),
        "listening": listening_sockets(),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "master": (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")),
    }


def test_listening_sockets_reads_a_socket_of_this_process():
    """The /proc reader itself: a socket listening on 0.0.0.0 here is seen, and not loopback."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("0.0.0.0", port) in listening_sockets() and not _is_loopback("0.0.0.0")
    assert ("0.0.0.0", port) not in listening_sockets()


@pytest.mark.distributed
def test_one_host_spawn_listens_on_loopback_only(monkeypatch, tmp_path):
    """`cokit demo`, the study and the tests' run_gloo start their ranks this way."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where spawn's rendezvous folder goes
    monkeypatch.setenv("MASTER_PORT", "1")  # inherited, but no TCP store uses it
    results = launch.run(2, _listening)
    assert results is not None
    for rank, r in enumerate(results):
        assert r["sum"] == 2.0
        assert r["listening"], f"rank {rank}: no listening socket found (gloo listens for its pairs)"
        exposed = [(a, p) for a, p in r["listening"] if not _is_loopback(a)]
        assert not exposed, f"rank {rank} listens beyond loopback: {exposed}"
        assert r["gloo_ifname"] == launch.loopback_interface()
        assert r["master"] == ("127.0.0.1", None)
    assert os.listdir(private) == [], "the rendezvous folder was left behind"


@pytest.mark.distributed
def test_a_loopback_spawn_ignores_an_inherited_interface(monkeypatch):
    """A GLOO_SOCKET_IFNAME exported for multi-host runs does not take a one-host spawn off lo."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-that-does-not-exist")
    results = launch.spawn(2, _listening)
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert {r["gloo_ifname"] for r in results} == {launch.loopback_interface()}


@pytest.mark.distributed
def test_a_spawn_off_loopback_keeps_the_interface_it_is_given(monkeypatch):
    """The network testbed's path: its own GLOO_SOCKET_IFNAME (``env`` wins over the inherited
    one), MASTER_ADDR rank 0's address; the rendezvous is still the file."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-that-does-not-exist")
    results = launch.spawn(2, _listening, master_addr="192.0.2.1", env={"GLOO_SOCKET_IFNAME": "lo"})
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert {r["gloo_ifname"] for r in results} == {"lo"}
    assert {r["master"] for r in results} == {("192.0.2.1", None)}


def _rank1_disk_full(rank: int, world: int) -> int:
    from cokit.files import WriteError

    if rank == 1:
        raise WriteError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/results/rank1.jsonl")
    return rank


@pytest.mark.distributed
def test_a_failing_rank_carries_its_exception_back():
    """So that a command can tell a full disk on a rank from a bug (one line vs a traceback)."""
    from cokit.files import WriteError

    with pytest.raises(launch.RankFailed) as info:
        launch.spawn(2, _rank1_disk_full)
    failed = info.value
    assert isinstance(failed, RuntimeError) and str(failed).startswith("rank 1 failed:\nTraceback")
    assert failed.rank == 1 and isinstance(failed.error, WriteError)
    assert failed.error.errno == errno.ENOSPC and failed.error.filename == "/results/rank1.jsonl"


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True), ("10.213.0.1", False),
     ("0.0.0.0", False), ("example.org", False)],
)  # fmt: skip
def test_is_loopback(address, expected):
    assert launch.is_loopback(address) is expected
