"""Faults end cleanly: a frozen or dead rank, a killed launcher, a restart under torchrun.

A collective that times out or fails aborts its process group: the error says to restart
from the last checkpoint, a retry fails at once (no hang, no SIGABRT) and the process
exits within seconds. Spawned ranks never outlive their parent. Under ``torchrun
--max-restarts`` with per-rank checkpoints a run killed midway ends bit-identical to an
uninterrupted one. Ranks run as real processes on loopback; the timeout and slow-rank
scenarios share one spawned world (tests/gloo_cases.py, fixture ``world2``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from gloo_cases import Case, run_cases

from cokit.compress import DeMo
from cokit.compress.comm import Communicator, parse_timeout
from cokit.launch import free_port
from cokit.train import DEFAULT_TIMEOUT_S, MethodSpec
from tests.matrix_cells import cell_timeout, exit_bound, run_cell

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
MARKER = "COKIT_FAULT_MARKER"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0", GLOO_SOCKET_IFNAME="lo", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _marked(marker: str) -> list[str]:
    """Live processes (``pid cmdline``) whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name} {cmd}")
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _wait_until(cond, limit_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every_s)
    return bool(cond())


# ----------------------------------------------------------------------------- timeout values


@pytest.mark.parametrize(
    "timeout, error, match",
    [
        (float("nan"), ValueError, "got nan"),
        (-1, ValueError, "timeout must be > 0"),
        (0, ValueError, "timeout must be > 0"),
        (0.0, ValueError, "inf for no limit"),
        (True, ValueError, "a bool"),
        (False, ValueError, "a bool"),
        (datetime.timedelta(0), ValueError, "timeout must be > 0"),
        (datetime.timedelta(seconds=-3), ValueError, "timeout must be > 0"),
        (1e300, ValueError, "too large; pass float\\('inf'\\) for no limit"),
        ("30", TypeError, "seconds .* or a timedelta, got str"),
    ],
)
def test_bad_timeouts_are_rejected_with_the_owner_named(timeout, error, match):
    with pytest.raises(error, match=match):
        Communicator(owner="DeMo.step", timeout=timeout)
    with pytest.raises(error, match="DeMo.step: .*" + match):
        DeMo([torch.nn.Parameter(torch.zeros(4, 4))], timeout=timeout)
    with pytest.raises(error, match="method 'demo': .*" + match):
        MethodSpec("demo", 1e-3, timeout=timeout)


def test_inf_means_no_limit_and_numbers_become_timedeltas():
    assert parse_timeout(math.inf) is None and parse_timeout(None) is None
    assert Communicator(timeout=float("inf")).timeout is None
    assert Communicator(timeout=2).timeout == datetime.timedelta(seconds=2)
    assert Communicator(timeout=datetime.timedelta(minutes=1)).timeout == datetime.timedelta(seconds=60)
    assert DeMo([torch.nn.Parameter(torch.zeros(4, 4))], timeout=math.inf).comm.timeout is None
    assert MethodSpec("demo", 1e-3).timeout == DEFAULT_TIMEOUT_S  # what the demo and the study get


def _inf_steps(rank: int, world: int, timeout):
    os.environ["TRITON_INTERPRET"] = "0"
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 24, generator=g))]
    opt = DeMo(params, lr=0.01, compression_topk=4, compression_chunk=8, timeout=timeout)
    for step in range(3):
        params[0].grad = torch.randn(40, 24, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.step()
    mean = Communicator(timeout=timeout).all_reduce_mean(torch.full((3,), float(rank)), "all-reduce").wait()
    return params[0].detach().clone(), mean


def _slow_rank(rank: int, world: int, delay_s: float):
    os.environ["TRITON_INTERPRET"] = "0"
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(48, 40, generator=g))]
    opt = DeMo(params, lr=0.01, compression_topk=4, compression_chunk=8, timeout=10.0)
    for step in range(3):
        if step == 1 and rank == 1:
            time.sleep(delay_s)
        params[0].grad = torch.randn(48, 40, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.step()
    return params[0].detach().clone()


@pytest.fixture(scope="module")
def world2() -> dict[str, list]:
    """The timeout scenarios in one world of 2 ranks, each with its own optimizer."""
    cases = [Case("inf", _inf_steps, (math.inf,)), Case("30 s", _inf_steps, (30.0,))]
    cases += [Case("late", _slow_rank, (5.0,)), Case("prompt", _slow_rank, (0.0,))]
    return run_cases(2, cases)


@pytest.mark.distributed
@pytest.mark.slow
def test_timeout_inf_trains_like_no_timeout_across_ranks(world2):
    unlimited, limited = world2["inf"], world2["30 s"]
    for (p_inf, mean), (p_30, _) in zip(unlimited, limited, strict=True):
        assert torch.equal(p_inf, p_30)
        assert torch.equal(mean, torch.full((3,), 0.5))
    assert torch.equal(unlimited[0][0], unlimited[1][0])


# ----------------------------------------------------------------------------- a slow rank


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_5s_late_within_a_10s_timeout_continues_bit_identically(world2):
    late, prompt = world2["late"], world2["prompt"]
    assert all(torch.equal(a, b) for a, b in zip(late, prompt, strict=True))


# ----------------------------------------------------------------------------- a frozen or dead rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_frozen_or_dead_rank_gives_a_timeout_and_the_other_exits_at_once(tmp_path, fault):
    timeout = 3.0
    out = tmp_path / "rank0.json"
    port = str(free_port())
    cmd = [sys.executable, str(TESTS / "fault_rank.py"), "--fault", fault, "--timeout", str(timeout)]
    procs = [
        subprocess.Popen(
            [*cmd, "--out", str(out)],
            env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        try:
            procs[0].wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 did not exit ({fault}): a collective hung")
        exited, load = time.time(), os.getloadavg()[0]
        log = procs[0].stdout.read().decode(errors="replace") if procs[0].stdout else ""
        assert procs[0].returncode == 0, f"rank 0 exit code {procs[0].returncode}:\n{log}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seen = json.loads(out.read_text())
    # the process ends (error raised, retried, result written, interpreter gone) soon after
    # the collective that could not complete: no abandoned work keeps it alive
    assert exited - seen["before_failing_step"] < exit_bound(timeout, load), seen
    failed, retried, fresh = seen["failed"], seen["retried"], seen["fresh"]
    assert failed["kind"] == "CollectiveTimeout", seen
    message = failed["message"]
    assert message.startswith("DeMo.step: the status exchange"), message
    if fault == "stop":
        assert "did not complete within 3 s" in message, message
    for needle in ("cannot be retried in place", "last checkpoint", "state_dict()", "was aborted"):
        assert needle in message, message
    for attempt in (retried, fresh):  # the optimizer again, or anyone else on the same group
        assert attempt["kind"] == "ProcessGroupAborted", seen
        assert "aborted after an earlier collective failed" in attempt["message"]
        assert "last checkpoint" in attempt["message"]
    assert "another user of the group: cannot start the all-reduce" in fresh["message"]
    assert seen["aborted"] is True
    assert "SIGABRT" not in log and "preamble" not in log, log


# ----------------------------------------------------------------------------- the launcher dies


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_rank_outlives_the_demo_parent(tmp_path, sig):
    marker = uuid.uuid4().hex
    log_path = tmp_path / "demo.log"
    cmd = [sys.executable, "-m", "cokit", "demo", "--ranks", "2", "--steps", "100000", "--model", "toy"]
    cmd += ["--methods", "demo", "--eval-every", "20", "--max-chars", "200000", "--timeout", "60"]
    cmd += ["--out", str(tmp_path / "out")]
    with open(log_path, "w") as log:
        parent = subprocess.Popen(cmd, env=_env(**{MARKER: marker}), cwd=tmp_path, stdout=log, stderr=log)
    try:
        training = _wait_until(lambda: re.search(r"\[demo\] step +20/", log_path.read_text()), 240)
        assert training, f"the demo did not start training:\n{log_path.read_text()}"
        ranks = [p for p in _marked(marker) if "spawn_main" in p]
        assert len(ranks) == 2, _marked(marker)  # (and multiprocessing's resource tracker)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert parent.returncode == -sig, (parent.returncode, log_path.read_text())
        gone = _wait_until(lambda: not _marked(marker), 10.0)
        assert gone, f"left behind after {sig.name} to the parent: {_marked(marker)}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for line in _marked(marker):  # never leave them running, even when the test fails
            os.kill(int(line.split()[0]), signal.SIGKILL)


# ----------------------------------------------------------------------------- restart under torchrun


def _torchrun(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    ckpt, out = tmp_path / name / "ckpt", tmp_path / name / "final"
    out.parent.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += ["--local-addr", "127.0.0.1", "--monitor-interval", "0.2"]
    cmd += [str(TESTS / "torchrun_resume_worker.py"), "--ckpt", str(ckpt), "--steps", "12"]
    cmd += ["--out", str(out), *extra]
    proc = subprocess.Popen(
        cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in 240 s:\n{log.decode(errors='replace')[-6000:]}")
    assert proc.returncode == 0, log.decode(errors="replace")[-6000:]
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_restart_from_per_rank_checkpoints_resumes_exactly(tmp_path):
    straight = _torchrun(tmp_path, "straight")
    restarted = _torchrun(tmp_path, "restarted", "--kill-at", "6")
    assert [r["restart_count"] for r in straight] == [0, 0]
    assert [r["restart_count"] for r in restarted] == [1, 1]  # rank 1 died once, all restarted
    assert [r["resumed_from"] for r in restarted] == [5, 5]  # the newest step both ranks saved
    for a, b in zip(straight, restarted, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert all(torch.equal(p, q) for p, q in zip(straight[0]["params"], straight[1]["params"], strict=True))


# ----------------------------------------------------------------------------- cokit demo --timeout


def test_demo_timeout_reaches_every_method_it_builds():
    from cokit.cli import build_parser
    from cokit.commands.demo import _specs
    from cokit.train import build_method

    args = build_parser().parse_args(["demo", "--timeout", "60"])
    model = torch.nn.Linear(8, 4)
    demo, adamw = (build_method(spec, model) for spec in _specs(args, ["demo", "adamw"]))
    assert demo.optimizer.comm.timeout == adamw.comm.timeout == datetime.timedelta(seconds=60)
    default = build_parser().parse_args(["demo"])
    assert {s.timeout for s in _specs(default, ["demo", "adamw"])} == {DEFAULT_TIMEOUT_S}
    unlimited = build_parser().parse_args(["demo", "--timeout", "inf"])
    assert build_method(_specs(unlimited, ["demo"])[0], model).optimizer.comm.timeout is None


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_demo_rejects_a_bad_timeout_before_starting(value, capsys, tmp_path):
    from cokit.cli import main

    assert main(["demo", "--timeout", value, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--timeout must be a number of seconds > 0 (inf for no limit)" in err, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- every collective has the timeout


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "front, fault, says",
    [
        (
            "powersgd",
            "stop",
            "method 'powersgd' (powersgd_hook): the all-reduce of ddp bucket 0 did not complete",
        ),
        (
            "demo-bucketed",
            "stop-in-report",
            "demo.step: the settings report length did not complete within 3 s",
        ),
        ("hook", "stop-in-report", "dct_topk_hook: the settings report length did not complete within 3 s"),
    ],
)
def test_the_study_powersgd_and_the_mismatch_report_time_out_too(tmp_path, front, fault, says):
    """torch's PowerSGD hook (the study's method) and the report a settings mismatch gathers
    carry the timeout too: a peer frozen there gives an error naming the owner within the
    timeout, and the process exits by itself (rank 1 freezes: SIGSTOP)."""
    cell = run_cell(tmp_path, front, fault, 2, None)
    rank = cell["ranks"][0]
    record = rank["record"]
    assert rank["returncode"] == 0 and record is not None, rank["log"]
    assert record["outcome"] == "raised" and says in record["message"].lower(), record
    assert record["unchanged"], record
    assert rank["exited"] - record["fault_started"] < exit_bound(cell_timeout(fault), rank["load"]), record
    assert "terminate called" not in rank["log"], rank["log"]
