"""Shared test helpers: poisoned outputs, the shapes every kernel is checked on, workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The status rows every round opens with (cokit.compress.agreement): ROW_BYTES on agreement
# groups, ROW_BYTES + the policy measurement on the exchange group.
from cokit.compress.adaptation import STATUS_ROW_BYTES
from cokit.compress.agreement import ROW_BYTES
from cokit.triton_kernels import tiling
from cokit.workloads import CorpusConfig, ModelConfig, TextWorkloadConfig
from cokit.workloads.text import VOCAB_SIZE

STATUS_ROW = STATUS_ROW_BYTES
AGREEMENT_ROW = ROW_BYTES

SHAPES = [(1,), (7,), (3, 5), (64, 64), (96, 128), (130, 70), (16, 3, 3, 3)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def toy_workload() -> TextWorkloadConfig:
    """The smallest text workload the runner trains: the toy model on 100k characters."""
    return TextWorkloadConfig(
        corpus=CorpusConfig(max_chars=100_000),
        model=ModelConfig.preset("toy", VOCAB_SIZE),
        batch_size=4,
        eval_batches=2,
    )


def _poisoned(shape, dtype, device):
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if dtype.is_floating_point:
        return out.fill_(float("nan"))
    return out.fill_(-7)


@pytest.fixture
def poison(monkeypatch):
    """Every kernel output starts as NaN (floats) or -7 (indices)."""
    monkeypatch.setattr(tiling, "empty_output", _poisoned)


class LaunchSpy:
    """Stands in for a Triton kernel (``monkeypatch.setattr(module, name, LaunchSpy(kernel))``)
    and records the keyword arguments of every launch before running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return run


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` whose data starts one element past an aligned address."""
    return torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape).copy_(x)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned elements)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def byte_counts(stats: dict) -> dict:
    """``CommStats.as_dict()`` without its timing (seconds differ between equal runs)."""
    return {k: v for k, v in stats.items() if not k.endswith("_s") and k != "step_collectives"}


class SmallNet(torch.nn.Module):
    """A two-layer regression net with a LayerNorm (130 wide: odd tiles) for DeMo tests."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 130)
        self.norm = torch.nn.LayerNorm(130)
        self.b = torch.nn.Linear(130, 1)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def regression_data(rank: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of rank ``rank``'s share of one linear regression problem."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 1, generator=g)
    g.manual_seed(100 + rank)
    x = torch.randn(n, 24, generator=g)
    return x, x @ w


ROOT = Path(__file__).resolve().parents[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a test script run as a process of its own: without
    ``TRITON_INTERPRET`` (it decides, e.g. the torch path), this tree importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


def torchrun_ok(script: Path, *args: str, nproc: int = 2, timeout: float = 300) -> None:
    """Run ``script`` under ``torch.distributed.run --standalone`` on ``nproc`` CPU ranks (the
    torch path, one thread each); fail the test with its output unless it exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = script_env(TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*cmd, str(script), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def end_process_group() -> None:
    """End a worker's process group before the interpreter exits (after the caller dropped its
    references to the trainer, model and optimizer): a group torn down during exit can abort
    the process ("terminate called without an active exception", seen once in CI)."""
    import gc

    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def assert_resumed_like_the_reference(ref: list[dict], res: list[dict]) -> None:
    """An integration worker's facts per rank: the resumed run ends where the uninterrupted one
    did (step, lr, parameters bit for bit), sent bytes, and never double-synced."""
    for r, (a, b) in enumerate(zip(ref, res, strict=True)):
        assert not [w for w in a["warnings"] + b["warnings"] if "DoubleSync" in w]
        assert a["bytes_sent"] > 0
        assert a["global_step"] == b["global_step"] == 6
        assert a["lr"] == b["lr"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y), f"rank {r}: resumed parameters differ from the uninterrupted run"


def worker_report(script: str, *args: str, mark: str, timeout: float, **env_defaults: str) -> dict:
    """Run the test file ``script`` as a script without ``TRITON_INTERPRET`` and return the JSON
    it prints after ``mark``: GPU-path code (compile-only builds, traced graphs) needs a process
    where ``@triton.jit`` gives real ``JITFunction``s."""
    env = script_env()
    for key, value in env_defaults.items():
        env.setdefault(key, value)
    proc = subprocess.run(
        [sys.executable, str(Path(script).resolve()), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    assert proc.returncode == 0 and lines, (
        f"{Path(script).name} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return json.loads(lines[-1][len(mark) :])


def dcp_save(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str) -> None:
    """Save ``model`` and ``opt`` with torch.distributed.checkpoint (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str) -> None:
    """Load what :func:`dcp_save` wrote into ``model`` and ``opt`` (DCP steps a fresh optimizer
    with lr 0 first, to make its state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
