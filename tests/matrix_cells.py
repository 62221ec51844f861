"""Running one cell of the reliability matrix (tests/test_reliability_matrix.py): its ranks as
processes of their own (tests/matrix_rank.py), how long they may take and what they left.
tests/test_faults.py runs cells of its own through it too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cokit import netbed
from tests.helpers import ROOT, script_env

TIMEOUT = 3.0  # the collectives' timeout in the cells whose fault is a missing peer
PATIENT = 60.0  # and in the others: a loaded machine's slow rank is no fault there
WAITING = ("stop", "kill", "partition", "stop-in-report")
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


def run_cell(tmp: Path, front: str, fault: str, world: int, bed: netbed.Testbed | None) -> dict:
    """Start the cell's ranks as processes; return what they wrote and how they ended."""
    where = tmp / f"{front}-{fault}-w{world}"
    where.mkdir(parents=True)
    env = script_env(GLOO_SOCKET_IFNAME=netbed.INTERFACE if bed is not None else "lo")
    init = f"file://{where / 'store'}"
    started = str(where / "started") if fault == "partition" else None
    procs = []
    for r in range(world):
        cmd = [sys.executable, str(ROOT / "tests" / "matrix_rank.py"), "--front", front, "--fault", fault]
        cmd += [
            "--rank",
            str(r),
            "--world",
            str(world),
            "--init",
            init,
            "--timeout",
            str(cell_timeout(fault)),
        ]
        cmd += ["--out", str(where / f"rank{r}.json")] + (["--started", started] if started else [])
        if bed is not None:  # the rank's network namespace: its only link is the testbed's
            cmd = ["ip", "netns", "exec", bed.rank_namespaces[r], *cmd]
        log = open(where / f"rank{r}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    if bed is not None:
        cut_when_ready(bed, started, world, procs)
    live = live_ranks(fault, world)
    exits: dict[int, float] = {}
    loads: dict[int, float] = {}  # the load average when each exited (exit_bound)
    deadline = time.monotonic() + 240
    try:
        while len(exits) < len(live) and time.monotonic() < deadline:
            for r in live:
                if r not in exits and procs[r][0].poll() is not None:
                    exits[r], loads[r] = time.time(), os.getloadavg()[0]
            time.sleep(0.02)
    finally:
        for p, log in procs:  # a frozen rank, or any rank still there after the deadline
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    out = {"front": front, "fault": fault, "world": world, "ranks": {}}
    for r in range(world):
        path = where / f"rank{r}.json"
        record = json.loads(path.read_text()) if path.exists() else None
        out["ranks"][r] = {
            "record": record,
            "returncode": procs[r][0].returncode,
            "exited": exits.get(r),
            "load": loads.get(r),
            "log": (where / f"rank{r}.log").read_text(errors="replace")[-4000:],
        }
    shutil.rmtree(where, ignore_errors=True)
    return out


def cut_when_ready(bed: netbed.Testbed, started: str | None, world: int, procs: list) -> None:
    """The partition: when every rank reached the faulty step, cut every link for good."""
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{started}.rank{r}") for r in range(world)):
        if time.monotonic() > deadline or any(p.poll() is not None for p, _ in procs):
            return  # the cell's checks report what went wrong
        time.sleep(0.02)
    bed.set_links(up=False)
    with open(f"{started}.cut", "w"):
        pass
