"""A network testbed: ranks in network namespaces joined by shaped links (docs/design.md §5).

Each rank runs in its own network namespace (``cokit-<pid>-<n>-r<rank>``); two ranks are
joined by a veth pair, three or more by veth pairs to a bridge in a hub namespace. Their
addresses (``10.213.0.<rank+1>/24``) exist only inside the namespaces. A
:class:`LinkProfile` shapes the links with ``tc tbf`` in both directions (rate, burst, a
queue that tail-drops when small), can cut them for a while (a partition), and can add a
*simulated* latency above the socket (:mod:`cokit.compress.simulate`: this kernel has no
``netem``). Everything is removed on exit, also on errors and Ctrl-C, and namespaces left by
dead processes are removed on the next start.

    with Testbed("10mbit-drops", world_size=2) as bed:
        results = bed.spawn(train, steps, timeout=300)   # fn(rank, world, *args), like launch.spawn
        bed.link_stats()                                 # bytes sent / dropped per link

Inside ``fn``: call :func:`training_started` when training begins (the partition clock
starts then) and :func:`apply_simulated_latency` on the optimizer (a no-op without one).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cokit.compress.simulate import LatencyModel, SimulatedLatencyCommunicator, simulate_latency
from cokit.launch import spawn as launch_spawn

__all__ = [
    "PROFILES",
    "LinkProfile",
    "Partition",
    "Testbed",
    "apply_simulated_latency",
    "available",
    "cleanup_stale",
    "get_profile",
    "training_started",
]

#: interface name of every rank inside its namespace (GLOO_SOCKET_IFNAME)
INTERFACE = "cokit0"
SUBNET = "10.213.0"
_PREFIX = "cokit-"
_NAME = re.compile(r"^cokit-(\d+)-")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units are decimal
_ENV_SIGNAL = "COKIT_NETBED_SIGNAL"
_ENV_LATENCY = "COKIT_NETBED_LATENCY"
_CLONE_NEWNET = 0x40000000
_testbeds = itertools.count()


@dataclasses.dataclass(frozen=True)
class Partition:
    """All links go down ``at_s`` seconds after training starts, for ``for_s`` seconds."""

    at_s: float
    for_s: float

    def __post_init__(self) -> None:
        for name in ("at_s", "for_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Partition: {name} must be a finite number of seconds, got {value!r}")
        if self.at_s < 0 or self.for_s <= 0:
            raise ValueError(f"Partition: need at_s >= 0 and for_s > 0, got {self.at_s}, {self.for_s}")


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """How the links between ranks behave.

    ``rate``: tc rate such as ``"10mbit"`` (None: unshaped); ``burst_bytes``: the tbf bucket;
    ``limit_bytes``: the tbf queue (small: tail drops); ``partition``: links down for a
    while; ``latency``: a simulated per-collective latency (not on the wire). A profile with
    a rate or a partition runs in network namespaces; otherwise on loopback.
    """

    name: str
    rate: str | None = None
    burst_bytes: int = 70_000
    limit_bytes: int = 500_000
    partition: Partition | None = None
    latency: LatencyModel | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LinkProfile: name must be a non-empty string, got {self.name!r}")
        if self.rate is not None and not (isinstance(self.rate, str) and _RATE.match(self.rate)):
            raise ValueError(
                f"LinkProfile {self.name}: rate must be like '10mbit' (units bit, kbit, mbit, gbit) "
                f"or None for unshaped, got {self.rate!r}"
            )
        for key in ("burst_bytes", "limit_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1600:
                raise ValueError(
                    f"LinkProfile {self.name}: {key} must be an integer >= 1600 (one full frame), got {value!r}"
                )
        if self.partition is not None and not isinstance(self.partition, Partition):
            raise TypeError(f"LinkProfile {self.name}: partition must be a Partition or None")
        if self.latency is not None and not isinstance(self.latency, LatencyModel):
            raise TypeError(f"LinkProfile {self.name}: latency must be a LatencyModel or None")

    @property
    def namespaces(self) -> bool:
        """True when this profile needs network namespaces (shaped or cut links)."""
        return self.rate is not None or self.partition is not None

    @property
    def rate_bps(self) -> float | None:
        """The shaped rate in bits per second (None: unshaped)."""
        if self.rate is None:
            return None
        m = _RATE.match(self.rate)
        assert m is not None  # checked in __post_init__
        return float(m.group(1)) * _RATE_SCALE[m.group(2)]

    def describe(self) -> str:
        """One line: what is real (tc on veth links) and what is simulated."""
        parts = []
        if self.rate is not None:
            parts.append(
                f"tbf rate {self.rate}, burst {self.burst_bytes} B, queue {self.limit_bytes} B "
                "on veth links between network namespaces (real)"
            )
        elif self.namespaces:
            parts.append("unshaped veth links between network namespaces (real)")
        else:
            parts.append("loopback")
        if self.partition is not None:
            parts.append(
                f"links down {self.partition.at_s:g} s after training starts, "
                f"for {self.partition.for_s:g} s (real)"
            )
        if self.latency is not None:
            parts.append(self.latency.describe())
        return f"{self.name}: " + "; ".join(parts)


PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("loopback"),
        LinkProfile("100mbit", rate="100mbit", burst_bytes=200_000, limit_bytes=2_000_000),
        LinkProfile("10mbit", rate="10mbit"),
        # A queue of ~16 frames behind a 16 kB bucket: TCP loses ~20% of its packets.
        LinkProfile("10mbit-drops", rate="10mbit", burst_bytes=16_000, limit_bytes=24_000),
        LinkProfile("latency-50ms-sim", latency=LatencyModel(50.0, 20.0, seed=0)),
        LinkProfile("partition-5s", partition=Partition(at_s=1.0, for_s=5.0)),
    )
}


def get_profile(profile: LinkProfile | str) -> LinkProfile:
    """The profile itself, or the one in :data:`PROFILES` with that name."""
    if isinstance(profile, LinkProfile):
        return profile
    if profile not in PROFILES:
        raise ValueError(f"unknown network profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    return PROFILES[profile]


# ----------------------------------------------------------------------------- host side


def _run(*cmd: str) -> str:
    """Run ``ip``/``tc``; a failure raises RuntimeError with the command and its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def available() -> tuple[bool, str]:
    """``(True, "")`` when network namespaces can be made here, else ``(False, why)``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "network namespaces need root (run as root, or use a loopback profile)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed (install iproute2)"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`ip netns add` is not permitted here: {exc}"
    try:
        _run("ip", "netns", "delete", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`ip netns delete {probe}` failed (remove it by hand): {exc}"
    return True, ""


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """A veth pair with end ``dev_a`` in namespace ``ns_a`` and ``dev_b`` in ``ns_b``."""
    _run("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete ``cokit-<pid>-*`` namespaces whose process is gone; return their names."""
    removed = []
    for name in _netns_names():
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "delete", name)
                removed.append(name)
    return removed


# ----------------------------------------------------------------------------- rank side


def _enter_namespace(names: tuple[str, ...], rank: int) -> None:
    """child_setup: move this process (its main thread, before any socket) into its namespace."""
    path = f"/var/run/netns/{names[rank]}"
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, _CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)
    socket.if_nametoindex(INTERFACE)  # raises OSError if we are not where we should be


def training_started() -> None:
    """Tell the testbed that training has begun (starts a partition's clock); no-op outside one."""
    path = os.environ.get(_ENV_SIGNAL)
    if path:
        with open(path, "a"):
            pass


def apply_simulated_latency(optimizer: object) -> SimulatedLatencyCommunicator | None:
    """Give ``optimizer.comm`` the testbed profile's simulated latency, if it has one.

    Returns the delaying communicator (its ``added_s`` is the delay added), or None when the
    profile simulates no latency (or outside a testbed).
    """
    spec = os.environ.get(_ENV_LATENCY)
    if not spec:
        return None
    model = LatencyModel(**json.loads(spec))
    return simulate_latency(optimizer, model.mean_ms, model.jitter_ms, model.seed)


# ----------------------------------------------------------------------------- the testbed


class Testbed:
    """Namespaces, links and shaping for ``world_size`` ranks under ``profile`` (a context manager).

    Attributes after :meth:`spawn`: ``partitions`` (``(signalled, down, up)`` wall-clock
    times of every partition, ``time.time()``), ``stats`` (``link_stats()`` at the end of the
    last run).
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, profile: LinkProfile | str, world_size: int = 2):
        self.profile = get_profile(profile)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= 250:
            raise ValueError(f"Testbed: world_size must be an integer from 2 to 250, got {world_size!r}")
        self.world_size = world_size
        tag = f"{_PREFIX}{os.getpid()}-{next(_testbeds)}"
        self.rank_namespaces = tuple(f"{tag}-r{r}" for r in range(world_size))
        self.hub_namespace = f"{tag}-hub" if world_size > 2 else None
        self.links: list[tuple[str, str]] = []  # (namespace, device) of every shaped link end
        self.partitions: list[tuple[float, float, float]] = []
        self.stats: dict[str, dict[str, int]] = {}
        self._created: list[str] = []
        self._tmp: str | None = None
        self._runs = 0

    # -- lifecycle
    def __enter__(self) -> Testbed:
        if self.profile.namespaces:
            ok, why = available()
            if not ok:
                raise RuntimeError(
                    f"network profile {self.profile.name!r} needs network namespaces: {why}. "
                    "Use profile 'loopback' or 'latency-50ms-sim' where namespaces are not allowed."
                )
            cleanup_stale()
        atexit.register(self.close)
        try:
            self._tmp = tempfile.mkdtemp(prefix="cokit-netbed-")
            if self.profile.namespaces:
                self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (and with them the links) and the signal folder."""
        errors = []
        for name in reversed(self._created):
            try:
                _run("ip", "netns", "delete", name)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self._created.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("Testbed cleanup failed; remove with `ip netns delete`: " + "; ".join(errors))

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for name in self.rank_namespaces:
            self._netns(name)
        if self.hub_namespace is None:
            a, b = self.rank_namespaces
            _add_veth(a, INTERFACE, b, INTERFACE)
            self.links = [(a, INTERFACE), (b, INTERFACE)]
        else:
            hub = self.hub_namespace
            self._netns(hub)
            _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", hub, "link", "set", "br0", "up")
            for r, name in enumerate(self.rank_namespaces):
                port = f"p{r}"
                _add_veth(name, INTERFACE, hub, port)
                _run("ip", "-n", hub, "link", "set", port, "master", "br0")
                _run("ip", "-n", hub, "link", "set", port, "up")
                self.links += [(name, INTERFACE), (hub, port)]
        for r, name in enumerate(self.rank_namespaces):
            _run("ip", "-n", name, "addr", "add", f"{self.address(r)}/24", "dev", INTERFACE)
            _run("ip", "-n", name, "link", "set", INTERFACE, "up")
        if self.profile.rate is not None:
            for ns, dev in self.links:  # egress of both ends: both directions are shaped
                _run(
                    "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", self.profile.rate,
                    "burst", str(self.profile.burst_bytes),
                    "limit", str(self.profile.limit_bytes),
                )  # fmt: skip

    # -- queries
    def address(self, rank: int) -> str:
        """Rank ``rank``'s address (inside its namespace; loopback without namespaces)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return f"{SUBNET}.{rank + 1}" if self.profile.namespaces else "127.0.0.1"

    def link_stats(self) -> dict[str, dict[str, int]]:
        """Per shaped link end (``namespace/device``): bytes and packets sent, packets dropped."""
        out = {}
        for ns, dev in self.links:
            if self.profile.rate is None:
                continue
            for q in json.loads(_run("tc", "-j", "-s", "-n", ns, "qdisc", "show", "dev", dev) or "[]"):
                if q.get("kind") == "tbf":
                    out[f"{ns}/{dev}"] = {
                        "bytes": int(q.get("bytes", 0)),
                        "packets": int(q.get("packets", 0)),
                        "drops": int(q.get("drops", 0)),
                    }
        return out

    def set_links(self, up: bool) -> None:
        """Bring every link of the testbed up or down now (a partition of your own timing)."""
        self._set_links("up" if up else "down")

    def _set_links(self, state: str) -> None:
        for ns, dev in self.links:
            _run("ip", "-n", ns, "link", "set", dev, state)

    # -- running
    def spawn(
        self,
        fn: Callable,
        *args: Any,
        timeout: float = 600.0,
        env: Mapping[str, str | None] | None = None,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on a gloo group across the testbed's links.

        Like :func:`cokit.launch.spawn` (results in rank order; a failing rank raises), with
        each rank in its namespace, ``MASTER_ADDR`` rank 0's address and
        ``GLOO_SOCKET_IFNAME`` the rank's interface. With a partition, ``fn`` must call
        :func:`training_started`; a run in which the partition never began raises.
        """
        if self._tmp is None:
            raise RuntimeError("Testbed.spawn runs inside `with Testbed(...) as bed:`")
        self._runs += 1
        signal = os.path.join(self._tmp, f"started-{self._runs}")
        child_env: dict[str, str | None] = dict(env or {})
        child_env[_ENV_SIGNAL] = signal
        child_env[_ENV_LATENCY] = (
            json.dumps(dataclasses.asdict(self.profile.latency)) if self.profile.latency else None
        )
        kwargs: dict[str, Any] = {}
        if self.profile.namespaces:
            child_env["GLOO_SOCKET_IFNAME"] = INTERFACE
            kwargs = dict(
                master_addr=self.address(0),
                child_setup=functools.partial(_enter_namespace, self.rank_namespaces),
            )
        before = len(self.partitions)
        stop, failure = threading.Event(), list[BaseException]()
        clock = None
        if self.profile.partition is not None:
            clock = threading.Thread(
                target=self._partition_clock,
                args=(self.profile.partition, signal, stop, failure),
                daemon=True,
            )
            clock.start()
        try:
            results = launch_spawn(
                self.world_size, fn, *args, backend="gloo", timeout=timeout, env=child_env, **kwargs
            )
        finally:
            stop.set()
            if clock is not None:
                clock.join()
            if self.profile.rate is not None:
                self.stats = self.link_stats()
        if failure:
            raise RuntimeError(f"Testbed {self.profile.name}: the partition failed: {failure[0]}")
        if self.profile.partition is not None and len(self.partitions) == before:
            p = self.profile.partition
            raise RuntimeError(
                f"Testbed {self.profile.name}: the partition ({p.at_s:g} s after training_started()) never "
                "began: call cokit.bench.netbed.training_started() in fn when training begins, and train for "
                f"longer than {p.at_s:g} s"
            )
        return results

    def _partition_clock(
        self, p: Partition, signal: str, stop: threading.Event, failure: list[BaseException]
    ) -> None:
        """Thread: after the rank's signal, wait ``at_s``, cut every link for ``for_s``."""
        try:
            while not os.path.exists(signal):
                if stop.wait(0.01):
                    return
            signalled = time.time()
            if stop.wait(p.at_s):
                return
            self._set_links("down")
            down = time.time()
            try:
                stop.wait(p.for_s)
            finally:
                self._set_links("up")
                self.partitions.append((signalled, down, time.time()))
        except Exception as exc:  # reported by spawn
            failure.append(exc)
