"""SparseLoCo on torchft with a real lighthouse on loopback and 3 replica groups (one process each).

One scenario (a module fixture), replayed by the tests from the replicas' logs
(tests/ft_worker.py): replicas 0, 1, 2 train; replica 2 freezes in the middle of a period and
is SIGKILLed; 0 and 1 go on in a quorum of 2. Replica 2 restarts, heals from a live peer and
commits syncs in a quorum of 3, then freezes inside the round in flight (it holds the quorum)
and is SIGKILLed again: the survivors drop that round and go on. It restarts once more and
heals; then two replicas try to join at once, with other settings (top-k) and another model
(hidden size): each is refused with a clear error and exits, and the others go on. Every wait is
bounded; the control is by the replicas' own sync counts, not by sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ft_worker.py"
LIGHTHOUSE = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
TIMEOUT_S = 6.0  # each collective's (the workers' --timeout)
HEARTBEAT_MS = 1000
WAIT_S = 120.0  # the most any one wait of the scenario may take (a failure, not a hang)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(LIGHTHOUSE).exists(), reason="the torchft_lighthouse binary is missing"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    log = tmp_path_factory.mktemp("lighthouse") / "lighthouse.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                LIGHTHOUSE,
                "--min_replicas",
                "2",
                "--quorum_tick_ms",
                "50",
                "--join_timeout_ms",
                "1000",
                "--heartbeat_timeout_ms",
                str(HEARTBEAT_MS),
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait(lambda: _listening(port), "the lighthouse to listen", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(ready: Callable[[], object], what: str, *procs: subprocess.Popen, limit: float = WAIT_S) -> object:
    """Poll ``ready`` until it is truthy (its value), at most ``limit`` seconds; a process that
    ends meanwhile with a non-zero code fails the wait at once."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = ready()
        if value:
            return value
        for p in procs:
            if p.poll() not in (None, 0):
                pytest.fail(f"waiting for {what}: {p.args} exited with {p.returncode}")
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen within {limit:g} s")


class Run:
    """The replicas of one scenario: their processes and logs."""

    def __init__(self, url: str, folder: Path):
        self.url, self.folder = url, folder
        self.stop = folder / "stop"
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, replica: int, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start replica ``replica`` as ``name`` (``prefix``: a command the worker runs under,
        such as ``ip netns exec``)."""
        log = self.folder / f"{name}.jsonl"
        cmd = [*prefix, sys.executable, str(WORKER), "--lighthouse", self.url, "--replica", str(replica)]
        cmd += ["--log", str(log), "--stop-file", str(self.stop), "--timeout", str(TIMEOUT_S), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.folder / f"{name}.out", "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.procs.append((name, proc))
        return proc

    def rows(self, name: str, event: str | None = None) -> list[dict]:
        path = self.folder / f"{name}.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return [r for r in rows if event is None or r["event"] == event]

    def syncs(self, name: str, after: float = 0.0, world: int | None = None) -> list[dict]:
        return [
            r for r in self.rows(name, "sync") if r["t"] > after and (world is None or r["world"] == world)
        ]

    def output(self, name: str) -> str:
        return (self.folder / f"{name}.out").read_text()

    def kill_all(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _kill(run: Run, proc: subprocess.Popen, why: str, live: tuple) -> tuple[float, float]:
    """SIGKILL replica 2's ``proc`` and wait until replicas a and b synced in a quorum of 2:
    (when it was killed, seconds until both had synced)."""
    proc.send_signal(signal.SIGKILL)
    killed = time.time()
    proc.wait(timeout=30)
    for name in ("a", "b"):
        _wait(lambda n=name: run.syncs(n, killed, world=2), f"{name} {why}", *live)
    return killed, max(run.syncs(n, killed, world=2)[0]["t"] for n in "ab") - killed


def _start_and_kill_replica_2(
    run: Run, facts: dict[str, float], hang: tuple[str, ...], what: str, why: str
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Start replicas 0, 1 (as a, b) and 2 (as c1, with ``hang``: where it freezes); wait for it
    to freeze (``what``), SIGKILL it and wait until a and b go on (``why``; facts ``kill1``,
    ``continue1``). Returns a and b."""
    a = run.start("a", 0)
    b = run.start("b", 1)
    c1 = run.start("c1", 2, *hang)
    _wait(lambda: run.rows("c1", "hang"), what, a, b, c1)
    facts["kill1"], facts["continue1"] = _kill(run, c1, why, (a, b))
    return a, b


def _restart_replica_2(
    run: Run,
    facts: dict[str, float],
    name: str,
    ready: Callable[[], object],
    what: str,
    live: tuple,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Restart replica 2 as ``name`` (``extra``: its options) and wait until ``ready`` (``what``);
    facts ``heal<n>`` (start to first sync) and ``spawn_to_sync<n>`` (launch to first sync), n
    from ``name``."""
    launched = time.time()
    proc = run.start(name, 2, *extra)
    _wait(ready, what, *live, proc)
    n = name[-1]
    facts[f"heal{n}"] = run.syncs(name)[0]["t"] - run.rows(name, "start")[0]["t"]
    facts[f"spawn_to_sync{n}"] = run.syncs(name)[0]["t"] - launched
    return proc


def _refuse_bad_joiners(
    run: Run, facts: dict[str, float], good: dict[str, subprocess.Popen], topk: str
) -> None:
    """Two replicas join at once, one with top-k ``topk``, one with another model: wait until
    both are refused and exit, then until every replica in ``good`` syncs again in a quorum of 3
    (facts ``bad``, ``refused``, ``continue3``)."""
    procs = tuple(good.values())
    facts["bad"] = time.time()
    bad_k = run.start("bad_topk", 3, "--topk", topk)
    bad_m = run.start("bad_model", 4, "--hidden", "24")
    for bad in ("bad_topk", "bad_model"):
        _wait(lambda n=bad: run.rows(n, "refused"), f"the {bad} joiner to be refused", *procs)
    for p in (bad_k, bad_m):
        _wait(lambda p=p: p.poll() is not None, f"{p.args} to exit", *procs)
    facts["refused"] = time.time()
    first = min(r["t"] for n in ("bad_topk", "bad_model") for r in run.rows(n, "refused"))
    for name in good:
        _wait(
            lambda n=name: run.syncs(n, facts["refused"], world=3),
            f"{name} to go on after the refusals",
            *procs,
        )
    facts["continue3"] = max(run.syncs(n, first, world=3)[0]["t"] for n in good) - first


def _finish(run: Run, facts: dict[str, float], good: dict[str, subprocess.Popen], title: str) -> None:
    """Every replica in ``good`` stops at the same sync, two after the latest; wait until all
    have exited, then print the scenario's timings (fact ``seconds``) under ``title``."""
    procs = tuple(good.values())
    last = max(r["sync"] for n in good for r in run.syncs(n)) + 2
    run.stop.write_text(str(last))
    for name, p in good.items():
        _wait(lambda p=p: p.poll() is not None, f"{name} to finish", *procs)
    facts["seconds"] = time.time() - facts["started"]
    shown = {k: round(v, 2) for k, v in facts.items() if k[0] in "chs" and k != "started"}
    print(f"\n{title} (seconds): {json.dumps(shown)}; load average {os.getloadavg()}")


def _codes(run: Run) -> dict[str, int | None]:
    """Each replica's exit code by name (None: still running)."""
    return {name: p.returncode for name, p in run.procs}


@pytest.fixture(scope="module")
def scenario(lighthouse: str, tmp_path_factory: pytest.TempPathFactory):
    run = Run(lighthouse, tmp_path_factory.mktemp("ft"))
    facts: dict[str, float] = {"started": time.time()}
    try:
        # 1. replica 2 freezes in the middle of a period and is killed
        a, b = _start_and_kill_replica_2(
            run,
            facts,
            ("--hang-after", "2", "--hang", "mid"),
            "replica 2 to reach the middle of a period",
            "to sync without replica 2",
        )
        live = (a, b)
        # 2. it restarts, heals, syncs in a quorum of 3, then freezes inside the round in flight
        c2 = _restart_replica_2(
            run,
            facts,
            "c2",
            lambda: run.rows("c2", "hang"),
            "restarted replica 2 to sync twice and freeze",
            live,
            ("--hang-after", "2", "--hang", "in"),
        )
        facts["kill2"], facts["continue2"] = _kill(run, c2, "to sync after the round in flight", live)
        # 3. it restarts again and heals; then two bad joiners are refused
        c3 = _restart_replica_2(run, facts, "c3", lambda: run.syncs("c3"), "replica 2 to heal again", live)
        good = {"a": a, "b": b, "c3": c3}
        _refuse_bad_joiners(run, facts, good, "4")
        # 4. everyone stops at the same sync
        _finish(run, facts, good, "ft scenario")
        yield run, facts
    finally:
        run.kill_all()


def test_survivors_go_on_when_a_replica_dies(scenario) -> None:
    run, facts = scenario
    codes = _codes(run)
    assert codes["a"] == 0 and codes["b"] == 0, codes  # no hang, no SIGABRT
    assert codes["c1"] == -signal.SIGKILL and codes["c2"] == -signal.SIGKILL
    # killed in the middle of a period: the survivors' next quorum is just smaller
    assert facts["continue1"] < TIMEOUT_S + 30, facts
    # killed inside the round in flight: the survivors drop it and sync it again without it
    assert facts["continue2"] < TIMEOUT_S + 30, facts
    for name in ("a", "b"):
        after = run.syncs(name, facts["kill2"], world=2)
        assert after[0]["dropped"] > run.syncs(name)[0]["dropped"], after[0]
        assert "SparseLoCo.step" in after[0]["error"], after[0]
        # nothing lost beyond the round in flight: every sync number, once, in order (until the
        # bad joiners: a member whose peers failed over first waits for its timeout, falls
        # behind and heals)
        numbers = [r["sync"] for r in run.syncs(name) if r["t"] < facts["bad"]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers


def test_restarted_replica_heals_and_is_bit_identical(scenario) -> None:
    run, _ = scenario
    for name in ("c2", "c3"):
        mine = run.syncs(name)
        assert mine and mine[0]["heals"] == 1 and mine[0]["world"] == 3, mine[:1]
        for row in mine:  # after every sync it took part in, every replica holds the same bytes
            others = {r["weights"] for n in ("a", "b") for r in run.syncs(n) if r["sync"] == row["sync"]}
            assert others == {row["weights"]}, (name, row["sync"])
    final = {run.syncs(n)[-1]["sync"]: run.syncs(n)[-1]["weights"] for n in ("a", "b", "c3")}
    assert len(final) == 1 and len(set(final.values())) == 1, final
    assert _codes(run)["c3"] == 0


def test_joiner_with_other_settings_or_model_is_kept_out(scenario) -> None:
    run, facts = scenario
    codes = _codes(run)
    assert codes["bad_topk"] == 3 and codes["bad_model"] == 3, codes
    (topk,) = run.rows("bad_topk", "refused")
    assert "cannot join the quorum" in topk["error"] and "setting 'topk' was 8, is 4 now" in topk["error"], (
        topk
    )
    (model,) = run.rows("bad_model", "refused")
    assert "another model" in model["error"], model
    assert not run.syncs("bad_topk") and not run.syncs("bad_model")
    for name in ("a", "b", "c3"):
        assert run.syncs(name, facts["refused"], world=3), name
    assert _codes(run)["a"] == 0
