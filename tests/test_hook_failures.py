"""The DDP hook's timeout and what a failed hook leaves: every collective has a finite default
timeout, a frozen peer makes the live ranks' ``backward()`` raise within the timeout, and the
DDP model's next step raises :class:`~cokit.compress.hooks.CommHookFailed` (not torch's
reducer assert) on every live rank; the processes exit by themselves, without SIGABRT.

The frozen-peer runs start their ranks as processes of their own (tests/hook_failure_rank.py),
so that how each one ends is seen; the other scenarios share spawned gloo worlds.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo_cases import Case, run_cases
from helpers import ROOT, script_env

from cokit.compress import DeMo, SparseLoCo
from cokit.compress.comm import DEFAULT_TIMEOUT_S, Communicator
from cokit.compress.exchange import Exchange
from cokit.compress.frontend import FrontEndOptions
from cokit.compress.hooks import CommHookFailed, DCTTopKState, dct_topk_hook
from tests.matrix_cells import exit_bound

RANK = Path(__file__).resolve().parent / "hook_failure_rank.py"
DEFAULT = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


# ----------------------------------------------------------------------------- the default timeout


def test_every_front_end_and_the_hook_default_to_the_same_finite_timeout():
    assert math.isfinite(DEFAULT_TIMEOUT_S) and 0 < DEFAULT_TIMEOUT_S < 30 * 60  # below gloo's own
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    assert DCTTopKState().timeout == DEFAULT_TIMEOUT_S
    assert DCTTopKState().exchange.comm.timeout == DEFAULT
    assert FrontEndOptions().timeout == FrontEndOptions.checked("DeMo", {}).timeout == DEFAULT_TIMEOUT_S
    assert DeMo(params).comm.timeout == DEFAULT
    assert SparseLoCo(params, lambda ps: torch.optim.SGD(ps, lr=0.1)).exchange.comm.timeout == DEFAULT
    assert Communicator().timeout == Exchange("x").comm.timeout == DEFAULT


def test_no_limit_of_cokit_s_own_only_when_asked_for():
    for unlimited in (None, math.inf):
        assert DCTTopKState(timeout=unlimited).timeout is None
        assert DCTTopKState(timeout=unlimited).exchange.comm.timeout is None
        assert DeMo([torch.nn.Parameter(torch.zeros(4, 4))], timeout=unlimited).comm.timeout is None
    assert DCTTopKState(timeout=2).exchange.comm.timeout == datetime.timedelta(seconds=2)


def _carried_timeouts(rank: int, world: int) -> list:
    """The timeout each collective of a default DCTTopKState's hook carries, over 3 steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["TRITON_INTERPRET"] = "0"
    seen = []
    options = Communicator._options

    def spy(self, opts, group, tensor):
        out = options(self, opts, group, tensor)
        seen.append((out[0].timeout, out[1]))
        return out

    Communicator._options = spy  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        net = DDP(torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Linear(64, 8)))
        net.register_comm_hook(DCTTopKState(topk=4, chunk=16), dct_topk_hook)
        for _ in range(3):
            net(torch.randn(16, 24)).sum().backward()
    finally:
        Communicator._options = options  # type: ignore[method-assign]
    return seen


# ----------------------------------------------------------------------------- a failed hook


def _mismatch(rank: int, world: int) -> dict:
    """The last rank changes topk at step 2: the status exchange raises on every rank, inside
    the hook; the group stays usable, DDP's reducer does not."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["TRITON_INTERPRET"] = "0"
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Linear(64, 8)))
    state = DCTTopKState(topk=4, chunk=16)
    net.register_comm_hook(state, dct_topk_hook)
    errors = []
    for step in range(4):
        if step == 2 and rank == world - 1:
            state.topk = 8
        try:
            net(torch.randn(16, 24)).sum().backward()
            errors.append(None)
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
    try:
        dct_topk_hook(state, None)  # type: ignore[arg-type]  # a backward with no forward first
    except Exception as exc:
        errors.append((type(exc).__name__, str(exc)))
    return {"errors": errors}


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict[str, list]]:
    """The gloo scenarios, one spawned world per size."""
    return {
        2: run_cases(2, [Case("carried", _carried_timeouts), Case("mismatch", _mismatch)]),
        3: run_cases(3, [Case("mismatch", _mismatch)]),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_the_hook_s_collectives_carry_the_default_timeout(worlds):
    for seen in worlds[2]["carried"]:
        assert len(seen) >= 3 * 3  # per step: the status row, the dense all-reduce, the payload
        assert set(seen) == {(DEFAULT, True)}, seen  # gloo's work itself ends at the timeout


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_after_a_hook_error_the_next_step_raises_a_cokit_error_on_every_rank(worlds, world):
    assert issubclass(CommHookFailed, RuntimeError)
    for rank, out in enumerate(worlds[world]["mismatch"]):
        first, *later = out["errors"][2:]
        assert out["errors"][:2] == [None, None], (rank, out)
        assert first[0] == "SettingsMismatch" and "the ranks disagree" in first[1], (rank, first)
        assert len(later) == 2, (rank, out)  # the next forward, and the hook called again
        for kind, message in later:
            assert kind == "CommHookFailed", (rank, message)
            assert "INTERNAL ASSERT" not in message
            assert message.startswith(
                "dct_topk_hook: this DDP model cannot take another step: its comm hook failed at "
                "iteration 2 (SettingsMismatch: "
            ), message
            for needle in ("DDP's reducer stopped mid-iteration", "Build a new DDP model", "checkpoint"):
                assert needle in message, message
            assert "process group is unusable" not in message


def _frozen_peer(tmp: Path, freeze: str, world: int, timeout: float) -> list[dict]:
    """Run tests/hook_failure_rank.py on ``world`` ranks; what each live rank saw and how it ended."""
    init = f"file://{tmp / 'store'}"
    procs = []
    for r in range(world):
        cmd = [sys.executable, str(RANK), "--freeze", freeze, "--rank", str(r), "--world", str(world)]
        cmd += ["--init", init, "--timeout", str(timeout), "--out", str(tmp / f"rank{r}.json")]
        log = open(tmp / f"rank{r}.log", "wb")  # noqa: SIM115 (closed below)
        env = script_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    seen = []
    try:
        for r, (proc, _) in enumerate(procs[:-1]):
            try:
                proc.wait(timeout=240)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} did not exit ({freeze}, world {world}): a collective hung")
            seen.append({"exited": time.time(), "load": os.getloadavg()[0], "returncode": proc.returncode})
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    for r, rank in enumerate(seen):
        rank["log"] = (tmp / f"rank{r}.log").read_text(errors="replace")
        path = tmp / f"rank{r}.json"
        rank["record"] = json.loads(path.read_text()) if path.exists() else None
    return seen


@pytest.mark.distributed
@pytest.mark.slow
# each freeze once, each world once: a run starts a fresh interpreter per rank (seconds each)
@pytest.mark.parametrize(("freeze", "world"), [("status", 2), ("payload", 3)])
def test_a_frozen_peer_raises_within_the_timeout_then_the_next_step_says_what_to_do(tmp_path, freeze, world):
    timeout = 3.0
    for r, rank in enumerate(_frozen_peer(tmp_path, freeze, world, timeout)):
        log, record = rank["log"], rank["record"]
        assert rank["returncode"] == 0, f"rank {r} exit code {rank['returncode']}:\n{log}"
        for bad in ("terminate called", "SIGABRT", "core dumped", "INTERNAL ASSERT"):
            assert bad not in log, f"rank {r}: {bad}:\n{log}"
        assert record is not None, f"rank {r} wrote nothing:\n{log}"
        failed, after = record["failed"], record["next"]
        # the failing step: the timeout, within it (and the process gone soon after)
        assert failed["kind"] in ("CollectiveTimeout", "RuntimeError"), record  # DDP's future: wrapped
        assert f"did not complete within {timeout:g} s" in failed["message"], record
        assert failed["after_s"] < exit_bound(timeout, rank["load"]), record
        assert rank["exited"] - record["before_failing_step"] < exit_bound(timeout, rank["load"]), record
        # the next step: cokit's error, at once
        assert after["kind"] == "CommHookFailed", record
        message = after["message"]
        assert message.startswith("dct_topk_hook: this DDP model cannot take another step"), message
        assert f"did not complete within {timeout:g} s" in message, message
        for needle in ("process group is unusable", "last checkpoint", "destroy_process_group()"):
            assert needle in message, message
