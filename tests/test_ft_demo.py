"""DeMo on torchft with a real lighthouse on loopback and 3 replica groups (one process each).

One scenario (a module fixture), replayed by the tests from the replicas' logs
(tests/ft_demo_worker.py; the lighthouse, the log reader and the bounded waits are
tests/test_ft.py's): replicas 0, 1, 2 train, every step a round; replica 2 freezes holding the
quorum of the round in flight and is SIGKILLed; 0 and 1 drop that round (a skipped sync) and go
on in a quorum of 2 (the round undone, its gradient kept in their error buffers). Replica 2 restarts, heals from a live peer and commits rounds in a quorum
of 3 with bit-identical parameters; then two replicas try to join at once, with another
``compression_topk`` and another model: each is refused with a clear error and exits, and the
others go on. Every wait is bounded; the control is by the replicas' own logs, not by sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'cokit[ft]')")

from tests.test_ft import (
    LIGHTHOUSE,
    ROOT,
    TIMEOUT_S,
    Run,
    _codes,
    _finish,
    _refuse_bad_joiners,
    _restart_replica_2,
    _start_and_kill_replica_2,
    lighthouse,  # noqa: F401
)

WORKER = ROOT / "tests" / "ft_demo_worker.py"

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(LIGHTHOUSE).exists(), reason="the torchft_lighthouse binary is missing"),
]


class DemoRun(Run):
    """The replicas of the DeMo scenario (tests/ft_demo_worker.py)."""

    def start(self, name: str, replica: int, *extra: str) -> subprocess.Popen:
        log = self.folder / f"{name}.jsonl"
        cmd = [sys.executable, str(WORKER), "--lighthouse", self.url, "--replica", str(replica)]
        cmd += ["--log", str(log), "--stop-file", str(self.stop), "--timeout", str(TIMEOUT_S), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.folder / f"{name}.out", "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.procs.append((name, proc))
        return proc


@pytest.fixture(scope="module")
def scenario(lighthouse: str, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    run = DemoRun(lighthouse, tmp_path_factory.mktemp("ft_demo"))
    facts: dict[str, float] = {"started": time.time()}
    try:
        # 1. replica 2 freezes holding the quorum of the round in flight and is killed
        a, b = _start_and_kill_replica_2(
            run,
            facts,
            ("--hang-after", "3"),
            "replica 2 to take three rounds and freeze",
            "to go on without replica 2",
        )
        # 2. it restarts, heals and takes rounds in a quorum of 3
        c2 = _restart_replica_2(
            run,
            facts,
            "c2",
            lambda: len(run.syncs("c2")) >= 3,
            "restarted replica 2 to heal and take 3 rounds",
            (a, b),
        )
        good = {"a": a, "b": b, "c2": c2}
        # 3. two joiners at once, with another top-k and another model: refused
        _refuse_bad_joiners(run, facts, good, "2")
        # 4. everyone stops at the same committed step
        _finish(run, facts, good, "ft DeMo scenario")
        yield run, facts
    finally:
        run.kill_all()


def test_survivors_go_on_when_a_replica_dies(scenario) -> None:
    run, facts = scenario
    codes = _codes(run)
    assert codes["a"] == 0 and codes["b"] == 0 and codes["c2"] == 0, codes  # no hang, no SIGABRT
    assert codes["c1"] == -signal.SIGKILL
    assert facts["continue1"] < TIMEOUT_S + 30, facts
    # the survivor(s) in replica 2's quorum saw the round in flight fail and undid it (on a
    # loaded machine the lighthouse may have formed quorums of 2, so maybe only one did)
    dropped = []
    for name in ("a", "b"):
        after = run.syncs(name, facts["kill1"], world=2)
        before = [r for r in run.syncs(name) if r["t"] < facts["kill1"]]
        if after[0]["dropped"] > (before[-1]["dropped"] if before else 0):
            dropped.append(name)
            assert "DeMo.step" in after[0]["error"], after[0]
    assert dropped, "no survivor dropped the round in flight"


def test_every_replica_is_bit_identical_at_every_committed_step(scenario) -> None:
    run, _ = scenario
    names = ("a", "b", "c1", "c2")
    weights: dict[int, set[str]] = {}
    for name in names:
        for row in run.syncs(name):
            weights.setdefault(row["sync"], set()).add(row["weights"])
            # a dropped round moves no counter: DeMo's step count is torchft's committed step
            assert row["steps"] == row["sync"], (name, row)
    assert all(len(w) == 1 for w in weights.values()), {k: len(w) for k, w in weights.items()}
    mine = run.syncs("c2")  # the restarted replica healed, then took rounds with the others
    assert mine and mine[0]["heals"] >= 1 and any(r["world"] == 3 for r in mine), mine[:1]
    final = {run.syncs(n)[-1]["sync"]: run.syncs(n)[-1]["weights"] for n in ("a", "b", "c2")}
    assert len(final) == 1 and len(set(final.values())) == 1, final


def test_joiner_with_other_settings_or_model_is_kept_out(scenario) -> None:
    run, facts = scenario
    codes = _codes(run)
    assert codes["bad_topk"] == 3 and codes["bad_model"] == 3, codes
    (topk,) = run.rows("bad_topk", "refused")
    assert "cannot join the quorum" in topk["error"], topk
    assert "'compression_topk' of param group 0 is 4 on the live replicas and 2 here" in topk["error"], topk
    (model,) = run.rows("bad_model", "refused")
    assert "another model" in model["error"], model
    assert not run.syncs("bad_topk") and not run.syncs("bad_model")
    for name in ("a", "b", "c2"):
        assert run.syncs(name, facts["refused"], world=3), name
