"""Running one cell of the reliability matrix (tests/test_reliability_matrix.py): its ranks as
processes of their own (tests/matrix_rank.py), how long they may take and what they left.
tests/test_faults.py runs cells of its own through it too."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cokit.bench import netbed
from tests.helpers import ROOT, script_env

TIMEOUT = 3.0  # the collectives' timeout in the cells whose fault is a missing peer
PATIENT = 60.0  # and in the others: a loaded machine's slow rank is no fault there
WAITING = ("stop", "kill", "partition", "stop-in-report")
RANK = ROOT / "tests" / "matrix_rank.py"
SLACK = 5.0  # the exit bound: timeout + SLACK seconds after the fault (stretched by the load)


def cell_timeout(fault: str) -> float:
    return TIMEOUT if fault in WAITING else PATIENT


def exit_bound(timeout: float, load: float | None = None) -> float:
    """Seconds from the fault to a process's exit: timeout + 5 s on an idle machine. A loaded
    one runs every process slower: the 1-minute load average per core (``load``, read when the
    process exited; default: now) stretches the slack. Any bound far below the group's
    30-minute timeout shows that nothing waits on abandoned work."""
    load = os.getloadavg()[0] if load is None else load
    return timeout + SLACK * max(1.0, load / (os.cpu_count() or 1))


def live_ranks(fault: str, world: int) -> list[int]:
    """The ranks that must see the fault and report it (a frozen or dead rank does not)."""
    return list(range(world - 1)) if fault in ("stop", "kill", "stop-in-report") else list(range(world))


class Zygote:
    """The test's side of tests/matrix_rank.py's ``--zygote``: one process, started on first
    use, that forks the ranks of every cell (a lock serialises the cells' threads)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.started: queue.Queue[int] = queue.Queue()
        self.exits: dict[int, int] = {}  # pid: exit code, as Popen.returncode

    def start(self, argv: list[str], log: Path, env: dict[str, str], netns: str | None) -> ForkedRank:
        """Fork a rank running tests/matrix_rank.py ``argv`` (output to ``log``, ``env`` added,
        in network namespace ``netns`` if given)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen(
                    [sys.executable, str(RANK), "--zygote"],
                    env=script_env(),
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
            assert self.proc.stdin is not None
            self.proc.stdin.write(
                json.dumps({"argv": argv, "log": str(log), "env": env, "netns": netns}) + "\n"
            )
            self.proc.stdin.flush()
            return ForkedRank(self, self.started.get(timeout=60))

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, pid, *rest = line.split()
            if kind == "pid":
                self.started.put(int(pid))
            else:
                self.exits[int(pid)] = int(rest[0])


class ForkedRank:
    """A rank forked by the :class:`Zygote`, with what the test uses of ``Popen``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.poll()  # type: ignore[return-value]


ZYGOTE = Zygote()


def run_cell(tmp: Path, front: str, fault: str, world: int, bed: netbed.Testbed | None) -> dict:
    """Start the cell's ranks as processes; return what they wrote and how they ended."""
    where = tmp / f"{front}-{fault}-w{world}"
    where.mkdir(parents=True)
    init = f"file://{where / 'store'}"
    started = str(where / "started") if fault == "partition" else None
    procs: list[ForkedRank] = []
    for r in range(world):
        cmd = ["--front", front, "--fault", fault, "--rank", str(r), "--world", str(world)]
        cmd += ["--init", init, "--timeout", str(cell_timeout(fault)), "--out", str(where / f"rank{r}.json")]
        cmd += ["--started", started] if started else []
        # with a testbed, the rank's network namespace, whose only link is the testbed's
        env = {"GLOO_SOCKET_IFNAME": netbed.INTERFACE if bed is not None else "lo"}
        netns = bed.rank_namespaces[r] if bed is not None else None
        procs.append(ZYGOTE.start(cmd, where / f"rank{r}.log", env, netns))
    if bed is not None:
        cut_when_ready(bed, started, world, procs)
    live = live_ranks(fault, world)
    exits: dict[int, float] = {}
    loads: dict[int, float] = {}  # the load average when each exited (exit_bound)
    deadline = time.monotonic() + 240
    try:
        while len(exits) < len(live) and time.monotonic() < deadline:
            for r in live:
                if r not in exits and procs[r].poll() is not None:
                    exits[r], loads[r] = time.time(), os.getloadavg()[0]
            time.sleep(0.02)
    finally:
        for p in procs:  # a frozen rank, or any rank still there after the deadline
            p.kill()
            p.wait()
    out = {"front": front, "fault": fault, "world": world, "ranks": {}}
    for r in range(world):
        path = where / f"rank{r}.json"
        record = json.loads(path.read_text()) if path.exists() else None
        out["ranks"][r] = {
            "record": record,
            "returncode": procs[r].poll(),
            "exited": exits.get(r),
            "load": loads.get(r),
            "log": (where / f"rank{r}.log").read_text(errors="replace")[-4000:],
        }
    shutil.rmtree(where, ignore_errors=True)
    return out


def cut_when_ready(bed: netbed.Testbed, started: str | None, world: int, procs: list[ForkedRank]) -> None:
    """The partition: when every rank reached the faulty step, cut every link for good."""
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{started}.rank{r}") for r in range(world)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return  # the cell's checks report what went wrong
        time.sleep(0.02)
    bed.set_links(up=False)
    with open(f"{started}.cut", "w"):
        pass
